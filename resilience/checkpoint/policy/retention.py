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

Nothing is removed before the new checkpoint is published and its pointers moved, so a failed
save never removes anything. Then, in a save (``Checkpointer._write``), rank 0 plans the victims
(:func:`plan_prune`) and renames them aside to ``.pruning_<name>`` (:func:`set_aside`: a rename
and one fsync per save; no half-deleted directory ever holds a checkpoint's name), and names
them in the save's last collective. After it, on a background thread (:class:`Deleter`), each
rank unlinks the files it wrote into them (:func:`delete_files`, from its own records of that
save, kept in memory), and rank 0 removes what is left of the ones set aside at earlier saves
(:func:`remove_set_aside`: directories, files of checkpoints no rank remembers). A failed delete
is a warning; what a crash left is removed at a later save.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from resilience.checkpoint.layout import LATEST, LOWEST_VAL, POINTER_SUFFIX, PRUNING_PREFIX, checkpoint_counters, list_checkpoints, parse_checkpoint_name
from resilience.checkpoint.policy.lineage import lineage
from resilience.checkpoint.storage.durable import fsync_dir
from resilience.checkpoint.storage.manifest import CheckpointInvalid, read_manifest
from resilience.checkpoint.storage.object_path import Location, LocationT, ObjectPath

log = logging.getLogger("resilience.checkpoint")

_POINTER_READ_BYTES = 4096  # a pointer file holds one name; a large .txt is not a pointer


def protected_targets(root: Location) -> set[Path] | set[ObjectPath]:
    """Real paths named by top-level symlinks and ``.txt`` pointer files under ``root``.

    A symlink counts whatever its name (``LATEST``, ``LOWEST_VAL``, ``best``, ...); a ``.txt``
    file counts when its first line names a path relative to ``root`` (``LATEST.txt`` written
    where symlinks fail) or an absolute path. Unreadable pointers protect nothing.
    """
    targets: set[Path] = set()
    if isinstance(root, ObjectPath):
        return _object_targets(root)
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


def _object_targets(root: ObjectPath) -> set[ObjectPath]:
    """On object storage: the checkpoints named by the top-level pointer objects (``LATEST``,
    ``LOWEST_VAL``, any ``*.txt`` of one line). A pointer that cannot be read protects everything
    (``root`` itself): nothing is pruned on a guess."""
    targets: set[ObjectPath] = set()
    for child in root.iterdir():
        if not child.is_file() or not (child.name in (LATEST, LOWEST_VAL) or child.suffix == POINTER_SUFFIX):
            continue
        try:
            text = root.store.get_bytes(child.rel, 0, _POINTER_READ_BYTES).decode("utf-8", "replace")
        except FileNotFoundError:
            continue
        except OSError:
            return {root}
        first = text.strip().splitlines()[0].strip() if text.strip() else ""
        if first and "/" not in first.strip("/") and first not in (".", ".."):
            targets.add(root / first)
    return targets


def _is_protected(directory: Location, targets: set[Path] | set[ObjectPath]) -> bool:
    if isinstance(directory, ObjectPath):
        return any(isinstance(t, ObjectPath) and (t.rel == "" or t == directory or t.rel.startswith(directory.rel + "/")) for t in targets)
    real = Path(os.path.realpath(directory))
    return any(isinstance(t, Path) and (t == real or real in t.parents) for t in targets)


def _run_id(directory: Location) -> str | None:
    try:
        return read_manifest(directory).get("meta", {}).get("run_id")
    except CheckpointInvalid:
        return None


def plan_prune(root: LocationT, keep: int, *, run_id: str | None = None, current: Location | None = None) -> list[LocationT]:
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
        checkpoints = [p for p in checkpoints if p.name in mine] + [p for p in checkpoints if p.name not in mine and checkpoint_counters(p.name)[1] <= step]
    targets = protected_targets(root)
    victims = [path for path in checkpoints[keep:] if not _is_protected(path, targets)]
    return sorted(victims, key=lambda p: checkpoint_counters(p.name)[::-1])


def set_aside(root: Path, victims: list[Path]) -> list[str]:
    """Rank 0, before the save's last collective: rename each of ``victims`` to ``.pruning_<name>``
    (one fsync of ``root`` for all), so that no half-deleted directory ever holds a checkpoint's
    name; returns the names renamed. One that cannot be renamed is logged and skipped (the next
    save's plan names it again): the checkpoint that triggered it is already published."""
    renamed = []
    for path in victims:
        try:
            os.rename(path, root / f"{PRUNING_PREFIX}{path.name}")
        except OSError as exc:
            log.warning("retention: could not remove %s (%s); will retry at the next save", path.name, exc)
            continue
        renamed.append(path.name)
        log.info("retention: removed %s", path.name)
    if renamed:
        fsync_dir(root)
    return renamed


def delete_files(root: Path, name: str, files: list[str]) -> None:
    """Unlink ``files`` (paths relative to the checkpoint) of ``name``, set aside by
    :func:`set_aside`: a rank's own share of its deletion, in the background. A file already gone
    is skipped; another failure is a warning (rank 0's :func:`remove_set_aside` tries again)."""
    directory = root / f"{PRUNING_PREFIX}{name}"
    failures = 0
    for rel in files:
        try:
            os.unlink(directory / rel)
        except FileNotFoundError:
            continue
        except OSError as exc:
            failures += 1
            if failures == 1:
                log.warning("retention: could not delete %s of %s (%s); rank 0 removes what is left later", rel, name, exc)


def remove_set_aside(root: Path, *, spare: frozenset[str] = frozenset()) -> None:
    """Rank 0, in the background: delete what is left of every set-aside checkpoint (directories,
    files no rank remembers: a checkpoint of an earlier process, a crash mid-delete) but those in
    ``spare`` (whose files the ranks are deleting now; removed at the next call). Failures are
    ignored: the next call tries again."""
    for child in root.iterdir() if root.is_dir() else ():
        if child.name.startswith(PRUNING_PREFIX) and child.name[len(PRUNING_PREFIX) :] not in spare and child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)


def prune(root: Path, keep: int, *, run_id: str | None = None, current: Path | None = None) -> list[Path]:
    """Remove the checkpoints outside the window that no pointer names, at once, in one process;
    returns those removed (:class:`~resilience.checkpoint.checkpointer.Checkpointer` spreads the
    same steps over the ranks and the background instead).

    What an interrupted prune left is deleted first; each victim is renamed aside
    (:func:`set_aside`), then deleted. See :func:`plan_prune` for the arguments.
    """
    remove_set_aside(root)
    removed = set_aside(root, plan_prune(root, keep, run_id=run_id, current=current))
    remove_set_aside(root)
    return [root / name for name in removed]


class Deleter:
    """Runs deletion jobs one after another on a daemon thread (started on demand, gone when idle),
    so that no save waits for them; a job that raises is a warning. A daemon: a delete stuck on
    a slow filesystem cannot keep the process from exiting (see :meth:`wait`)."""

    def __init__(self, name: str = "resilience-retention") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job`` (it runs after those queued before it)."""
        with self._cond:
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def wait(self, timeout_s: float | None) -> bool:
        """Wait at most ``timeout_s`` seconds (``None``: no bound) for every queued job; True when
        none is left. What is left runs on while the process lives; after an exit its set-aside
        directories are removed by the next run's first save."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs, timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._jobs:
                    self._thread = None
                    return
                job = self._jobs[0]
            try:
                job()
            except Exception as exc:  # noqa: BLE001 - a failed delete never fails training
                log.warning("retention: deleting in the background failed (%s); the next save tries again", exc)
            with self._cond:
                self._jobs.popleft()
                self._cond.notify_all()
