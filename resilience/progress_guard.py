"""The requeue-loop guard: consecutive starts from the same ``LATEST`` mean no progress.

A job that is preempted before it can save anything new (a signal during model building each
time, a wall time shorter than the way to the first checkpoint) would be requeued forever.
Rank 0 counts, in ``checkpoint_dir/.starts.json``, how many consecutive starts began from the
same checkpoint; past the limit the run exits with ``ExitCode.NO_PROGRESS`` (76), which the
Slurm templates never requeue. A new checkpoint resets the count; finishing removes the file.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from resilience.exit_codes import ExitCode

if TYPE_CHECKING:  # torch-free at run time
    from resilience.distributed import DistContext

log = logging.getLogger("resilience")

STARTS_FILE = ".starts.json"


def must_end(ctx: DistContext, root: Path, resumed_from: Path | None, limit: int | None) -> bool:
    """The guard at a run's start, a collective over ``ctx``: rank 0 counts this start from
    ``resumed_from`` (``None``: a fresh start) and every rank learns whether the ``limit``
    attempts before it saved nothing new. True (with the error logged) when this run must end
    with ``ExitCode.NO_PROGRESS``; always False when ``limit`` is None."""
    if limit is None:
        return False
    stop = None
    if ctx.rank == 0:
        starts = count_start(root, resumed_from.name if resumed_from is not None else None)
        stop = starts if no_progress(starts, limit) else None
    stop = ctx.broadcast_object(stop)
    if stop is None:
        return False
    log.error(
        "rank %d: this is start %d in a row from %s: the %d attempts before it saved no new checkpoint; "
        "exiting with %d (NO_PROGRESS, not requeued). Fix the cause (a signal before the first step each "
        "time, a wall time too short to reach a checkpoint), then delete %s to try again",
        ctx.rank, stop, resumed_from.name if resumed_from else "a fresh start", stop - 1,
        int(ExitCode.NO_PROGRESS), root / STARTS_FILE,
    )
    return True


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
