"""The save path, top to bottom: stage, write + fsync on every rank, manifest, rename, ``LATEST``.

1. Rank 0 creates ``.staging_<name>/`` (a leftover from a crash is removed first).
2. Every rank runs its parts (model, optimizer, RNG, data position, ...), fsyncs and digests
   every file it wrote (most while writing them); local parts on a worker thread beside the
   collective ones (DCP). Collective parts run on every rank even after a local failure, so
   no peer is left waiting in them.
3. The file lists and errors are all-gathered: one failure anywhere raises on every rank.
4. Rank 0 writes ``manifest.json`` last, fsyncs every directory, renames the staging directory
   into place, fsyncs the root, and only then swaps ``LATEST``. Its success or failure is
   all-gathered too.

A failure at any point leaves the previous checkpoint and ``LATEST`` untouched.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resilience.checkpoint.best import LOWEST_VAL
from resilience.checkpoint.durable import FileRecord, fsync_dir, fsync_file, record
from resilience.checkpoint.layout import LATEST, STAGING_PREFIX, TRASH_PREFIX
from resilience.checkpoint.lineage import describe, is_checkpoint_named, set_aside
from resilience.checkpoint.manifest import write_manifest
from resilience.checkpoint.pointers import PointerError, read_pointer, write_pointer
from resilience.distributed import DistContext

try:  # DCP's CheckpointException derives from BaseException, not Exception
    from torch.distributed.checkpoint.api import CheckpointException as _DCPError
except ImportError:  # pragma: no cover - torch without DCP
    _DCPError = Exception
_FAILURES = (Exception, _DCPError)

log = logging.getLogger("resilience.checkpoint")


class CheckpointSaveError(RuntimeError):
    """A save failed on at least one rank. Raised on every rank; ``LATEST`` was not moved."""


@dataclasses.dataclass
class Part:
    """One piece of a checkpoint: ``write(staging_dir) -> [files written]``, each a path relative
    to the staging directory (fsync'd and digested afterwards by reading it back) or a
    :class:`FileRecord` of a file already fsync'd and digested while it was written.

    ``collective`` parts (DCP) must run on every rank in the same order.
    """

    name: str
    write: Callable[[Path], list[str | FileRecord]]
    collective: bool = False


# A test hook: called with the phase name before each filesystem step of the save
# ("staging", "parts", "manifest", "rename", "pointer"). Fault tests use it to fail one step on
# one rank; it is None in normal runs.
fault_hook: Callable[[str], None] | None = None


def _phase(name: str) -> None:
    if fault_hook is not None:
        fault_hook(name)


def _failed(name: str, what: str) -> Callable[[str], CheckpointSaveError]:
    """The error every rank raises when a step of saving ``name`` failed somewhere."""
    return lambda detail: CheckpointSaveError(f"saving checkpoint {name} failed while {what} ({detail}); {LATEST} was not moved")


def _describe(exc: BaseException) -> str:
    """One line per root cause: DCP wraps each rank's error (with its traceback) in one exception."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        causes = {_describe(value[0] if isinstance(value, tuple) else value) for value in failures.values()}
        return "; ".join(sorted(causes))
    return "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[-1]


def save_checkpoint(
    ctx: DistContext,
    root: Path,
    name: str,
    parts: list[Part],
    meta: dict[str, Any],
    *,
    after_publish: Callable[[Path], None] | None = None,
) -> Path:
    """Write and publish checkpoint ``root/name``; a collective over ``ctx`` (every rank calls it).

    ``after_publish(final_dir)`` runs on rank 0 once ``LATEST`` names the new checkpoint (other
    pointers such as ``LOWEST_VAL``, then retention); its failure raises on every rank like any
    other publishing step, but the new checkpoint stays published.

    Returns the published directory. Raises :class:`CheckpointSaveError` on every rank when any
    rank fails at any step; the previous checkpoint and ``LATEST`` are then left as they were.
    """
    staging = root / f"{STAGING_PREFIX}{name}"
    final = root / name

    # 1. staging directory (rank 0)
    error = None
    if ctx.rank == 0:
        try:
            _phase("staging")
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        except _FAILURES as exc:  # noqa: BLE001 - any failure must reach every rank
            error = _describe(exc)
    ctx.gather_or_raise(error, fail=_failed(name, "creating the staging directory"))

    # 2. every rank writes its parts, fsyncs and digests them
    records, error = _write_parts(staging, parts)
    try:
        gathered = ctx.gather_or_raise(error, records, fail=_failed(name, "writing files"))
    except CheckpointSaveError:
        if ctx.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise

    # 3. publish (rank 0): manifest last, fsync directories, rename, fsync root, then LATEST
    error = None
    if ctx.rank == 0:
        try:
            _phase("manifest")
            all_records = [rec for recs in gathered for rec in recs]
            write_manifest(staging, all_records, meta)
            for dirpath, _, _ in os.walk(staging):
                fsync_dir(Path(dirpath))
            _phase("rename")
            _rename_into_place(root, staging, final, parent=meta.get("parent"))
            _phase("pointer")
            write_pointer(root, LATEST, final)
        except _FAILURES as exc:  # noqa: BLE001
            error = _describe(exc)
            # Not left for the next start: a failed save must not hold a checkpoint's worth of disk.
            shutil.rmtree(staging, ignore_errors=True)
        if error is None and after_publish is not None:
            try:
                _phase("after_publish")
                after_publish(final)
            except _FAILURES as exc:  # noqa: BLE001
                error = f"after publishing (the checkpoint itself is published): {_describe(exc)}"
    ctx.gather_or_raise(error, fail=_failed(name, "publishing"))
    return final


def _write_parts(staging: Path, parts: list[Part]) -> tuple[list[FileRecord], str | None]:
    """Run ``parts`` into ``staging``: (records of every file written, first error or None).

    Local parts run on a worker thread beside the collective ones (DCP), which stay on this
    thread in their order: DCP serialises on one core at ~1 GB/s here, slower than the disk, so
    the weight shards are written meanwhile instead of after it.
    """
    local: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: local.update(result=_run_parts(staging, [p for p in parts if not p.collective], stop_at_error=True)),
        name="resilience-save-parts", daemon=True,
    )
    worker.start()
    try:
        records, error = _run_parts(staging, [p for p in parts if p.collective], stop_at_error=False)
    finally:
        worker.join()
    local_records, local_error = local.get("result", ([], "the parts' writer thread died"))
    return records + local_records, local_error or error


def _run_parts(staging: Path, parts: list[Part], *, stop_at_error: bool) -> tuple[list[FileRecord], str | None]:
    """Run ``parts`` in order; after an error, the rest run only when not ``stop_at_error`` (a
    collective part must run on every rank even after a local failure: a rank that skipped it
    would leave its peers waiting in DCP's collective forever)."""
    records: list[FileRecord] = []
    error = None
    for part in parts:
        if error is not None and stop_at_error:
            break
        try:
            try:
                _phase("parts")
            except _FAILURES as exc:
                if stop_at_error:
                    raise
                error = error or f"{part.name}: {_describe(exc)}"
            for written in part.write(staging):
                if isinstance(written, FileRecord):  # digested while written, and fsync'd
                    records.append(written)
                else:  # written by a library that hides its bytes: fsync, then read back
                    fsync_file(staging / written)
                    records.append(record(staging, written))
        except _FAILURES as exc:  # noqa: BLE001 - any failure must reach every rank
            error = error or f"{part.name}: {_describe(exc)}"
    return records, error


def _rename_into_place(root: Path, staging: Path, final: Path, *, parent: Any = None) -> None:
    """Rename ``staging`` to ``final``. An existing ``final`` that is the checkpoint this one
    continues (``parent``: a re-save of the same step) is moved aside first and deleted only after
    the new one is in place; any other (another timeline's, see :mod:`resilience.checkpoint.lineage`)
    is moved aside to ``<name>.abandoned-<time>`` and kept, with a warning naming it; a
    ``LOWEST_VAL`` naming it follows it there (its metric is that checkpoint's, not the new one's)."""
    trash = abandoned = best_moved = None
    if final.exists():
        if is_checkpoint_named(final, parent):
            trash = root / f"{TRASH_PREFIX}{final.name}"
            if trash.exists():
                shutil.rmtree(trash)
            os.rename(final, trash)
        else:
            what = describe(final)
            abandoned = set_aside(root, final)
            log.warning("%s already held a checkpoint of another timeline (%s), not the one this run continues: "
                        "moved it aside to %s (kept; delete it when it is not needed)", final.name, what, abandoned.name)
            best_moved = _follow_with_lowest_val(root, final, abandoned)
    try:
        os.rename(staging, final)
    except OSError:
        if trash is not None or abandoned is not None:
            os.rename(trash or abandoned, final)  # put the previous checkpoint of this name back where LATEST may point
        if best_moved:
            write_pointer(root, LOWEST_VAL, final)
        raise
    fsync_dir(root)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _follow_with_lowest_val(root: Path, name: Path, moved_to: Path) -> bool:
    """Point ``LOWEST_VAL`` at ``moved_to`` when it names ``name`` (True then): by name it would
    otherwise name the new timeline's checkpoint about to take that name, with another metric."""
    try:
        target = read_pointer(root, LOWEST_VAL)
    except PointerError:
        return False
    if target is None or target.name != name.name:
        return False
    write_pointer(root, LOWEST_VAL, moved_to)
    log.warning("%s followed %s to %s", LOWEST_VAL, name.name, moved_to.name)
    return True


def remove_leftovers(root: Path) -> list[Path]:
    """Delete staging and trash directories left by a crashed save (rank 0, at start-up).

    A trash directory whose checkpoint name is absent (a crash between the two renames of a
    re-save) is the only copy of that checkpoint: it is renamed back instead of deleted.
    """
    removed = []
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith(TRASH_PREFIX) and child.is_dir():
                original = root / child.name[len(TRASH_PREFIX):]
                if not original.exists() and not original.is_symlink():
                    os.rename(child, original)
                    fsync_dir(root)
                    continue
            if child.name.startswith((STAGING_PREFIX, TRASH_PREFIX)) and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
    return removed
