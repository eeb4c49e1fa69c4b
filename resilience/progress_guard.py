"""The requeue-loop guard: consecutive starts from the same ``LATEST`` mean no progress.

A job that is preempted before it can save anything new (a signal during model building each
time, a wall time shorter than the way to the first checkpoint) would be requeued forever.
Rank 0 counts, in ``checkpoint_dir/.starts.json``, how many consecutive starts began from the
same checkpoint; past the limit the run exits with ``ExitCode.NO_PROGRESS`` (76), which the
Slurm templates never requeue. A new checkpoint resets the count; finishing removes the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

STARTS_FILE = ".starts.json"


def count_start(root: Path, resume_point: str | None) -> int:
    """Record one start from ``resume_point`` (a checkpoint name, ``None`` for a fresh start);
    returns how many consecutive starts, this one included, began from it (rank 0 only)."""
    path = root / STARTS_FILE
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        doc = {}
    starts = int(doc.get("starts", 0)) + 1 if doc.get("resume_point", "") == resume_point else 1
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{STARTS_FILE}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps({"resume_point": resume_point, "starts": starts}))
    os.replace(tmp, path)
    return starts


def no_progress(starts: int, limit: int | None) -> bool:
    """True when the ``limit`` attempts before this one all started from the same checkpoint as
    this one and none of them saved a new one (``limit`` None: the guard is off)."""
    return limit is not None and starts - 1 >= limit


def reset(root: Path) -> None:
    """Forget the count (training finished)."""
    try:
        (root / STARTS_FILE).unlink()
    except FileNotFoundError:
        pass
