"""A CPU-bound neighbour process for ``python -m bench --load``: one core kept busy beside the bench.

It stands for another job on the node (a data loader, another user's training): a Python loop
that never sleeps, at the same priority as the bench. Its CPU time is recorded, so the JSON shows
that it really ran (about 1 CPU-second per second of wall time when a core was free for it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

_BUSY = "while True:\n    pass\n"


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` from ``/proc/<pid>/stat`` (None when unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


@contextlib.contextmanager
def busy_neighbour() -> Iterator[dict[str, Any]]:
    """Run one busy process while the block runs; yields a dict that gets, at the end, ``pid``,
    ``wall_s``, ``cpu_s`` and ``cpu_fraction`` (CPU seconds per wall second)."""
    proc = subprocess.Popen([sys.executable, "-c", _BUSY], stdin=subprocess.DEVNULL)
    info: dict[str, Any] = {"pid": proc.pid, "command": f"{sys.executable} -c {_BUSY!r}"}
    started = time.monotonic()
    try:
        yield info
    finally:
        cpu = _cpu_s(proc.pid)
        wall = time.monotonic() - started
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        info.update(wall_s=wall, cpu_s=cpu, cpu_fraction=(cpu / wall) if cpu is not None and wall > 0 else None)
