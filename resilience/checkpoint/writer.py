"""Writing and publishing a checkpoint: stage, write + fsync on every rank, manifest, rename, ``LATEST``.

:meth:`Checkpointer.save <resilience.checkpoint.checkpointer.Checkpointer.save>` calls them in order
(:func:`write_checkpoint`, then :func:`publish` on rank 0, then its own pointers and retention,
then :func:`raise_publish_verdict`):

1. Rank 0 creates ``.staging_<name>/`` (a leftover from a crash is removed first).
2. Every rank runs its parts (model, optimizer, RNG, data position, ...), fsyncs and digests
   every file it wrote (most while writing them); local parts on a worker thread beside the
   collective ones (DCP). Collective parts run on every rank even after a local failure, so
   no peer is left waiting in them.
3. After a flag reduce of the errors (one failure anywhere raises on every rank), each rank's
   *own* files (``Part.own``: rank state, a sharded model's and optimizer's shards) go to the
   first rank of its block, which writes them as a rank manifest; the other files (any rank may
   read them) and the rank manifests go to rank 0 only. So rank 0 receives O(tensors + N/block)
   records, not O(files). Parts that read every rank's files (``after_peers``: a sharded model's
   Hugging Face bundle) run then, and their outcome is gathered the same way.
4. Rank 0 writes ``manifest.json`` last, fsyncs the directories (each block's leader fsynced those of its
   members' own files), renames the staging directory
   into place, fsyncs the root, and only then swaps ``LATEST``. Its success or failure (and that
   of the steps after it: ``LOWEST_VAL``, retention's choice) reaches every rank in the last
   collective, with the checkpoints retention set aside (each rank then deletes its own files
   of them in the background: :mod:`resilience.checkpoint.policy.retention`).

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
from typing import TYPE_CHECKING, Any

from resilience.checkpoint.layout import BAD_MARKER, LATEST, RANK_MANIFEST_BLOCK, STAGING_PREFIX, TRASH_PREFIX
from resilience.checkpoint.policy.lineage import describe, is_checkpoint_named, set_aside
from resilience.checkpoint.policy.lowest_val import LOWEST_VAL
from resilience.checkpoint.storage.direct_file import direct_writes
from resilience.checkpoint.storage.durable import FileRecord, directories_of, fsync_dir, fsync_file, fsyncs_deferred, record
from resilience.checkpoint.storage.manifest import write_manifest, write_rank_manifest
from resilience.checkpoint.storage.object_path import Location
from resilience.checkpoint.storage.pointers import PointerError, read_pointer, write_pointer
from resilience.distributed import DistContext
from resilience.env_names import RANK_MANIFEST_BLOCK_ENV
from resilience.sharded_types import loaded_class

if TYPE_CHECKING:  # parts.py builds the parts; the writer only runs them
    from resilience.checkpoint.parts import Part


def save_failures() -> tuple[type[BaseException], ...]:
    """What a save step catches and hands to every rank: ``Exception``, and DCP's
    ``CheckpointException`` (a ``BaseException``) once DCP is imported (it cannot be raised before).
    Called in the ``except`` clause, so it is looked up when an exception is handled."""
    dcp_error = loaded_class("torch.distributed.checkpoint.api", "CheckpointException")
    return (Exception, dcp_error) if dcp_error is not None else (Exception,)


log = logging.getLogger("resilience.checkpoint")


class CheckpointSaveError(RuntimeError):
    """A save failed on at least one rank. Raised on every rank; ``LATEST`` was not moved."""


# A test hook: called with the phase name before each filesystem step of the save
# ("staging", "parts", "upload" (object storage), "manifest", "rename", "pointer", "after_publish"), and in retention's
# background job before and after this rank deletes its own files ("delete", "deleted"; a failure
# there is a warning, not a failed save). Fault tests use it to
# fail one step on one rank; it is None in normal runs.
fault_hook: Callable[[str], None] | None = None


def phase(name: str) -> None:
    """Call :data:`fault_hook` (when set) before step ``name`` of a save."""
    if fault_hook is not None:
        fault_hook(name)


def _failed(name: str, what: str) -> Callable[[str], CheckpointSaveError]:
    """The error every rank raises when a step of saving ``name`` failed somewhere."""
    return lambda detail: CheckpointSaveError(f"saving checkpoint {name} failed while {what} ({detail}); {LATEST} was not moved")


def describe_failure(exc: BaseException) -> str:
    """``exc`` in one line per root cause: DCP wraps each rank's error (with its traceback) in one exception."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        causes = {describe_failure(value[0] if isinstance(value, tuple) else value) for value in failures.values()}
        return "; ".join(sorted(causes))
    return "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[-1]


@dataclasses.dataclass
class Written:
    """What :func:`write_checkpoint` wrote, for :func:`publish` and retention."""

    listed: list[FileRecord]
    """Rank 0: the files ``manifest.json`` lists (those any rank may read, and the rank
    manifests), from every rank; empty on the other ranks."""
    mine: list[FileRecord]
    """Every file this rank wrote (retention deletes them with the checkpoint)."""
    rank_manifests: dict[str, int]
    """``{"world_size": N, "block": B}``: the rank manifests that hold each rank's own files."""


def rank_manifest_block() -> int:
    """Ranks per rank manifest: ``RESILIENCE_RANK_MANIFEST_BLOCK`` when set (tests use 2 to get
    several blocks on few ranks), else :data:`~resilience.checkpoint.layout.RANK_MANIFEST_BLOCK`.
    Raises ``ValueError`` naming the variable when it is not a whole number >= 1."""
    raw = os.environ.get(RANK_MANIFEST_BLOCK_ENV)
    if not raw:
        return RANK_MANIFEST_BLOCK
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{RANK_MANIFEST_BLOCK_ENV}: expected a whole number of ranks >= 1, got {raw!r}")
    return int(raw)


def write_checkpoint(ctx: DistContext, root: Location, name: str, parts: list[Part], sink: Any = None) -> Written:
    """Steps 1 to 3: stage ``root/.staging_<name>/``, write every rank's ``parts`` into it, fsync'd
    and digested, write the rank manifests and gather the other file lists to rank 0; a collective
    over ``ctx`` (every rank calls it).

    ``sink`` (an :class:`~resilience.checkpoint.object_save.Sink`): on object storage, each rank stages in a local directory of its own
    (``sink.staging``) and sends its files to the store (``sink.send``) once they are durable, the
    parts that read every rank's files after fetching the peers' (``sink.fetch``); see
    :mod:`resilience.checkpoint.object_save`.

    Returns what was written (:class:`Written`; rank 0 publishes it with :func:`publish`). Raises
    :class:`CheckpointSaveError` on every rank when any rank failed; the staging directory is
    then removed and the previous checkpoint and ``LATEST`` are left as they were.
    """
    if sink is not None:
        staging: Path = sink.staging
    else:
        assert isinstance(root, Path), "a checkpoint on object storage is staged through its sink"
        staging = root / f"{STAGING_PREFIX}{name}"
    block = rank_manifest_block()

    # 1. staging directory (rank 0; on object storage, each rank's own)
    error = None
    if ctx.rank == 0 or sink is not None:
        try:
            phase("staging")
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        except save_failures() as exc:  # noqa: BLE001 - any failure must reach every rank
            error = describe_failure(exc)
    ctx.gather_or_raise(error, fail=_failed(name, "creating the staging directory"))

    # 2. every rank writes its parts, fsyncs and digests them
    listed, own, error = _write_parts(staging, [p for p in parts if not p.after_peers], direct=sink is None)
    try:
        ctx.gather_or_raise(error, fail=_failed(name, "writing files"))
        # 3. own files to the block's first rank (a rank manifest), the rest to rank 0; then the parts that read them all
        members = ctx.gather_to_leaders(own, block)
        error = None
        if members is not None:
            try:
                for rel in directories_of([rec.path for own in members for rec in own]):  # the block's directory entries durable
                    fsync_dir(staging / rel)
                listed.append(write_rank_manifest(staging, ctx.rank, members))
            except save_failures() as exc:  # noqa: BLE001 - any failure must reach every rank
                error = describe_failure(exc)
        gathered = ctx.gather_to_root_or_raise(error, listed, fail=_failed(name, "writing the rank manifests")) or []
        if sink is not None:  # object storage: every rank's files in the store before anything reads or lists them
            ctx.gather_or_raise(_send(sink, listed + own), fail=_failed(name, "uploading files"))
        late = [p for p in parts if p.after_peers]
        if late:
            error = _fetch(sink, late) if sink is not None else None
            records, late_own, error = _run_parts(staging, late, stop_at_error=True) if error is None else ([], [], error)
            records += late_own  # the rank manifests are written: listed
            if sink is not None and error is None:
                error = _send(sink, records)
            gathered += ctx.gather_to_root_or_raise(error, records, fail=_failed(name, "writing files from every rank's files")) or []
            listed = listed + records
    except CheckpointSaveError:
        if ctx.rank == 0 or sink is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return Written([rec for recs in gathered for rec in recs], listed + own, {"world_size": ctx.world_size, "block": block})


def _send(sink: Any, records: list[FileRecord]) -> str | None:
    """This rank's ``records`` sent to the store (``phase("upload")`` first), or what failed."""
    try:
        phase("upload")
        sink.send(records)
    except save_failures() as exc:  # noqa: BLE001 - any failure must reach every rank
        return describe_failure(exc)
    return None


def _fetch(sink: Any, parts: list[Part]) -> str | None:
    """The peers' files ``parts`` read (their ``peers_read`` directories) fetched into this rank's staging, or what failed."""
    try:
        for directory in sorted({d for part in parts for d in part.peers_read}):
            sink.fetch(directory)
    except save_failures() as exc:  # noqa: BLE001 - any failure must reach every rank
        return describe_failure(exc)
    return None


def publish(root: Path, name: str, written: Written, meta: dict[str, Any]) -> Path:
    """Step 4, rank 0, once every rank's files are durable (:func:`write_checkpoint`): the manifest
    last, fsync the directories of its files, rename into place, fsync the root, then ``LATEST``. Returns the
    published directory. Raises what failed, after removing the staging directory (a failed save
    must not hold a checkpoint's worth of disk); ``LATEST`` then still names the previous one.
    """
    staging = root / f"{STAGING_PREFIX}{name}"
    final = root / name
    try:
        phase("manifest")
        write_manifest(staging, written.listed, meta, written.rank_manifests)
        # the directories of the listed files (the rank manifests' leaders did theirs): no listing
        # of directories that hold a file per rank (a readdir of 50,000 entries on rank 0 at 8,192)
        for rel in directories_of([rec.path for rec in written.listed]):
            fsync_dir(staging / rel)
        fsync_dir(staging)
        phase("rename")
        _rename_into_place(root, staging, final, parent=meta.get("parent"))
        phase("pointer")
        write_pointer(root, LATEST, final)
    except save_failures():
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def raise_publish_verdict(ctx: DistContext, name: str, error: str | None, victims: list[str] | None = None) -> list[str]:
    """The last collective of a save: every rank raises :class:`CheckpointSaveError` when rank 0's
    publishing (``error``) failed; else returns rank 0's ``victims`` on every rank (the names
    of the checkpoints retention renamed aside, whose files each rank deletes; ``[]`` for none).
    A flag reduce, plus a broadcast of the names when there are any (:meth:`DistContext.verdict_from_root`)."""
    return ctx.verdict_from_root(error, victims or None, fail=_failed(name, "publishing")) or []


def _write_parts(staging: Path, parts: list[Part], *, direct: bool) -> tuple[list[FileRecord], list[FileRecord], str | None]:
    """Run ``parts`` into ``staging``: (records of the files the manifest lists, of this rank's own
    files, first error or None). ``direct``: large tensor files may be written with ``O_DIRECT``
    (a local save; a save staged for object storage reads them back to upload them, from the
    page cache).

    Local parts run on a worker thread beside the collective ones (DCP), which stay on this
    thread in their order: DCP serialises on one core at ~1 GB/s here, slower than the disk, so
    the weight shards are written meanwhile instead of after it.
    """
    local: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: local.update(result=_run_parts(staging, [p for p in parts if not p.collective], stop_at_error=True, direct=direct)),
        name="resilience-save-parts",
        daemon=True,
    )
    worker.start()
    try:
        records, own, error = _run_parts(staging, [p for p in parts if p.collective], stop_at_error=False, direct=direct)
    finally:
        worker.join()
    local_records, local_own, local_error = local.get("result", ([], [], "the parts' writer thread died"))
    return records + local_records, own + local_own, local_error or error


def _run_parts(staging: Path, parts: list[Part], *, stop_at_error: bool, direct: bool = False) -> tuple[list[FileRecord], list[FileRecord], str | None]:
    """Run ``parts`` in order: (records of the files the manifest lists, of the own files, first
    error or None); after an error, the rest run only when not ``stop_at_error`` (a collective
    part must run on every rank even after a local failure: a rank that skipped it would leave
    its peers waiting in DCP's collective forever).

    The files the parts write are fsync'd together once the last part has run
    (:func:`~resilience.checkpoint.storage.durable.fsyncs_deferred`), not one by one; a failed fsync
    is this thread's error like a failed write. ``direct``: see :func:`_write_parts`."""
    records: list[FileRecord] = []
    own: list[FileRecord] = []
    error = None
    try:
        with fsyncs_deferred(), direct_writes(direct):
            records, own, error = _run_each(staging, parts, stop_at_error=stop_at_error)
    except save_failures() as exc:  # noqa: BLE001 - a failed fsync reaches every rank like a failed write
        error = error or f"fsync of the parts' files: {describe_failure(exc)}"
    return records, own, error


def _run_each(staging: Path, parts: list[Part], *, stop_at_error: bool) -> tuple[list[FileRecord], list[FileRecord], str | None]:
    """:func:`_run_parts`' loop, inside its batch of fsyncs: the same triple."""
    records: list[FileRecord] = []
    own: list[FileRecord] = []
    error = None
    for part in parts:
        if error is not None and stop_at_error:
            break
        try:
            try:
                phase("parts")
            except save_failures() as exc:
                if stop_at_error:
                    raise
                error = error or f"{part.name}: {describe_failure(exc)}"
            into = own if part.own else records
            for written in part.write(staging, *part.args, **part.kwargs):
                if isinstance(written, FileRecord):  # digested while written; fsync'd at the batch's end
                    into.append(written)
                else:  # written by a library that hides its bytes: fsync, then read back
                    fsync_file(staging / written)
                    into.append(record(staging, written))
        except save_failures() as exc:  # noqa: BLE001 - any failure must reach every rank
            error = error or f"{part.name}: {describe_failure(exc)}"
    return records, own, error


def _rename_into_place(root: Path, staging: Path, final: Path, *, parent: Any = None) -> None:
    """Rename ``staging`` to ``final``. An existing ``final`` that is the checkpoint this one
    continues (``parent``: a re-save of the same step) is moved aside first and deleted only after
    the new one is in place; any other (another timeline's, see :mod:`resilience.checkpoint.policy.lineage`)
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
            marked_bad = (final / BAD_MARKER).exists()  # corrupt, found so at this resume or an earlier one
            what = "a checkpoint marked bad" if marked_bad else f"a checkpoint of another timeline ({describe(final)})"
            abandoned = set_aside(root, final)
            log.warning(
                "%s already held %s, not the one this run continues: moved it aside to %s (kept; delete it when it is not needed)",
                final.name,
                what,
                abandoned.name,
            )
            best_moved = follow_with_lowest_val(root, final, abandoned)
    try:
        os.rename(staging, final)
    except OSError:
        previous = trash or abandoned
        if previous is not None:
            os.rename(previous, final)  # put the previous checkpoint of this name back where LATEST may point
        if best_moved:
            write_pointer(root, LOWEST_VAL, final)
        raise
    fsync_dir(root)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def follow_with_lowest_val(root: Location, name: Location, moved_to: Location) -> bool:
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
