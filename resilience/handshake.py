"""The launcher <-> rank handshake that keeps an early stop signal from being lost or fatal.

A signal forwarded to a rank before it installed its handler would kill it (the default action
of SIGUSR1/SIGTERM). So the launcher (or the batch script) first records the stop in a file,
and forwards the signal only to ranks that said they are ready; a rank says so right after its
handlers are installed and then reads the file. Whichever side acts second sees the other's
mark, so the stop reaches every rank exactly as if the signal had arrived.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

READY_DIR_ENV = "RESILIENCE_READY_DIR"
"""Directory where each rank creates ``rank_<RANK>`` once its signal handlers are installed."""
STOP_FILE_ENV = "RESILIENCE_STOP_FILE"
"""A file whose existence means "a stop was requested" (launcher or batch script writes it)."""


def ready_marker(ready_dir: str | os.PathLike, rank: int) -> Path:
    """Path of rank ``rank``'s ready marker."""
    return Path(ready_dir) / f"rank_{rank}"


def mark_ready_and_check_stop(env: Mapping[str, str] | None = None) -> bool:
    """Called by a rank after its handlers are installed: create its ready marker, then return
    whether a stop was already requested. Order matters (mark first, then read)."""
    env = os.environ if env is None else env
    ready_dir = env.get(READY_DIR_ENV)
    if ready_dir and os.path.isdir(ready_dir):
        try:
            ready_marker(ready_dir, int(env.get("RANK", "0"))).touch()
        except OSError:
            pass  # the launcher then falls back to its ready timeout
    return stop_requested(env)


def stop_requested(env: Mapping[str, str] | None = None) -> bool:
    """True when the file named by ``RESILIENCE_STOP_FILE`` exists."""
    env = os.environ if env is None else env
    path = env.get(STOP_FILE_ENV)
    return bool(path) and os.path.exists(path)


def request_stop(stop_file: str | os.PathLike) -> None:
    """Record a stop request (creates the file; idempotent)."""
    Path(stop_file).touch()
