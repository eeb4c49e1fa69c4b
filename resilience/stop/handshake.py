"""The launcher <-> rank handshake that keeps an early stop signal from being lost or fatal.

A signal forwarded to a rank before it installed its handler would kill it (the default action
of SIGUSR1/SIGTERM). So the launcher (or the batch script) first records the stop in a file,
and forwards the signal only to ranks that said they are ready; a rank says so right after its
handlers are installed and then reads the file. Whichever side acts second sees the other's
mark, so the stop reaches every rank exactly as if the signal had arrived.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from resilience.env_names import READY_DIR_ENV, STOP_FILE_ENV, TORCH


def ready_marker(ready_dir: str | os.PathLike, rank: int) -> Path:
    """Path of rank ``rank``'s ready marker."""
    return Path(ready_dir) / f"rank_{rank}"


def stop_taken_marker(ready_dir: str | os.PathLike, rank: int) -> Path:
    """Path of rank ``rank``'s "stop taken" marker: the rank found the stop file when it got
    ready and acts on it, so the launcher drops the stop signals it held for that rank."""
    return Path(ready_dir) / f"rank_{rank}.stop_taken"


def mark_ready_and_check_stop(env: Mapping[str, str] | None = None, *, acts_on_stop: bool = True) -> bool:
    """Called by a rank after its handlers are installed: create its ready marker, then return
    whether a stop was already requested. Order matters (mark first, then read).

    When a stop was requested and ``acts_on_stop`` (the rank stops for it), the rank also
    creates its :func:`stop_taken_marker`: the stop has reached it, and a held signal delivered
    later could land after its loop ended and its default disposition (terminate) is back."""
    env = os.environ if env is None else env
    ready_dir = env.get(READY_DIR_ENV)
    rank = int(env.get(TORCH["rank"], "0"))
    if ready_dir and os.path.isdir(ready_dir):
        try:
            ready_marker(ready_dir, rank).touch()
        except OSError:
            pass  # the launcher then falls back to its ready timeout
    stopped = stop_requested(env)
    if stopped and acts_on_stop and ready_dir and os.path.isdir(ready_dir):
        try:
            stop_taken_marker(ready_dir, rank).touch()
        except OSError:
            pass  # the launcher then delivers the held signal, which the handler still records
    return stopped


def stop_requested(env: Mapping[str, str] | None = None) -> bool:
    """True when the file named by ``RESILIENCE_STOP_FILE`` exists."""
    env = os.environ if env is None else env
    path = env.get(STOP_FILE_ENV)
    return bool(path and os.path.exists(path))


def request_stop(stop_file: str | os.PathLike) -> None:
    """Record a stop request (creates the file; idempotent)."""
    Path(stop_file).touch()
