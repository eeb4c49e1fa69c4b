"""Consolidation: per-rank safetensors shards -> one Hugging Face bundle in ``model/consolidated/``.

The bundle is what ``transformers`` ``from_pretrained``, vLLM and SGLang load::

    model/consolidated/
      model-00001-of-0000N.safetensors ...   tensors grouped as the shards' file index says
      model.safetensors.index.json           {"metadata": {"total_size": bytes}, "weight_map": {...}}

Tied weights a Hugging Face model declares are in it once, as ``save_pretrained`` writes them: the
alias (``lm_head.weight`` tied to ``model.embed_tokens.weight`` with ``tie_word_embeddings``) is
left out and ``from_pretrained`` ties it again from ``config.json``. Every other alias (a tie made
by hand that the config does not declare, any tie of a non-Hugging Face model) is written as a
full copy of its canonical tensor under its own key, since nothing would fill it in on loading.
``shard_index.json``'s ``bundle_omits`` (recorded at save time, when the model is at hand) says
which aliases are left out (see :func:`~resilience.checkpoint.formats.sharded_model.read_bundle_omits`); the bundle index's
``metadata.tied_weights`` records every ``{alias: canonical}`` for any other reader.
      config.json  generation_config.json    copied from model/hf_metadata/ (a Hugging Face model)
      tokenizer files                        copied from model/hf_metadata/ (a tokenizer was given)

Dtypes: see :mod:`~resilience.checkpoint.formats.bundle_meta` (original dtypes, ``CAST_DTYPE``).

Two writers, one bundle. At save time a replicated model's bundle is written by rank 0 from the
tensors in memory (:func:`write_bundle`); a sharded (DTensor) model's, and every bundle made
later (``model/consolidate.sh``, ``resilience consolidate DIR``: :func:`consolidate`), is
streamed from the shard files' pieces, never holding a whole tensor
(:mod:`~resilience.checkpoint.formats.bundle_shards`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from resilience.checkpoint.formats.bundle_meta import copy_sidecars, is_complete, parse_cast_dtype, plan_dtypes, write_index
from resilience.checkpoint.formats.bundle_shards import plan_bundle, write_files
from resilience.checkpoint.formats.sharded_model import ConsolidateError, resolve_model_dir, with_alias_copies
from resilience.checkpoint.layout import BUNDLE_MANIFEST, CONSOLIDATED, HF_METADATA, hf_file_name
from resilience.checkpoint.storage.durable import FileRecord, fsync_dir, fsync_file, record, write_bytes

log = logging.getLogger("resilience.consolidate")

__all__ = ["ConsolidateError", "CorruptedInput", "check_inputs", "consolidate", "is_complete", "parse_cast_dtype", "write_bundle", "write_bundle_manifest"]


# -- writing a bundle ------------------------------------------------------------------------------
def _write_file(path: Path, items: list[tuple[str, str, str]], fetch: Callable[[str], torch.Tensor]) -> None:
    """Write one output file of ``items`` ``[(key, source key, export dtype)]`` from ``fetch``."""
    tensors = {}
    for key, source, dtype in items:
        t = fetch(source).to(getattr(torch, dtype)).contiguous()
        tensors[key] = t.clone() if source != key else t  # a copy: safetensors refuses shared storage
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_bundle(
    out_dir: Path,
    layout: dict[str, dict[str, Any]],
    *,
    fetch: Callable[[str], torch.Tensor],
    cast_dtype: str | None = None,
    sidecar_dir: Path | None = None,
    aliases: dict[str, str] | None = None,
    bundle_omits: Iterable[str] = (),
) -> list[str]:
    """Write the Hugging Face bundle of ``layout`` (see :func:`~resilience.checkpoint.formats.sharded_model.read_layout`) into ``out_dir`` from
    tensors in memory (``fetch(key)``, one process: a replicated model at save time).
    ``aliases`` (tied keys, ``{alias: canonical}``; not in ``layout``) all go into the index's
    ``metadata.tied_weights``; those in ``bundle_omits`` (declared tied by the model, see
    :func:`~resilience.checkpoint.formats.sharded_model.read_bundle_omits`) stay out of the files, every other one is written as a full copy of
    its canonical tensor under its own key, in its canonical key's file, and listed in ``weight_map``.
    ``sidecar_dir``'s files (config, tokenizer) are copied in; ``config.json``'s ``dtype`` is set
    to the exported float dtype. Returns the file names written, relative to ``out_dir``.

    Raises:
        ConsolidateError: a bad ``cast_dtype``, or an alias whose canonical key is not in ``layout``.
    """
    layout = with_alias_copies(layout, aliases or {}, set(bundle_omits))
    targets, notes = plan_dtypes(layout, parse_cast_dtype(cast_dtype))
    for line in notes:
        log.warning(line)
    out_dir.mkdir(parents=True, exist_ok=True)
    num_files = max((info["num_files"] for info in layout.values()), default=1)
    by_file: dict[str, list[tuple[str, str, str]]] = {}
    for key in sorted(layout):
        by_file.setdefault(hf_file_name(layout[key]["file_index"], num_files), []).append((key, layout[key].get("source", key), targets[key]))
    for name, items in by_file.items():
        _write_file(out_dir / name, items, fetch)
        log.info("consolidated %s", name)
    return write_index(out_dir, layout, targets, aliases) + copy_sidecars(sidecar_dir, out_dir, targets)


def _progress(total: int, enabled: bool) -> Any:  # a tqdm bar (untyped), or None
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # progress as log lines instead
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc="consolidating", dynamic_ncols=True)


# -- offline consolidation (consolidate.sh, ``resilience consolidate``) ---------------------------
def consolidate(
    directory: str | os.PathLike,
    output_dir: str | os.PathLike | None = None,
    *,
    nproc: int = 1,
    num_threads: int = 5,
    cast_dtype: str | None = None,
    progress: bool = True,
) -> Path:
    """Write ``<model dir>/consolidated/`` (or ``output_dir``) from a checkpoint's sharded safetensors.

    Args:
        directory: a checkpoint's ``model/`` directory, or the checkpoint directory holding it.
        output_dir: where the bundle goes (default ``<model dir>/consolidated``).
        nproc: worker processes (``NPROC_PER_NODE``; default 1), each writing whole output files.
        num_threads: reader threads per worker (``NUM_THREADS``; default 5).
        cast_dtype: ``CAST_DTYPE`` (see :func:`parse_cast_dtype`); default: original dtypes.
        progress: show a progress bar (tqdm) on stderr.

    A no-op when the output is already complete (:func:`is_complete`). Otherwise the bundle is
    written into a temporary sibling directory and renamed into place, so an interrupted run never
    leaves a partial ``consolidated/`` that looks complete. Returns the output directory.

    The input files are first checked against the checkpoint's manifest (:func:`check_inputs`).

    Raises:
        ConsolidateError: not a sharded safetensors model, a bad ``cast_dtype``, ``nproc`` or
            ``num_threads`` below 1.
        CorruptedInput: a shard or other input file does not match the manifest.
    """
    if nproc < 1 or num_threads < 1:
        raise ConsolidateError(f"NPROC_PER_NODE and NUM_THREADS must be >= 1, got {nproc} and {num_threads}")
    parse_cast_dtype(cast_dtype)  # a bad value fails before any work
    model_dir = resolve_model_dir(Path(directory)).absolute()
    plan = plan_bundle(model_dir, cast_dtype)
    out = Path(output_dir).absolute() if output_dir is not None else model_dir / CONSOLIDATED
    if is_complete(out, plan.layout):
        if cast_dtype:
            log.warning("%s is already complete: CAST_DTYPE %s was not applied (remove it and run again to export in that dtype)", out, cast_dtype)
        else:
            log.info("%s is already complete; nothing to do (remove it to export again)", out)
        return out
    check_inputs(model_dir, progress=progress)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        bar = _progress(sum(plan.file_bytes().values()), progress)
        try:
            records = write_files(tmp, plan, nproc=nproc, num_threads=num_threads, progress=bar)
        finally:
            if bar is not None:
                bar.close()
        written = write_index(tmp, plan.layout, plan.targets, plan.aliases)[-1:]
        written += copy_sidecars(model_dir / HF_METADATA, tmp, plan.targets)
        for rel in written:
            fsync_file(tmp / rel)
        write_bundle_manifest(tmp, written, records)
        fsync_dir(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %s", out)
    return out


def check_inputs(model_dir: Path, *, progress: bool = False) -> None:
    """Check every file under ``model_dir`` that its checkpoint's manifest lists (the shards, their
    index, the Hugging Face metadata) against its size and digest, before any is read: a bundle
    built from corrupted shards would look as good as any other. Costs one read of the shards
    (the page cache then serves the consolidation's). Without a manifest (a copied ``model/``)
    nothing can be checked, and a warning says so.

    Raises:
        CorruptedInput: a listed file is missing, of the wrong size or its digest differs.
    """
    from resilience.checkpoint.storage.manifest import CheckpointInvalid, all_files, digest_problem, read_manifest, size_problem, well_formed

    checkpoint = model_dir.parent
    try:
        doc = read_manifest(checkpoint)
    except CheckpointInvalid as exc:
        log.warning("the shards of %s are not checked against digests: %s", model_dir, exc)
        return
    try:
        files = all_files(checkpoint, doc)  # each rank's shards are in its rank manifest
    except CheckpointInvalid as exc:
        raise CorruptedInput(f"{exc}; not consolidating a corrupt checkpoint (resilience verify {checkpoint} lists every bad file)") from exc
    prefix, skip = f"{model_dir.name}/", f"{model_dir.name}/{CONSOLIDATED}/"
    mine = {rel: want for rel, want in files.items() if isinstance(rel, str) and rel.startswith(prefix) and not rel.startswith(skip)}
    if not mine:
        log.warning("the shards of %s are not checked against digests: %s/manifest.json lists none of them", model_dir, checkpoint)
        return
    bar = _progress(sum(w["size"] for w in mine.values() if isinstance(w, dict) and isinstance(w.get("size"), int)), progress)
    if bar is not None:
        bar.set_description("checking digests")
    try:
        for rel, want in sorted(mine.items()):
            path = checkpoint / rel
            if not well_formed(rel, want):
                problem: str | None = "malformed manifest entry"
            else:
                problem = size_problem(path, want["size"]) or digest_problem(path, want, bar.update if bar is not None else None)
            if problem is not None:
                raise CorruptedInput(f"{path}: {problem}; not consolidating a corrupt checkpoint (resilience verify {checkpoint} lists every bad file)")
    finally:
        if bar is not None:
            bar.close()


class CorruptedInput(Exception):
    """A file the bundle would be made from does not match the checkpoint's manifest."""


def cpu_copies(state: dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """A ``fetch`` for :func:`write_bundle` from tensors in memory: ``cpu(key)`` is the tensor on the CPU, contiguous, never sharing storage with another key
    (safetensors refuses aliases such as tied weights). Copies are made only when asked for."""
    first_key: dict[tuple[int, int | torch.SymInt], str] = {}  # (storage, offset): torch types an offset int | SymInt
    for key, t in state.items():
        first_key.setdefault((t.untyped_storage().data_ptr(), t.storage_offset()), key)

    def cpu(key: str) -> torch.Tensor:
        t = state[key].detach()
        alias = first_key[(t.untyped_storage().data_ptr(), t.storage_offset())] != key
        t = t.cpu() if t.device.type != "cpu" else t
        if alias or not t.is_contiguous():
            t = t.contiguous().clone()
        return t

    return cpu


def write_bundle_manifest(out_dir: Path, files: Iterable[str], records: Iterable[FileRecord] = ()) -> None:
    """Write ``out_dir/bundle_manifest.json``: ``{"files": {name: {"size", digest}}}`` for
    ``records`` (files digested as they were written) and ``files`` (relative to ``out_dir``,
    already durable, read back to digest them); under a temporary name, fsync'd, then renamed,
    so it is whole or absent."""
    entries = {rec.path: rec.manifest_entry() for rec in records}
    entries.update({rel: record(out_dir, rel).manifest_entry() for rel in files})
    tmp = out_dir / f".{BUNDLE_MANIFEST}.tmp"
    write_bytes(tmp, (json.dumps({"files": dict(sorted(entries.items()))}, indent=2, sort_keys=True) + "\n").encode())
    os.replace(tmp, out_dir / BUNDLE_MANIFEST)


def _replace_dir(new: Path, out: Path) -> None:
    """Rename ``new`` to ``out``; an incomplete ``out`` left by something else is replaced."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
    os.rename(new, out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
