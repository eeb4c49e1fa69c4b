"""The launcher's temporary handshake directories (``$TMPDIR/resilience-ranks-*``) and their cleanup.

Each launch makes one directory for the ranks' ready markers and the stop file
(:mod:`resilience.stop.handshake`) and removes it when its ranks have exited, also after they crashed
(:meth:`~resilience.launch.rank_group.RankGroup.close`). A launcher that is SIGKILLed (the OOM
killer, ``scancel`` after ``KillWait``) cannot; so each directory records its launcher in a file
``launcher`` (``<pid> <start time>``), and every launch first removes the directories whose
launcher is gone. The start time (``psutil``'s ``create_time``, seconds since the epoch) tells a
recycled pid from the launcher itself. A directory without that file (being created right now,
or made by an older version) is left alone.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import psutil

PREFIX = "resilience-ranks-"
OWNER_FILE = "launcher"
# psutil derives create_time from boot time + clock ticks: equal for the same process, far
# apart (>= one tick, 10 ms) for another process that reused the pid.
_SAME_START_S = 0.005


def _start_time(pid: int) -> float | None:
    """``create_time`` of a live (not zombie) process ``pid``; ``None`` when there is none."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except psutil.NoSuchProcess:
        return None


def _owner_alive(directory: str) -> bool | None:
    """Whether the launcher recorded in ``directory`` still runs; ``None`` when no valid record."""
    try:
        with open(os.path.join(directory, OWNER_FILE)) as fh:
            pid_text, start_text = fh.read().split()
        pid, start = int(pid_text), float(start_text)
    except (OSError, ValueError):
        return None
    try:
        now = _start_time(pid)
    except psutil.AccessDenied:
        return True  # someone else's process: not ours to judge
    return now is not None and abs(now - start) < _SAME_START_S


def remove_stale_ready_dirs(parent: str | None = None) -> list[str]:
    """Remove this user's handshake directories under ``parent`` (default: the temp dir) whose
    launcher is gone. Returns the paths removed. Never raises for a directory it cannot read or
    remove (another launcher may be removing it at the same time)."""
    parent = parent or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        try:
            if not entry.name.startswith(PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if _owner_alive(entry.path) is False:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def make_ready_dir() -> str:
    """Remove stale directories (:func:`remove_stale_ready_dirs`), then create this launch's and
    record this process in it. Returns its path.

    Raises:
        OSError: the directory or its record cannot be written (the directory is removed first).
    """
    remove_stale_ready_dirs()
    path = tempfile.mkdtemp(prefix=PREFIX)
    try:
        start = _start_time(os.getpid())
        tmp = os.path.join(path, f".{OWNER_FILE}.tmp")
        with open(tmp, "w") as fh:
            fh.write(f"{os.getpid()} {start!r}\n")
        os.replace(tmp, os.path.join(path, OWNER_FILE))  # a reader sees the whole record or none
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path
