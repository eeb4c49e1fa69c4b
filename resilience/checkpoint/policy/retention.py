"""Retention: keep a recent window of checkpoints plus every checkpoint a pointer names.

Semantics follow NeMo AutoModel's ``checkpoint.max_recent_checkpoints``:

* the window is the newest ``keep`` checkpoint directories, ordered by global step (then epoch),
  the lineage of the checkpoint just published first (:mod:`resilience.checkpoint.policy.lineage`);
  after a rollback, the abandoned timeline's checkpoints at higher steps than the one just
  published are neither counted nor removed (the user deletes them; the run sets each aside when
  it reaches its step), so they never push out the newest checkpoints of the timeline being trained;
* the targets of ``LATEST``, ``LOWEST_VAL``, any other top-level symlink and any top-level
  ``.txt`` pointer file are kept in addition (a link into a checkpoint, e.g. to its
  ``model/consolidated``, protects that checkpoint);
* only directories named ``epoch_<E>_step_<S>`` are ever removed: other files and directories
  under the root are not touched.

MindSpore Transformers' ``save_max`` is the same mechanism with one documented difference: only
checkpoints saved by the current run count and are removed (``run_id`` is the manifest's
``meta.run_id``); checkpoints of other runs sharing the directory are left alone.

Callers run :func:`prune` only after the new checkpoint is published and its pointers moved
(``Checkpointer.save``, after the writer's publish returned), so a failed save never removes anything.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from resilience.checkpoint.layout import POINTER_SUFFIX, PRUNING_PREFIX, list_checkpoints, parse_checkpoint_name
from resilience.checkpoint.policy.lineage import lineage
from resilience.checkpoint.storage.durable import fsync_dir
from resilience.checkpoint.storage.manifest import CheckpointInvalid, read_manifest

log = logging.getLogger("resilience.checkpoint")

_POINTER_READ_BYTES = 4096  # a pointer file holds one name; a large .txt is not a pointer


def protected_targets(root: Path) -> set[Path]:
    """Real paths named by top-level symlinks and ``.txt`` pointer files under ``root``.

    A symlink counts whatever its name (``LATEST``, ``LOWEST_VAL``, ``best``, ...); a ``.txt``
    file counts when its first line names a path relative to ``root`` (``LATEST.txt`` written
    where symlinks fail) or an absolute path. Unreadable pointers protect nothing.
    """
    targets: set[Path] = set()
    if not root.is_dir():
        return targets
    for child in root.iterdir():
        try:
            if child.is_symlink():
                targets.add(Path(os.path.realpath(child)))
            elif child.suffix == POINTER_SUFFIX and child.is_file():
                with open(child, "rb") as fh:
                    text = fh.read(_POINTER_READ_BYTES).decode("utf-8", "replace")
                first = text.strip().splitlines()[0].strip() if text.strip() else ""
                if first:
                    targets.add(Path(os.path.realpath(root / first)))
        except OSError:
            continue
    return targets


def _is_protected(directory: Path, targets: set[Path]) -> bool:
    real = Path(os.path.realpath(directory))
    return any(target == real or real in target.parents for target in targets)


def _run_id(directory: Path) -> str | None:
    try:
        return read_manifest(directory).get("meta", {}).get("run_id")
    except CheckpointInvalid:
        return None


def plan_prune(root: Path, keep: int, *, run_id: str | None = None, current: Path | None = None) -> list[Path]:
    """The checkpoint directories :func:`prune` would remove, oldest first.

    Args:
        root: the checkpoint root (``checkpoint_dir``).
        keep: size of the recent window (>= 1).
        run_id: when given (MindSpore ``save_max``), only checkpoints whose manifest says they
            were saved by this run count towards the window and may be removed.
        current: the checkpoint just published: its lineage comes first in the window.

    Raises:
        ValueError: ``keep`` < 1.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"retention window must be an integer >= 1, got {keep!r}")
    checkpoints = list_checkpoints(root)  # newest step first; real directories only
    if run_id is not None:
        checkpoints = [path for path in checkpoints if _run_id(path) == run_id]
    if current is not None:
        # Lineage first. A checkpoint past the current step that is no ancestor of the current one
        # is the abandoned timeline a rollback left behind: never counted or removed (like the ones
        # set aside as <name>.abandoned-*). Lower non-ancestors (older runs, chains cut by pruning)
        # fill the rest of the window as before.
        mine = {path.name for path in lineage(root, current)}
        parsed = parse_checkpoint_name(current.name)
        step = parsed[1] if parsed else float("inf")
        checkpoints = [p for p in checkpoints if p.name in mine] + [p for p in checkpoints if p.name not in mine and parse_checkpoint_name(p.name)[1] <= step]
    targets = protected_targets(root)
    victims = [path for path in checkpoints[keep:] if not _is_protected(path, targets)]
    return sorted(victims, key=lambda p: parse_checkpoint_name(p.name)[::-1])


def prune(root: Path, keep: int, *, run_id: str | None = None, current: Path | None = None) -> list[Path]:
    """Remove the checkpoints outside the window that no pointer names; returns those removed.

    Each victim is first renamed to ``.pruning_<name>`` (so a crash mid-delete never leaves a
    half-deleted ``epoch_*`` directory that looks like a checkpoint), then deleted; leftovers of
    an interrupted prune are deleted at the next call. A directory that cannot be deleted is
    logged and skipped: the checkpoint that triggered the prune is already published, and the
    next prune tries again. See :func:`plan_prune` for the arguments.
    """
    for child in root.iterdir() if root.is_dir() else ():
        if child.name.startswith(PRUNING_PREFIX) and child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
    removed = []
    for path in plan_prune(root, keep, run_id=run_id, current=current):
        doomed = root / f"{PRUNING_PREFIX}{path.name}"
        try:
            os.rename(path, doomed)
            fsync_dir(root)
        except OSError as exc:
            log.warning("retention: could not remove %s (%s); will retry at the next save", path.name, exc)
            continue
        shutil.rmtree(doomed, ignore_errors=True)  # what is left is deleted by the next prune
        removed.append(path)
        log.info("retention: removed %s", path.name)
    return removed
