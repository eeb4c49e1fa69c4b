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

Dtypes follow NeMo AutoModel's ``consolidate.sh``: each ordinary float tensor (fp16, bf16, fp32,
fp64) goes back to its original per-tensor dtype when the original Hugging Face headers were
known at save time, else keeps its saved dtype; ``cast_dtype`` (``CAST_DTYPE``: bf16, fp16, fp32,
fp64) overrides that for ordinary floats; FP8 and non-float tensors are never changed; a tensor
whose original was packed or quantized (integer or FP8 storage) but which was saved as float is
left as saved, with a warning.

The same function serves the inline export of a save (``checkpoint.save_consolidated``), the
``model/consolidate.sh`` helper and ``resilience consolidate DIR``.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import multiprocessing
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from resilience.checkpoint.formats.sharded_model import (
    ConsolidateError,
    read_aliases,
    read_bundle_omits,
    read_layout,
    resolve_model_dir,
    with_alias_copies,
)
from resilience.checkpoint.layout import (
    BUNDLE_MANIFEST,
    CONSOLIDATED,
    HF_CONFIG,
    HF_INDEX,
    HF_METADATA,
    hf_file_name,
)
from resilience.checkpoint.storage.durable import fsync_dir, fsync_file, record, write_bytes
from resilience.checkpoint.storage.safetensors_file import read_safetensors_header

log = logging.getLogger("resilience.consolidate")

ORDINARY_FLOATS = ("float16", "bfloat16", "float32", "float64")
CAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}


def parse_cast_dtype(value: str | None) -> str | None:
    """``CAST_DTYPE`` (``bf16``, ``fp16``, ``fp32``, ``fp64``, or a torch name such as ``bfloat16``)
    as a torch dtype name; empty or ``None`` -> ``None`` (no cast).

    Raises:
        ConsolidateError: any other value (the message lists the accepted ones).
    """
    if value is None or not str(value).strip():
        return None
    text = str(value).strip().lower()
    if text in CAST_DTYPES:
        return CAST_DTYPES[text]
    if text in ORDINARY_FLOATS:
        return text
    raise ConsolidateError(f"CAST_DTYPE={value!r}; accepted: {', '.join(CAST_DTYPES)} (or empty for the original dtypes)")


def target_dtype(key: str, saved: str, original: str | None, cast: str | None) -> tuple[str, str | None]:
    """(dtype to export ``key`` in, warning or ``None``) by the policy of the module docstring."""
    if saved not in ORDINARY_FLOATS:
        return saved, None  # FP8, integers, bool: exported exactly as saved
    if original is not None and original not in ORDINARY_FLOATS:
        return saved, (
            f"{key}: the original checkpoint stores it as {original} (packed or quantized) but it was saved as {saved}; exported as {saved}, not re-packed"
        )
    if cast is not None:
        return cast, None
    return (original or saved), None


def plan_dtypes(tensors: dict[str, dict[str, Any]], cast: str | None) -> tuple[dict[str, str], list[str]]:
    """Export dtype per key, plus the warnings, for ``{key: {"dtype": saved, "original_dtype": ...}}``."""
    targets, notes = {}, []
    for key, info in tensors.items():
        targets[key], note = target_dtype(key, info["dtype"], info.get("original_dtype"), cast)
        if note:
            notes.append(note)
    return targets, notes


def is_complete(out_dir: Path, keys: Iterable[str] | None = None) -> bool:
    """True when ``out_dir`` holds a whole bundle: the index, and every file it names with exactly
    the tensors the index gives it (headers only are read); and, given ``keys``, those keys."""
    try:
        weight_map = json.loads((out_dir / HF_INDEX).read_text())["weight_map"]
        if keys is not None and set(weight_map) != set(keys):
            return False
        by_file: dict[str, set[str]] = {}
        for key, name in weight_map.items():
            by_file.setdefault(name, set()).add(key)
        for name, want in by_file.items():
            header = read_safetensors_header(out_dir / name)
            if set(header) - {"__metadata__"} != want:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


# -- writing a bundle ------------------------------------------------------------------------------
def _write_file(path: Path, items: list[tuple[str, str, str]], fetch: Callable[[str], torch.Tensor], num_threads: int) -> dict[str, int]:
    """Write one output file of ``items`` ``[(key, source key, export dtype)]``; returns ``{key: bytes}``."""

    def one(item: tuple[str, str, str]) -> tuple[str, torch.Tensor]:
        key, source, dtype = item
        t = fetch(source).to(getattr(torch, dtype)).contiguous()
        return key, (t.clone() if source != key else t)  # a copy: safetensors refuses shared storage

    if num_threads > 1 and len(items) > 1:
        with concurrent.futures.ThreadPoolExecutor(max_workers=num_threads) as pool:
            tensors = dict(pool.map(one, items))
    else:
        tensors = dict(map(one, items))
    save_file(tensors, str(path), metadata={"format": "pt"})
    return {key: t.numel() * t.element_size() for key, t in tensors.items()}


def _export_file(job: tuple[str, str, list[tuple[str, str, str, str]], int]) -> dict[str, int]:
    """Worker (also run in-process): one output file from the shards of ``model_dir``; ``items``
    are ``[(key, source key, shard of the source, export dtype)]``."""
    model_dir, out_path, items, num_threads = job
    shard_of = {source: shard for _, source, shard, _ in items}

    def fetch(source: str) -> torch.Tensor:
        with safe_open(os.path.join(model_dir, shard_of[source]), framework="pt") as fh:
            return fh.get_tensor(source)

    return _write_file(Path(out_path), [(key, source, dtype) for key, source, _, dtype in items], fetch, num_threads)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # progress as log lines instead
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc="consolidating", dynamic_ncols=True)


def write_bundle(
    out_dir: Path,
    layout: dict[str, dict[str, Any]],
    *,
    fetch: Callable[[str], torch.Tensor] | None = None,
    model_dir: Path | None = None,
    cast_dtype: str | None = None,
    sidecar_dir: Path | None = None,
    nproc: int = 1,
    num_threads: int = 5,
    progress: bool = False,
    aliases: dict[str, str] | None = None,
    bundle_omits: Iterable[str] = (),
) -> list[str]:
    """Write the Hugging Face bundle of ``layout`` (see :func:`read_layout`) into ``out_dir``.
    ``aliases`` (tied keys, ``{alias: canonical}``; not in ``layout``) all go into the index's
    ``metadata.tied_weights``; those in ``bundle_omits`` (declared tied by the model, see
    :func:`read_bundle_omits`) stay out of the files, every other one is written as a full copy of
    its canonical tensor under its own key, in its canonical key's file, and listed in ``weight_map``.

    Tensors come from ``fetch(key)`` (in memory, one process) or from the shards in ``model_dir``
    (``nproc`` worker processes, one output file at a time each, ``num_threads`` reader threads
    each). ``sidecar_dir``'s files (config, tokenizer) are copied in; ``config.json``'s ``dtype``
    is set to the exported float dtype. Returns the file names written, relative to ``out_dir``.

    Raises:
        ConsolidateError: a bad ``cast_dtype``, or an alias whose canonical key is not in ``layout``.
    """
    split = sorted(key for key, info in layout.items() if info.get("shard") is None)
    if fetch is None and split:
        raise ConsolidateError(f"{split[0]} and {len(split) - 1} more are stored in pieces (a sharded model's checkpoint): not consolidated here yet")
    layout = with_alias_copies(layout, aliases or {}, set(bundle_omits))
    cast = parse_cast_dtype(cast_dtype)
    targets, notes = plan_dtypes(layout, cast)
    for line in notes:
        log.warning(line)
    num_files = max((info["num_files"] for info in layout.values()), default=1)
    by_file: dict[int, list[str]] = {}
    for key in sorted(layout):
        by_file.setdefault(layout[key]["file_index"], []).append(key)
    out_dir.mkdir(parents=True, exist_ok=True)
    nbytes = {k: _numel(layout[k]["shape"]) * getattr(torch, targets[k]).itemsize for k in layout}
    bar = _progress(sum(nbytes.values()), progress)
    sizes: dict[str, int] = {}

    def done(index: int, file_sizes: dict[str, int]) -> None:
        sizes.update(file_sizes)
        _advance(bar, sum(nbytes[k] for k in file_sizes), index, num_files)

    try:
        if fetch is not None:
            for index, keys in by_file.items():
                items = [(k, layout[k].get("source", k), targets[k]) for k in keys]
                done(index, _write_file(out_dir / hf_file_name(index, num_files), items, fetch, 1))
        else:
            jobs = {
                index: (
                    str(model_dir),
                    str(out_dir / hf_file_name(index, num_files)),
                    [(k, layout[k].get("source", k), layout[k]["shard"], targets[k]) for k in keys],
                    num_threads,
                )
                for index, keys in by_file.items()
            }
            if nproc > 1 and len(jobs) > 1:
                context = multiprocessing.get_context("spawn")  # fork would copy torch's thread pools mid-use
                with concurrent.futures.ProcessPoolExecutor(max_workers=min(nproc, len(jobs)), mp_context=context) as pool:
                    futures = {pool.submit(_export_file, job): index for index, job in jobs.items()}
                    for future in concurrent.futures.as_completed(futures):
                        done(futures[future], future.result())
            else:
                for index, job in jobs.items():
                    done(index, _export_file(job))
    finally:
        if bar is not None:
            bar.close()
    weight_map = {key: hf_file_name(layout[key]["file_index"], num_files) for key in sorted(layout)}
    index: dict[str, Any] = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    if aliases:
        index["metadata"]["tied_weights"] = dict(sorted(aliases.items()))
    (out_dir / HF_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    written = sorted(set(weight_map.values())) + [HF_INDEX]
    if sidecar_dir is not None and sidecar_dir.is_dir():
        written += _copy_sidecars(sidecar_dir, out_dir, targets)
    return written


def _numel(shape: list[int]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _advance(bar: Any, nbytes: int, index: int, num_files: int) -> None:
    if bar is not None:
        bar.update(nbytes)
    else:
        log.info("consolidated %s", hf_file_name(index, num_files))


def _copy_sidecars(sidecar_dir: Path, out_dir: Path, targets: dict[str, str]) -> list[str]:
    written = []
    for src in sorted(p for p in sidecar_dir.rglob("*") if p.is_file()):
        rel = src.relative_to(sidecar_dir)
        dst = out_dir / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rel.as_posix() == HF_CONFIG:
            config = json.loads(src.read_text())
            dtype = _dominant_float(targets)
            if dtype is not None:  # the dtype from_pretrained(dtype="auto") will pick
                config["dtype"] = dtype
                if "torch_dtype" in config:
                    config["torch_dtype"] = dtype
            dst.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copyfile(src, dst)
        written.append(rel.as_posix())
    return written


def _dominant_float(targets: dict[str, str]) -> str | None:
    counts: dict[str, int] = {}
    for dtype in targets.values():
        if dtype in ORDINARY_FLOATS:
            counts[dtype] = counts.get(dtype, 0) + 1
    return max(counts, key=lambda d: (counts[d], d)) if counts else None


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

    Raises:
        ConsolidateError: not a sharded safetensors model, a bad ``cast_dtype``, ``nproc`` or
            ``num_threads`` below 1.
    """
    if nproc < 1 or num_threads < 1:
        raise ConsolidateError(f"NPROC_PER_NODE and NUM_THREADS must be >= 1, got {nproc} and {num_threads}")
    parse_cast_dtype(cast_dtype)  # a bad value fails before any work
    model_dir = resolve_model_dir(Path(directory)).absolute()
    layout = read_layout(model_dir)
    aliases = read_aliases(model_dir)
    omits = read_bundle_omits(model_dir, aliases)
    out = Path(output_dir).absolute() if output_dir is not None else model_dir / CONSOLIDATED
    if is_complete(out, with_alias_copies(layout, aliases, omits)):
        log.info("%s is already complete; nothing to do (remove it to export again)", out)
        return out
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        written = write_bundle(
            tmp,
            layout,
            model_dir=model_dir,
            cast_dtype=cast_dtype,
            sidecar_dir=model_dir / HF_METADATA,
            nproc=nproc,
            num_threads=num_threads,
            progress=progress,
            aliases=aliases,
            bundle_omits=omits,
        )
        for rel in written:
            fsync_file(tmp / rel)
        write_bundle_manifest(tmp, written)
        fsync_dir(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %s", out)
    return out


def write_bundle_manifest(out_dir: Path, files: Iterable[str]) -> None:
    """Write ``out_dir/bundle_manifest.json``: ``{"files": {name: {"size", digest}}}`` for
    ``files`` (relative to ``out_dir``, already durable), read back to digest them; under a
    temporary name, fsync'd, then renamed, so it is whole or absent."""
    entries = {rel: record(out_dir, rel).manifest_entry() for rel in sorted(files)}
    tmp = out_dir / f".{BUNDLE_MANIFEST}.tmp"
    write_bytes(tmp, (json.dumps({"files": entries}, indent=2, sort_keys=True) + "\n").encode())
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
