"""Which checkpoint a resume takes: one pure chooser, shared by the loader and ``resilience status``.

:func:`choose` walks :func:`resume_candidates` in order and returns the first one that passes
the caller's ``check``. It writes nothing and imports no torch: the loader
(:mod:`~resilience.checkpoint.reader`) passes :func:`~resilience.checkpoint.storage.manifest.validate`
and then marks what it skipped as bad; ``resilience status`` passes the states it already computed
and only reports. Leftover cleanup at start-up (:func:`remove_leftovers`) is the load side's too.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from typing import Any

from resilience.checkpoint.layout import BAD_MARKER, LATEST, STAGING_PREFIX, TRASH_PREFIX, checkpoint_counters, list_checkpoints, parse_checkpoint_name
from resilience.checkpoint.policy.lineage import lineage, meta_of
from resilience.checkpoint.policy.orphans import remove_orphans
from resilience.checkpoint.storage.durable import fsync_dir
from resilience.checkpoint.storage.manifest import CheckpointInvalid
from resilience.checkpoint.storage.object_path import Location, ObjectPath
from resilience.checkpoint.storage.pointers import PointerError, read_pointer


@dataclasses.dataclass
class Skipped:
    """A candidate passed over: ``why`` is the check's message, or the ``.bad`` marker's path."""

    path: Location
    why: str
    marked_bad: bool
    """It carried a ``.bad`` marker from an earlier start (so it was not checked again)."""


@dataclasses.dataclass
class ResumeChoice:
    """The result of :func:`choose`."""

    chosen: Location | None
    """The checkpoint to resume from; ``None`` for a fresh start."""
    manifest: dict[str, Any] | None
    """``chosen``'s manifest as ``check`` returned it (parsed once, passed on to the load)."""
    latest: Location | None
    """Where ``LATEST`` points, or ``None`` (absent or unreadable)."""
    latest_problem: str | None
    """Why ``LATEST`` was ignored (an unreadable pointer), or ``None``."""
    candidates: list[Location]
    skipped: list[Skipped]


def choose(root: Location, check: Callable[[Location], dict[str, Any]]) -> ResumeChoice:
    """The first of :func:`resume_candidates` that is not marked bad and passes ``check``.

    Args:
        root: the checkpoint root (``checkpoint.checkpoint_dir``).
        check: returns a candidate's manifest, or raises :class:`CheckpointInvalid` saying why it
            cannot be resumed from (missing file, wrong size, ...).

    Never writes; raises nothing of its own.
    """
    try:
        latest, latest_problem = read_pointer(root, LATEST), None
    except PointerError as exc:
        latest, latest_problem = None, str(exc)
    candidates = resume_candidates(root, latest)
    skipped: list[Skipped] = []
    for path in candidates:
        if (path / BAD_MARKER).exists():
            skipped.append(Skipped(path, str(path / BAD_MARKER), marked_bad=True))
            continue
        try:
            manifest = check(path)
        except CheckpointInvalid as exc:
            skipped.append(Skipped(path, str(exc), marked_bad=False))
            continue
        return ResumeChoice(path, manifest, latest, latest_problem, candidates, skipped)
    return ResumeChoice(None, None, latest, latest_problem, candidates, skipped)


def resume_candidates(root: Location, latest: Location | None) -> list[Location]:
    """Checkpoints to try, in order: ``LATEST`` (without it, the most recently saved checkpoint),
    its lineage, then the other checkpoints (no newer than ``LATEST`` when there is one), newest
    step first. Read-only."""
    listed = list_checkpoints(root)  # newest step first
    parsed = parse_checkpoint_name(latest.name) if latest is not None else None
    if latest is None:
        # max() keeps the first of equals: checkpoints without saved_at fall back to the highest step
        head = max(listed, key=_saved_at) if listed else None
    else:
        head = latest
        listed = [path for path in listed if parsed is None or checkpoint_counters(path.name)[1] <= parsed[1]]
    if head is None:
        return []
    candidates = lineage(root, head) if head.is_dir() else [head]
    return candidates + [path for path in listed if path not in candidates]


def _saved_at(directory: Location) -> float:
    value = meta_of(directory).get("saved_at")
    return float(value) if isinstance(value, (int, float)) else 0.0


def remove_leftovers(root: Location) -> list[Location]:
    """Delete staging and trash directories left by a crashed save (rank 0, at start-up, before
    :func:`choose`). Returns what was removed.

    A trash directory whose checkpoint name is absent (a crash between the two renames of a
    re-save) is the only copy of that checkpoint: it is renamed back instead of deleted. On object
    storage: the objects no committed manifest names (:func:`~resilience.checkpoint.policy.orphans.remove_orphans`).
    """
    if isinstance(root, ObjectPath):
        return [root / prefix for prefix in remove_orphans(root)]
    removed: list[Location] = []
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith(TRASH_PREFIX) and child.is_dir():
                original = root / child.name[len(TRASH_PREFIX) :]
                if not original.exists() and not original.is_symlink():
                    os.rename(child, original)
                    fsync_dir(root)
                    continue
            if child.name.startswith((STAGING_PREFIX, TRASH_PREFIX)) and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
    return removed
