"""The Hugging Face bundle of a shard directory, streamed from the tensors' pieces.

Works for both kinds of shard file (:mod:`~resilience.checkpoint.formats.shard_pieces`): a
replicated model's whole tensors and a sharded (DTensor) model's per-rank pieces. No process holds
the model, nor even one whole tensor: each output file is written band by band
(:mod:`~resilience.checkpoint.formats.bundle_stream`). The output files are shared out by size:

- offline (``consolidate.sh``, ``resilience consolidate``): over ``NPROC_PER_NODE`` worker
  processes (:func:`write_files`), each reading a band's pieces with ``NUM_THREADS`` threads;
- at save time (``checkpoint.save_consolidated`` with a sharded model): over the ranks, once
  every rank's shards are durable (:func:`write_bundle_share`, a part that runs after the
  others); rank 0 adds the index and the side files.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import multiprocessing
from pathlib import Path
from typing import Any

from resilience.checkpoint.balance import balance
from resilience.checkpoint.formats.bundle_meta import copy_sidecars, parse_cast_dtype, plan_dtypes, tensor_bytes, write_index
from resilience.checkpoint.formats.bundle_stream import BAND_BYTES, Entry, write_file
from resilience.checkpoint.formats.shard_pieces import list_pieces
from resilience.checkpoint.formats.sharded_model import ConsolidateError, read_aliases, read_bundle_omits, with_alias_copies
from resilience.checkpoint.layout import HF_INDEX, HF_METADATA, MODEL_CONSOLIDATED, MODEL_DIR, SHARD_INDEX, hf_file_name
from resilience.checkpoint.storage.durable import FileRecord

log = logging.getLogger("resilience.consolidate")


@dataclasses.dataclass(frozen=True)
class BundlePlan:
    """What a bundle of ``model_dir`` holds: ``layout`` (``{key: {"dtype", "shape", "file_index",
    "num_files", "original_dtype"[, "source"]}}``, tied copies included), the export dtype per key
    (``targets``), the ties (``aliases``, ``{alias: canonical}``) and, per output file name, the
    tensors it holds (``files``)."""

    model_dir: Path
    layout: dict[str, dict[str, Any]]
    targets: dict[str, str]
    aliases: dict[str, str]
    files: dict[str, list[Entry]]

    def file_bytes(self) -> dict[str, int]:
        """Bytes of tensor data per output file (its header aside)."""
        return {name: sum(tensor_bytes(self.layout[e.key], e.dtype) for e in entries) for name, entries in self.files.items()}


def plan_bundle(model_dir: Path, cast_dtype: str | None = None) -> BundlePlan:
    """The bundle of the shard directory ``model_dir``, from headers and ``shard_index.json`` only.

    Original dtypes come from ``shard_index.json`` (else the shards' ``original_dtypes``); the
    ties and the aliases the bundle leaves out from its ``aliases`` and ``bundle_omits``.

    Raises:
        ConsolidateError: no shard files, inconsistent or incomplete pieces, a bad ``cast_dtype``,
            shard files naming different numbers of output files.
    """
    pieces = list_pieces(model_dir)
    counts = {t.num_files for t in pieces.values()}
    if len(counts) > 1:
        raise ConsolidateError(f"{model_dir}: the shard files name {sorted(counts)} output files (-of-0000N); one checkpoint's shards agree")
    recorded = _recorded_tensors(model_dir)
    _check_against_index(model_dir, pieces, recorded)
    layout = {
        key: {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "file_index": t.file_index,
            "num_files": t.num_files,
            "original_dtype": recorded.get(key, {}).get("original_dtype") or t.original_dtype,
        }
        for key, t in pieces.items()
    }
    aliases = read_aliases(model_dir)
    layout = with_alias_copies(layout, aliases, read_bundle_omits(model_dir, aliases))
    targets, notes = plan_dtypes(layout, parse_cast_dtype(cast_dtype))
    for line in notes:
        log.warning(line)
    num_files = max(counts, default=1)
    files: dict[str, list[Entry]] = {}
    for key in sorted(layout):
        name = hf_file_name(layout[key]["file_index"], num_files)
        files.setdefault(name, []).append(Entry(key, pieces[layout[key].get("source", key)], targets[key]))
    return BundlePlan(model_dir, layout, targets, aliases, files)


def write_files(
    out_dir: Path,
    plan: BundlePlan,
    *,
    nproc: int = 1,
    num_threads: int = 5,
    band_bytes: int = BAND_BYTES,
    progress: Any = None,
) -> list[FileRecord]:
    """Write every output file of ``plan`` into ``out_dir`` (``nproc`` worker processes, larger
    files first; ``num_threads`` reader threads each); returns their records (names relative to
    ``out_dir``), digested as written. ``progress`` (a tqdm bar, or ``None``) advances by the
    bytes written: per band in one process, per file from workers.

    Raises:
        OSError, ValueError: from reading the shards or writing the files.
    """
    sizes = plan.file_bytes()
    names = sorted(sizes, key=lambda name: (-sizes[name], name))
    jobs = [(str(out_dir / name), name, plan.files[name], str(plan.model_dir), band_bytes, num_threads) for name in names]
    if nproc > 1 and len(jobs) > 1:
        context = multiprocessing.get_context("spawn")  # fork would copy torch's thread pools mid-use
        records = []
        with concurrent.futures.ProcessPoolExecutor(max_workers=min(nproc, len(jobs)), mp_context=context) as pool:
            futures = {pool.submit(_write_job, job): job[1] for job in jobs}
            for future in concurrent.futures.as_completed(futures):
                records.append(future.result())
                _advance(progress, sizes[futures[future]], futures[future])
        return sorted(records, key=lambda rec: rec.path)
    advance = progress.update if progress is not None else None
    records = []
    for job in jobs:
        records.append(_write_job(job, advance))
        if progress is None:
            log.info("consolidated %s", job[1])
    return sorted(records, key=lambda rec: rec.path)


def write_bundle_share(staging: Path, *, rank: int, world_size: int, num_threads: int = 1) -> list[str | FileRecord]:
    """The save-time part writing ``model/consolidated/`` of a sharded checkpoint in ``staging``:
    run on every rank once every rank's shards are durable. Each rank writes its share of the
    output files (split by size, alike on every rank); rank 0 also writes the index and copies
    ``model/hf_metadata/``. Returns the files written (records of the weight files, digested as
    written; paths of the rest), relative to ``staging``.

    Raises:
        ConsolidateError: the shards do not describe a whole model (see :func:`plan_bundle`).
        OSError: from reading or writing.
    """
    model_dir = staging / MODEL_DIR
    out = staging / MODEL_CONSOLIDATED
    plan = plan_bundle(model_dir)
    owner = balance(plan.file_bytes(), world_size)
    out.mkdir(parents=True, exist_ok=True)
    written: list[str | FileRecord] = []
    for name, entries in plan.files.items():
        if owner[name] == rank:
            written.append(write_file(out / name, f"{MODEL_CONSOLIDATED}/{name}", entries, model_dir, num_threads=num_threads))
    if rank == 0:
        write_index(out, plan.layout, plan.targets, plan.aliases)
        rels = [HF_INDEX, *copy_sidecars(model_dir / HF_METADATA, out, plan.targets)]
        written += [f"{MODEL_CONSOLIDATED}/{rel}" for rel in rels]
    return written


def _write_job(job: tuple[str, str, list[Entry], str, int, int], advance: Any = None) -> FileRecord:
    """One output file (a worker process's task): ``(path, name, entries, model dir, band bytes, threads)``."""
    path, name, entries, model_dir, band_bytes, num_threads = job
    return write_file(Path(path), name, entries, Path(model_dir), band_bytes=band_bytes, num_threads=num_threads, advance=advance)


def _advance(bar: Any, nbytes: int, name: str) -> None:
    if bar is not None:
        bar.update(nbytes)
    else:
        log.info("consolidated %s", name)


def _recorded_tensors(model_dir: Path) -> dict[str, dict[str, Any]]:
    """``shard_index.json``'s ``tensors`` (``{key: {"shape", "original_dtype", ...}}``; empty when absent)."""
    try:
        tensors = json.loads((model_dir / SHARD_INDEX).read_text()).get("tensors") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    return {key: info for key, info in tensors.items() if isinstance(info, dict)} if isinstance(tensors, dict) else {}


def _check_against_index(model_dir: Path, pieces: dict[str, Any], recorded: dict[str, dict[str, Any]]) -> None:
    """Headers alone cannot see a shard file that is missing whole: its tensors, or the last
    block of a tensor with no recorded global shape, just vanish. ``shard_index.json``'s keys
    and shapes, when recorded, catch both."""
    missing = sorted(set(recorded) - set(pieces))
    if missing:
        raise ConsolidateError(
            f"{model_dir}: {SHARD_INDEX} lists {len(missing)} tensors no shard file holds ({', '.join(missing[:5])}); is a shard file missing?"
        )
    for key, info in recorded.items():
        shape = info.get("shape")
        if isinstance(shape, list) and tuple(shape) != pieces[key].shape:
            raise ConsolidateError(f"{key}: {SHARD_INDEX} gives shape {shape}, its pieces {list(pieces[key].shape)}; is a shard file missing?")
