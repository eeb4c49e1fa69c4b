"""The requeue-loop guard: consecutive starts from the same ``LATEST`` mean no progress.

A job that never gets far enough to save anything new would be requeued forever: a crash (or a
kill) before its first checkpoint each time, a signal during model building each time, a wall
time shorter than the way to the first checkpoint. Rank 0 counts, in
``checkpoint_dir/.starts.json``, the starts that began from the same checkpoint, in two kinds:

* **failed**: the start never reported a clean end: it raised, crashed, was killed, or (seen
  from ``resilience status``) is still running. ``checkpoint.max_restarts_without_progress``
  (default 3) such starts and the next one exits ``ExitCode.NO_PROGRESS`` (76).
* **preempted**: the start ended in an agreed stop, exit 75, with nothing new to publish (a
  signal before its first step): a clean preemption, not a failure. These are bounded
  separately and more loosely, by ``checkpoint.max_preemptions_without_progress`` (default 10),
  so a job whose every start is preempted before it can checkpoint still ends, outside Slurm
  too (under the Slurm templates ``slurm.max_restarts`` also bounds every requeue).

Each start is recorded as running when it is counted; a clean stop marks it preempted. A new
checkpoint resets the counts (the next start begins from another one); finishing removes the
file. The templates never requeue 76.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resilience.checkpoint.layout import STARTS_FILE
from resilience.exit_codes import ExitCode

if TYPE_CHECKING:  # torch-free at run time
    from resilience.config.checkpoint import CheckpointConfig
    from resilience.distributed import DistContext

log = logging.getLogger("resilience")


def must_end(ctx: DistContext, root: Path, resumed_from: Path | None, limit: int | None, preemption_limit: int | None = None) -> bool:
    """The guard at a run's start, a collective over ``ctx``: rank 0 counts this start from
    ``resumed_from`` (``None``: a fresh start) and every rank learns whether the starts before it
    from there exceed a limit (see :func:`verdict`). True (with the reason logged) when this run
    must end with ``ExitCode.NO_PROGRESS``; always False when both limits are None."""
    if limit is None and preemption_limit is None:
        return False
    why = None
    if ctx.rank == 0:
        resume_point = resumed_from.name if resumed_from is not None else None
        doc = count_start(root, resume_point)
        why = verdict(doc["failed"], doc["preempted"], limit, preemption_limit)
        if why is not None:  # this start ends here, and says so: not one that never reported
            _write(root, {**doc, "running": False, "refused": doc["refused"] + 1})
    why = ctx.broadcast_object(why)
    if why is None:
        return False
    log.error(
        "rank %d: start from %s: %s; exiting with %d (NO_PROGRESS, not requeued). Fix the cause, then delete %s to try again",
        ctx.rank,
        resumed_from.name if resumed_from else "a fresh start",
        why,
        int(ExitCode.NO_PROGRESS),
        root / STARTS_FILE,
    )
    return True


def must_end_for(config: CheckpointConfig, ctx: DistContext, root: Path, resumed_from: Path | None) -> bool:
    """:func:`must_end` with the limits of ``config`` (``checkpoint.*``); always False when the
    checkpoint is disabled or saving is off."""
    if not (config.enabled and config.enable_save):
        return False
    return must_end(ctx, root, resumed_from, config.max_restarts_without_progress, config.max_preemptions_without_progress)


def read(root: Path) -> dict[str, Any] | None:
    """The counts in ``root/.starts.json``: ``{"resume_point", "failed", "preempted", "running",
    "refused"}`` (``refused``: starts that exited ``NO_PROGRESS`` at once; they count as neither
    failed nor preempted), or None when there is no readable file. A file of an older version (``{"resume_point",
    "starts"}``, every start counted alike) reads as that many failed starts."""
    try:
        doc = json.loads((root / STARTS_FILE).read_text())
        if "failed" in doc:
            failed, preempted, running = int(doc["failed"]), int(doc.get("preempted", 0)), bool(doc.get("running"))
        else:
            failed, preempted, running = int(doc["starts"]), 0, False
        refused = int(doc.get("refused", 0))
        return {"resume_point": doc.get("resume_point"), "failed": failed, "preempted": preempted, "running": running, "refused": refused}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write(root: Path, doc: dict[str, Any]) -> None:
    path = root / STARTS_FILE
    if not isinstance(root, Path):  # object storage: one PUT replaces the object atomically
        path.write_text(json.dumps({**doc, "starts": starts(doc)}))
        return
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{STARTS_FILE}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps({**doc, "starts": starts(doc)}))
    os.replace(tmp, path)


def starts(doc: dict[str, Any]) -> int:
    """Every start counted in ``doc`` (see :func:`read`), however it ended."""
    return doc["failed"] + doc["preempted"] + int(doc["running"]) + doc.get("refused", 0)


def before_next_start(doc: dict[str, Any] | None, resume_point: str | None) -> tuple[int, int]:
    """(failed, preempted): the earlier starts a start from ``resume_point`` counts, given the file's
    ``doc`` (``None``: no file yet). A recorded start that never reported a clean end counts as failed."""
    if doc is None or doc["resume_point"] != resume_point:
        return 0, 0  # a new checkpoint since (or none counted yet): progress
    return doc["failed"] + int(doc["running"]), doc["preempted"]


def count_start(root: Path, resume_point: str | None) -> dict[str, Any]:
    """Record one start from ``resume_point`` (a checkpoint name, ``None`` for a fresh start) as
    running; returns the counts of the earlier starts from it (see :func:`read`; rank 0 only)."""
    earlier = read(root)
    failed, preempted = before_next_start(earlier, resume_point)
    refused = earlier["refused"] if earlier is not None and earlier["resume_point"] == resume_point else 0
    doc = {"resume_point": resume_point, "failed": failed, "preempted": preempted, "running": True, "refused": refused}
    _write(root, doc)
    return doc


def record_clean_stop(root: Path, resume_point: str | None, *, saved_new: bool = False) -> None:
    """Rank 0, once a stop was agreed and its checkpoint (if any) published: this start from
    ``resume_point`` ended as a clean preemption (exit 75), not a failure. A start that saved a
    new checkpoint (``saved_new``) is not one "preempted before saving anything new": the count
    is removed, and the next start, from that checkpoint, begins a new one."""
    if saved_new:
        reset(root)
        return
    doc = read(root)
    if doc is None or doc["resume_point"] != resume_point or not doc["running"]:
        return
    _write(root, {**doc, "preempted": doc["preempted"] + 1, "running": False})


def verdict(failed: int, preempted: int, limit: int | None, preemption_limit: int | None) -> str | None:
    """Why a start after ``failed`` failed and ``preempted`` cleanly preempted starts from the same
    checkpoint must exit ``NO_PROGRESS``, or None when it may train (a limit of None is off)."""
    if limit is not None and failed >= limit:
        return (
            f"the {failed} starts before it from the same checkpoint ended without a clean stop (an exception, "
            f"a crash or a kill) and saved nothing new (checkpoint.max_restarts_without_progress: {limit})"
        )
    if preemption_limit is not None and preempted >= preemption_limit:
        return (
            f"the {preempted} starts before it from the same checkpoint were each preempted before they could "
            f"save anything new (checkpoint.max_preemptions_without_progress: {preemption_limit}): a wall time "
            "too short to reach a checkpoint, or a signal during start-up every time"
        )
    return None


def reset(root: Path) -> None:
    """Forget the count (training finished, or a clean stop after a new checkpoint)."""
    try:
        (root / STARTS_FILE).unlink()
    except FileNotFoundError:
        pass
