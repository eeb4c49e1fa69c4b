"""Resuming from object storage: each rank fetches what it reads, then the usual loader runs.

The loaders read local files (safetensors, DCP, JSON). So each rank downloads, into its own
directory under ``checkpoint.local_dir``, the files it reads whole: the shared files of the
manifest (not the Hugging Face bundle), its own (rank state, shards) and the rank state of a
saved rank whose data position or RNG it continues; at another world size every rank's own files
(a reshard reads pieces of any of them). Every other file of the checkpoint is registered
(:mod:`~resilience.checkpoint.storage.remote_files`, reading every rank manifest: N/64 small
GETs per rank): served by range GETs where it is read by ranges (a balanced load's 1/N of each
replicated file, never downloaded whole; DCP's files of other ranks; the files of this rank's
digest share it does not read), or downloaded whole when a reader opens it by name (a sharded
state's piece that another rank wrote). Digests are checked while loading, as on a
filesystem; what was downloaded is deleted after the load but the RNG file, applied later.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from resilience.checkpoint.formats import balanced_load
from resilience.checkpoint.layout import DCP_METADATA, DCP_SUFFIX, LR_SCHEDULER, OPTIM_DIR, SAFETENSORS_SUFFIX, needed_to_resume, rank_state_file
from resilience.checkpoint.object_save import transfer
from resilience.checkpoint.storage import remote_files
from resilience.checkpoint.storage.manifest import OWNED, all_files, data_dir, ranks_entries
from resilience.checkpoint.storage.object_path import ObjectPath
from resilience.distributed import DistContext
from resilience.state.data_parallel import DataParallel, position_rank


class Fetched:
    """The local copy of one checkpoint for this rank's load (:func:`fetch`): ``directory`` to
    load from; :meth:`close` stops serving its remote files and deletes the downloads but ``keep``."""

    def __init__(self, directory: Path, remote: list[Path]):
        self.directory = directory
        self.remote = remote

    def close(self, keep: Path | None = None) -> None:
        """The load is over: forget the remote files; delete every download but ``keep``."""
        remote_files.forget(self.remote)
        for path in sorted(self.directory.rglob("*"), reverse=True):
            if path != keep and path.is_file():
                path.unlink(missing_ok=True)


def fetch(
    ctx: DistContext,
    checkpoint: ObjectPath,
    manifest: dict[str, Any],
    local: Path,
    *,
    inline: list[str],
    balanced: bool,
    optimizer: bool,
    data_parallel: DataParallel | None,
) -> Fetched:
    """Download this rank's files of ``checkpoint`` (its parsed ``manifest``, with this rank's
    ``OWNED`` entries from the size checks) under ``local``; register the rest for range reads. A
    collective: one verdict, so every rank raises when any failed.

    ``inline``: the files the loader reads whole (``balanced``: as streams, by ranges);
    ``optimizer``: whether the optimizer state is loaded (else its files are not downloaded).

    Raises:
        OSError: on every rank, naming what failed (``StoreError`` on the rank that failed).
    """
    error, fetched = None, None
    try:
        fetched = _fetch(ctx, checkpoint, manifest, local, inline=inline, balanced=balanced, optimizer=optimizer, data_parallel=data_parallel)
    except Exception as exc:  # noqa: BLE001 - every rank must learn it, or the others wait in the load's collectives
        error = f"{type(exc).__name__}: {exc}"
    try:
        ctx.gather_or_raise(error, fail=lambda detail: OSError(f"downloading {checkpoint.name} for the resume failed: {detail}"))
    except OSError:
        if fetched is not None:
            fetched.close()
        raise
    assert fetched is not None, "a failed _fetch raised from gather_or_raise above"
    return fetched


def _fetch(ctx: DistContext, checkpoint: ObjectPath, manifest: dict[str, Any], local: Path, **kw: Any) -> Fetched:
    files_at = data_dir(checkpoint, manifest)
    target = local / f"rank_{ctx.rank:05d}" / "resume" / checkpoint.name
    shutil.rmtree(target.parent, ignore_errors=True)
    target.mkdir(parents=True)
    meta = manifest["meta"]
    saved_world = int(meta.get("world_size") or ctx.world_size)
    resized = saved_world != ctx.world_size
    listed = {rel: want for rel, want in manifest["files"].items() if needed_to_resume(rel)}
    owned = dict(manifest.get(OWNED, {}))  # this rank's own files (the saved ranks it checks)
    dcp = any(rel.endswith(DCP_METADATA) for rel in listed)
    # any rank's file may be read (a reshard; DCP; a sharded state's pieces written by one holder):
    # every file is registered, read by ranges or downloaded when first opened (remote_files.ensure_local)
    others = {rel: want for rel, want in all_files(files_at, manifest).items() if needed_to_resume(rel)}
    streams = {rel for stream in balanced_load.streams(kw["inline"]).values() for rel in stream} if kw["balanced"] else set()
    wanted = {rel: want for rel, want in owned.items() if not (dcp and rel.endswith(DCP_SUFFIX) and resized)}
    for rel, want in listed.items():  # the shared files, but the balanced streams and an optimizer not loaded
        if rel not in streams and (kw["optimizer"] or not rel.startswith(OPTIM_DIR + "/") or rel == LR_SCHEDULER):
            wanted[rel] = want
    if resized:  # every rank's own files (not DCP's: read by ranges)
        wanted.update({rel: want for rel, want in others.items() if not rel.endswith(DCP_SUFFIX)})
    # every index and record (a sharded model's shard_index.json is its writer's own file): small, and
    # the loaders find them by name (is_file, glob); only the tensor files are left to ranges or first use
    wanted.update({rel: want for rel, want in others.items() if not rel.endswith((DCP_SUFFIX, SAFETENSORS_SUFFIX))})
    layout = kw["data_parallel"] or DataParallel(tuple(range(ctx.world_size)))
    sources = (position_rank(meta.get("data_parallel_replicas"), saved_world, layout, ctx.rank), ctx.rank % saved_world)
    for saved in {r for r in sources if r is not None}:
        state_file = rank_state_file(saved)  # the data position and RNG this rank continues
        if state_file not in wanted and state_file not in listed:
            wanted.update({rel: want for rel, want in ranks_entries(files_at, manifest, [saved]).items() if rel == state_file})
    remote = []
    for rel, want in {**others, **listed, **owned}.items():
        if rel not in wanted:
            size = int(want["size"]) if isinstance(want, dict) and isinstance(want.get("size"), int) else None
            remote_files.register(target / rel, remote_files.RemoteFile(checkpoint.store, f"{files_at.rel}/{rel}", size))
            remote.append(target / rel)
    fetched = Fetched(target, remote)
    try:
        for rel in wanted:
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
        transfer(sorted(wanted), lambda rel: checkpoint.store.get_file(f"{files_at.rel}/{rel}", target / rel))
    except BaseException:
        fetched.close()
        raise
    return fetched
