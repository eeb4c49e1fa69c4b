"""Model weights under ``model/``, in NeMo AutoModel's layouts (``checkpoint.model_save_format``).

``safetensors`` (default): every rank writes a balanced part of the tensors in parallel::

    model/
      shard-00001-model-00001-of-00001.safetensors   rank K-1 writes shard-0000K-...; 0000I-of-0000N
      shard-00002-model-00001-of-00001.safetensors   is the consolidated file the tensors belong to
      shard_index.json        tensor -> shard file, dtype, shape, consolidated file, original dtype
      consolidate.sh          writes model/consolidated/ later (see resilience.checkpoint.formats.consolidate)
      hf_metadata/            config.json, generation_config.json, tokenizer files (HF objects only)
      consolidated/           the Hugging Face bundle, when checkpoint.save_consolidated asks for it

Keys are plain module FQNs (no ``module.`` prefix), via ``torch.distributed.checkpoint.state_dict``.
Tied weights (two keys, one tensor: ``head.weight`` is ``emb.weight``) are stored once, under the
key a Hugging Face model keeps (``save_pretrained`` drops the tied ``lm_head.weight``; otherwise the
first in state-dict order), with the tie recorded in ``shard_index.json`` as
``"aliases": {"head.weight": "emb.weight"}``; loading gives every alias the stored tensor.
``"bundle_omits"`` lists the aliases the model declares tied (``from_pretrained`` ties them again),
which the Hugging Face bundle leaves out as ``save_pretrained`` does; it holds every other alias
as a copy (a tie made by hand is not in ``config.json``). Recorded now, as ``consolidate.sh``
runs later without the model.
The model is replicated (plain or DDP), so each rank already holds every tensor: the split into
parts is a deterministic plan every rank computes alike, and rank 0 alone writes the index.
Loading reads every shard on every rank, so it works under any world size. The consolidated file
grouping (``0000I-of-0000N``) mirrors the original Hugging Face checkpoint when its headers are
known, else groups of at most 5 GB (``save_pretrained``'s classic ``max_shard_size``).

``torch_save``: the model as DCP files (``model/.metadata``, ``model/__<rank>_0.distcp``), written
and read collectively; only tensors go in, so nothing but DCP's own ``.metadata`` is unpickled.

A ``peft.PeftModel``: only its adapters, as ``peft`` writes them (``model/adapter_model.safetensors``,
``model/adapter_config.json``, tokenizer files), loadable with ``AutoPeftModelForCausalLM``.
"""

from __future__ import annotations

import importlib.resources
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.5
    from torch.distributed._tensor import DTensor

from resilience.checkpoint.balance import balance
from resilience.checkpoint.formats import consolidate as consolidation
from resilience.checkpoint.formats import hf_export, sharded_model
from resilience.checkpoint.layout import (
    ADAPTER_CONFIG,
    CONSOLIDATE_SH,
    DCP_METADATA,
    MODEL_CONSOLIDATE_SH,
    MODEL_CONSOLIDATED,
    MODEL_DIR,
    MODEL_HF_METADATA,
    MODEL_SHARD_INDEX,
    SHARD_INDEX,
    model_shard_name,
)
from resilience.checkpoint.storage import dcp_io
from resilience.checkpoint.storage.durable import FileRecord
from resilience.checkpoint.storage.safetensors_file import read_safetensors, write_safetensors

log = logging.getLogger("resilience.checkpoint")

MAX_FILE_BYTES = 5 * 10**9
SAVE_FORMATS = ("safetensors", "torch_save")
_INDEX_FORMAT = "resilience.sharded_safetensors"


def model_file(shard: int = 1, file_index: int = 1, num_files: int = 1) -> str:
    """Relative path of one shard; the defaults name the only shard of a 1-rank, 1-file model."""
    return f"{MODEL_DIR}/{model_shard_name(shard, 0, file_index, num_files)}"


def save_model(
    staging: Path,
    model: torch.nn.Module,
    *,
    rank: int = 0,
    world_size: int = 1,
    group: Any = None,
    save_format: str = "safetensors",
    consolidated: bool = False,
    tokenizer: Any = None,
    max_file_bytes: int = MAX_FILE_BYTES,
    state_dict: dict[str, torch.Tensor] | None = None,
    aliases: dict[str, str] | None = None,
) -> list[str | FileRecord]:
    """Write this rank's part of the model into ``staging/model/``; returns what it wrote: records
    of the files digested and fsync'd while written (weight shards, DCP files) and the relative
    paths of the rest (the caller fsyncs and digests those).

    ``state_dict`` is a snapshot of ``get_model_state_dict(model)`` (an asynchronous save writes
    copies while training goes on); by default the live weights are read now. ``aliases``
    (``{alias: canonical}``, see :func:`tied_aliases`) names the tied keys; by default they are
    found in ``state_dict``, which a snapshot of separate copies no longer shows, so a snapshot
    comes with the aliases of the live model and without their keys. safetensors only.

    Call it on every rank: with ``save_format="torch_save"`` it is a collective over ``group``.
    ``consolidated`` adds ``model/consolidated/`` (rank 0, safetensors only); ``tokenizer`` (any
    object with ``save_pretrained``) adds its files. A PEFT model writes only its adapters (rank 0).

    Raises:
        ValueError: an unknown ``save_format``.
        NotImplementedError: a sharded (DTensor / FSDP) model with ``save_format="safetensors"``.
    """
    if save_format not in SAVE_FORMATS:
        raise ValueError(f"model_save_format: {save_format!r}; accepted: {', '.join(SAVE_FORMATS)}")
    if hf_export.is_peft_model(model):
        if rank != 0:
            return []
        written = hf_export.save_adapter(staging / MODEL_DIR, model)
        if tokenizer is not None:
            written += hf_export.write_hf_metadata(staging / MODEL_DIR, model, tokenizer, model_files=False)
        return sorted({f"{MODEL_DIR}/{rel}" for rel in written})
    (staging / MODEL_DIR).mkdir(exist_ok=True)
    state = state_dict if state_dict is not None else get_model_state_dict(model)
    if save_format == "torch_save":
        return _save_dcp(staging, state, rank=rank, group=group)
    aliases = tied_aliases(model, state) if aliases is None else aliases
    state = {key: t for key, t in state.items() if key not in aliases}
    return _save_sharded(
        staging, model, state, rank=rank, world_size=world_size, consolidated=consolidated, tokenizer=tokenizer, max_file_bytes=max_file_bytes, aliases=aliases
    )


def is_sharded_state(state: dict[str, Any]) -> bool:
    """True when some value of ``state`` is a DTensor (an FSDP2 / tensor-parallel model's)."""
    return any(isinstance(value, DTensor) for value in state.values())


def tied_aliases(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{alias: canonical}`` for the keys of ``state`` that are the very same tensor as another
    key (same storage, offset, shape, strides and dtype: tied weights). Per group of tied keys the
    canonical one is the first in state-dict order that a Hugging Face model does not declare
    tied (:func:`hf_export.tied_weight_keys`), so ``lm_head.weight`` is the alias of
    ``model.embed_tokens.weight`` as in ``save_pretrained``. Tensors that merely overlap are not
    aliases (they are stored as copies)."""
    declared = hf_export.tied_weight_keys(model)
    groups: dict[tuple, list[str]] = {}
    for key, t in state.items():
        if not isinstance(t, torch.Tensor) or isinstance(t, DTensor) or t.numel() == 0:
            continue  # empty tensors may all report the same null data pointer
        view = (str(t.device), t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        groups.setdefault(view, []).append(key)
    aliases: dict[str, str] = {}
    for keys in groups.values():
        if len(keys) > 1:
            canonical = next((key for key in keys if key not in declared), keys[0])
            aliases.update({key: canonical for key in keys if key != canonical})
    return aliases


def bundle_omits(model: torch.nn.Module, aliases: dict[str, str]) -> list[str]:
    """The aliases the Hugging Face bundle may leave out, sorted: those ``model`` declares tied
    (:func:`hf_export.tied_weight_keys`, e.g. ``lm_head.weight`` with ``tie_word_embeddings``),
    which ``from_pretrained`` ties again. Any other alias (tied by hand, or a non-Hugging Face
    model) must be in the bundle as a copy, or ``from_pretrained`` would initialise it randomly."""
    declared = hf_export.tied_weight_keys(model)
    return sorted(alias for alias in aliases if alias in declared)


def load_model(directory: Path, model: torch.nn.Module, *, group: Any = None) -> None:
    """Load the weights saved in ``directory/model/`` into ``model`` in place, whatever the layout
    (sharded safetensors under any world size, DCP — a collective over ``group`` — or adapters).

    Raises:
        ValueError: missing or unexpected keys, or adapters for a model that is not a PEFT model.
    """
    model_dir = directory / MODEL_DIR
    if (model_dir / ADAPTER_CONFIG).is_file():
        hf_export.load_adapter(model_dir, model)
    elif (model_dir / DCP_METADATA).is_file():
        state = get_model_state_dict(model)
        dcp_io.load_tensors(state, model_dir, group=group)
        set_model_state_dict(model, state)
    else:
        layout = sharded_model.read_layout(model_dir)
        live = get_model_state_dict(model)  # the model's own tensors: read into them in place
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted({info["shard"] for info in layout.values()}):
            tensors.update(read_safetensors(model_dir / shard, live))
        if set(tensors) != set(layout):
            differ = sorted(set(tensors) ^ set(layout))[:5]
            raise ValueError(f"{model_dir}: the shards and {SHARD_INDEX} disagree on {differ}")
        _restore_aliases(model_dir, tensors, sharded_model.read_aliases(model_dir), live)
        if set(tensors) != set(live) or any(t is not live[key] for key, t in tensors.items()):
            set_model_state_dict(model, tensors)  # some did not fit in place (or keys differ: its error)


def _restore_aliases(model_dir: Path, tensors: dict[str, torch.Tensor], aliases: dict[str, str], live: dict[str, torch.Tensor]) -> None:
    """Give every saved alias its canonical key's tensor in ``tensors``. A model that ties them
    (the same tensor) got it in place already; one that holds them as separate parameters (a
    fresh model that never tied them) gets the values in both, and they stay separate: re-tying
    would swap parameters the optimizer already holds (a Hugging Face model re-ties with
    ``tie_weights()``, before its optimizer is made)."""
    separate = []
    for alias, canonical in aliases.items():
        if canonical not in tensors:
            raise ValueError(f"{model_dir}: {SHARD_INDEX} ties {alias} to {canonical}, which is not saved")
        mine, theirs = live.get(alias), live.get(canonical)
        if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and _same_view(mine, theirs):
            tensors[alias] = mine  # tied here too: loaded in place with its canonical key
        else:
            tensors[alias] = tensors[canonical]
            separate.append(f"{alias} (= {canonical})")
    if separate:
        log.info("%s: saved tied, loaded into separate parameters of this model, which stay untied: %s", model_dir, ", ".join(separate))


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


# -- torch_save: DCP -------------------------------------------------------------------------------
def _save_dcp(staging: Path, state: dict[str, torch.Tensor], *, rank: int, group: Any) -> list[FileRecord]:
    return [rec.under(MODEL_DIR) for rec in dcp_io.save_tensors(state, staging / MODEL_DIR, rank=rank, group=group)]


# -- safetensors: per-rank shards ------------------------------------------------------------------
def _save_sharded(
    staging: Path,
    model: torch.nn.Module,
    state: dict[str, torch.Tensor],
    *,
    rank: int,
    world_size: int,
    consolidated: bool,
    tokenizer: Any,
    max_file_bytes: int,
    aliases: dict[str, str],
) -> list[str | FileRecord]:
    for key, value in state.items():
        if isinstance(value, DTensor):
            raise NotImplementedError(
                f"{key} is a DTensor (a sharded FSDP/TP model): model_save_format: safetensors supports "
                "replicated models (plain or DDP); use model_save_format: torch_save"
            )
    originals = hf_export.original_tensors(model)
    nbytes = {key: t.numel() * t.element_size() for key, t in state.items()}
    file_of, num_files = _file_plan(list(nbytes.items()), originals, max_file_bytes)
    owner = balance(nbytes, world_size)  # writer rank per key (ties in state-dict order)
    index = {
        "format": _INDEX_FORMAT,
        "version": 1,
        "world_size": world_size,
        "num_files": num_files,
        "metadata": {"total_size": sum(nbytes.values())},
        "weight_map": {key: model_shard_name(owner[key] + 1, world_size, file_of[key], num_files) for key in state},
        "tensors": {
            key: {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "file_index": file_of[key],
                "original_dtype": originals.get(key, {}).get("dtype"),
            }
            for key, t in state.items()
        },
        "aliases": dict(sorted(aliases.items())),  # tied keys: stored once, under the canonical key
        "bundle_omits": bundle_omits(model, aliases),
    }
    cpu = _cpu_copies(state)
    written: list[str | FileRecord] = []
    mine: dict[str, list[str]] = {}
    for key in state:
        if owner[key] == rank:
            mine.setdefault(index["weight_map"][key], []).append(key)
    for name, keys in mine.items():
        originals_here = {k: index["tensors"][k]["original_dtype"] for k in keys if index["tensors"][k]["original_dtype"]}
        metadata = {"format": "pt", "original_dtypes": json.dumps(originals_here)}
        written.append(write_safetensors(staging / MODEL_DIR / name, {k: cpu(k) for k in keys}, f"{MODEL_DIR}/{name}", metadata))
    if rank != 0:
        return written
    (staging / MODEL_SHARD_INDEX).write_text(json.dumps(index, indent=1) + "\n")
    (staging / MODEL_CONSOLIDATE_SH).write_text(consolidate_script())
    (staging / MODEL_CONSOLIDATE_SH).chmod(0o755)
    written += [MODEL_SHARD_INDEX, MODEL_CONSOLIDATE_SH]
    sidecars = None
    if hf_export.is_hf_model(model) or tokenizer is not None:
        sidecars = staging / MODEL_HF_METADATA
        written += [f"{MODEL_HF_METADATA}/{rel}" for rel in hf_export.write_hf_metadata(sidecars, model, tokenizer)]
    if consolidated:
        layout = sharded_model.read_layout(staging / MODEL_DIR)
        out = staging / MODEL_CONSOLIDATED
        written += [
            f"{MODEL_CONSOLIDATED}/{rel}"
            for rel in consolidation.write_bundle(out, layout, fetch=cpu, sidecar_dir=sidecars, aliases=aliases, bundle_omits=index["bundle_omits"])
        ]
    return written


def consolidate_script() -> str:
    """The text of ``model/consolidate.sh`` (package data ``resilience/checkpoint/formats/consolidate.sh``)."""
    return importlib.resources.files("resilience.checkpoint.formats").joinpath(CONSOLIDATE_SH).read_text()


def _cpu_copies(state: dict[str, torch.Tensor]):
    """``cpu(key)``: the tensor on the CPU, contiguous, never sharing storage with another key
    (safetensors refuses aliases such as tied weights). Copies are made only when asked for."""
    first_key: dict[tuple[int, int], str] = {}
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


def _file_plan(sizes: list[tuple[str, int]], originals: dict[str, dict[str, str]], max_file_bytes: int) -> tuple[dict[str, int], int]:
    """Consolidated file index (1-based) per key, and the number of files.

    The original checkpoint's grouping when known (keys it lacks join its last file), else
    consecutive groups of at most ``max_file_bytes`` in state-dict order."""
    file_of: dict[str, int] = {}
    known = sorted({info["file"] for info in originals.values()})
    if known and any(key in originals for key, _ in sizes):
        number = {name: i + 1 for i, name in enumerate(known)}
        for key, _ in sizes:
            file_of[key] = number[originals[key]["file"]] if key in originals else len(known)
    else:
        current, filled = 1, 0
        for key, n in sizes:
            if filled and filled + n > max_file_bytes:
                current, filled = current + 1, 0
            file_of[key] = current
            filled += n
    used = {index: i + 1 for i, index in enumerate(sorted(set(file_of.values())))}  # no empty files
    return {key: used[index] for key, index in file_of.items()}, max(len(used), 1)
