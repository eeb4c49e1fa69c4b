"""Model weights under ``model/``, in NeMo AutoModel's layouts (``checkpoint.model_save_format``).

``safetensors`` (default): every rank writes a balanced part of the tensors in parallel::

    model/
      shard-00001-model-00001-of-00001.safetensors   rank K-1 writes shard-0000K-...; 0000I-of-0000N
      shard-00002-model-00001-of-00001.safetensors   is the consolidated file the tensors belong to
      shard_index.json        tensor -> global shape, dtype, pieces (file, offsets, shape), consolidated file, original dtype
      consolidate.sh          writes model/consolidated/ later (see resilience.checkpoint.formats.consolidate)
      hf_metadata/            config.json, generation_config.json, tokenizer files (HF objects only)
      consolidated/           the Hugging Face bundle, when checkpoint.save_consolidated asks for it

Keys are plain module FQNs (no ``module.`` prefix), as ``torch.distributed.checkpoint.state_dict`` names
them (:mod:`~resilience.checkpoint.formats.state_dicts`).
Tied weights (two keys, one tensor: ``head.weight`` is ``emb.weight``) are stored once, under the
key a Hugging Face model keeps (``save_pretrained`` drops the tied ``lm_head.weight``; otherwise the
first in state-dict order), with the tie recorded in ``shard_index.json`` as
``"aliases": {"head.weight": "emb.weight"}``; loading gives every alias the stored tensor.
``"bundle_omits"`` lists the aliases the model declares tied (``from_pretrained`` ties them again),
which the Hugging Face bundle leaves out as ``save_pretrained`` does; it holds every other alias
as a copy (a tie made by hand is not in ``config.json``). Recorded now, as ``consolidate.sh``
runs later without the model.
Every rank writes only the pieces it owns (:mod:`~resilience.checkpoint.formats.pieces`): of a
replicated model (plain or DDP) a balanced share of whole tensors; of a sharded one (``DTensor``
parameters: FSDP2, tensor parallel, 2-D meshes) its local shards, a block held by several ranks
written once. Each shard file records the global offsets of its pieces as torch's DCP does
(``DCP_SHARDING_INFO``), and rank 0 writes the index; see
:mod:`~resilience.checkpoint.formats.shard_files`. Loading reads, on each rank, the pieces that
overlap what that rank holds, so it works under any world size and mesh (resharding). The consolidated file
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
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from resilience.checkpoint.formats import balanced_load, hf_export, pieces, shard_files, sharded_model
from resilience.checkpoint.formats import consolidate as consolidation
from resilience.checkpoint.formats.plan_cache import LayoutCache
from resilience.checkpoint.formats.state_dicts import get_model_state_dict, set_model_state_dict
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
from resilience.checkpoint.storage.content_check import ContentCheck
from resilience.checkpoint.storage.durable import FileRecord
from resilience.checkpoint.storage.safetensors_file import read_safetensors
from resilience.distributed import DistContext
from resilience.sharded_types import is_dtensor

log = logging.getLogger("resilience.checkpoint")

MAX_FILE_BYTES = 5 * 10**9
SAVE_FORMATS = ("safetensors", "torch_save")


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
    plan: pieces.Plan | None = None,
    layout_cache: LayoutCache | None = None,
) -> Sequence[str | FileRecord]:
    """Write this rank's part of the model into ``staging/model/``; returns what it wrote: records
    of the files digested and fsync'd while written (weight shards, DCP files) and the relative
    paths of the rest (the caller fsyncs and digests those).

    ``state_dict`` is a snapshot of ``get_model_state_dict(model)`` (an asynchronous save writes
    copies while training goes on); by default the live weights are read now. ``aliases``
    (``{alias: canonical}``, see :func:`tied_aliases`) names the tied keys; by default they are
    found in ``state_dict``, which a snapshot of separate copies no longer shows, so a snapshot
    comes with the aliases of the live model and without their keys. safetensors only.
    ``plan`` (:func:`pieces.make_plan` of ``state_dict``, made where the snapshot was taken) says
    which rank writes which piece; by default it is made here (a collective over ``group`` for a
    sharded model). ``layout_cache`` (:class:`LayoutCache`) reuses the plan and the index
    document of an earlier save of the same layout.

    Call it on every rank: with ``save_format="torch_save"``, or a sharded model without ``plan``,
    it is a collective over ``group``.
    ``consolidated`` adds ``model/consolidated/`` (rank 0, safetensors only); ``tokenizer`` (any
    object with ``save_pretrained``) adds its files. A PEFT model writes only its adapters (rank 0).

    Raises:
        ValueError: an unknown ``save_format``.
        NotImplementedError: a ``DTensor`` placement safetensors cannot store (``Partial``; see
            :func:`pieces.unsupported`, checked at ``resilient_loop()`` already).
        ValueError: the ranks' pieces do not tile a tensor (see :func:`pieces.make_plan`).
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
        files: list[str | FileRecord] = [*_save_dcp(staging, state, rank=rank, group=group)]
        if rank == 0 and (hf_export.is_hf_model(model) or tokenizer is not None):  # as for safetensors: beside the weights
            files += [f"{MODEL_HF_METADATA}/{rel}" for rel in hf_export.write_hf_metadata(staging / MODEL_HF_METADATA, model, tokenizer)]
        return files
    aliases = tied_aliases(model, state) if aliases is None else aliases
    state = {key: t for key, t in state.items() if key not in aliases}
    return _save_sharded(
        staging,
        model,
        state,
        rank=rank,
        world_size=world_size,
        group=group,
        plan=plan,
        consolidated=consolidated,
        tokenizer=tokenizer,
        max_file_bytes=max_file_bytes,
        aliases=aliases,
        layout_cache=layout_cache,
    )


def save_problem(
    model: torch.nn.Module, *, rank: int, world_size: int, gather: Callable[[Any], list[Any]], agree: Callable[[str], bool] | None = None
) -> str | None:
    """Why ``model`` cannot be saved with ``model_save_format: safetensors``, or ``None``; checked
    before training (``resilient_loop()``), so a first save never finds it. For a sharded model
    (``DTensor`` parameters) a collective through ``gather`` (``DistContext.all_gather_object``)
    and ``agree`` (``DistContext.same_everywhere``: whether every rank passed the same digest;
    default: compared through ``gather``), answering the same on every rank: a placement other
    than ``Shard``/``Replicate`` (``Partial``), ranks whose layouts differ (the sharding rules
    every save then plans alone would not be the same), or shards whose offsets do not tile
    their tensor."""
    if hf_export.is_peft_model(model):
        return None
    # A model with no DTensor has nothing to check; no state-dict pass (which, for a model without
    # parameters and no process group, torch refuses).
    if not pieces.is_sharded({**dict(model.named_parameters()), **dict(model.named_buffers())}):
        return None
    state = get_model_state_dict(model)
    if not pieces.is_sharded(state):
        return None
    problems = [p for p in gather(pieces.unsupported(state)) if p] if world_size > 1 else [pieces.unsupported(state)]
    if any(problems):
        return next(p for p in problems if p)
    fingerprint = pieces.layout_fingerprint(state, world_size)
    alike = agree(fingerprint) if agree is not None else len(set(gather(fingerprint))) == 1
    if world_size > 1 and not alike:
        return "the ranks' models differ in keys, shapes, dtypes, placements or meshes (every rank must build the same model)"
    try:
        pieces.make_plan(state, rank=rank, world_size=world_size, gather=gather)
    except ValueError as exc:
        return str(exc)
    return None


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
        if not isinstance(t, torch.Tensor):
            continue
        local = t.to_local() if is_dtensor(t) else t  # a sharded tie shares its local shard
        if local.numel() == 0:
            continue  # empty tensors may all report the same null data pointer
        view = (str(local.device), local.untyped_storage().data_ptr(), local.storage_offset(), tuple(t.shape), local.stride(), t.dtype)
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


def load_model(directory: Path, model: torch.nn.Module, *, group: Any = None, check: ContentCheck | None = None, balanced: DistContext | None = None) -> None:
    """Load the weights saved in ``directory/model/`` into ``model`` in place, whatever the layout
    (sharded safetensors under any world size, DCP — a collective over ``group`` — or adapters).
    Shards read whole (a replicated model) are digested as they pass when in ``check``'s share.
    ``balanced`` (a replicated model's safetensors only; a collective over it): each rank reads
    1/N of the shards' bytes and receives the rest (:mod:`balanced_load`).

    Raises:
        ValueError: missing or unexpected keys, or adapters for a model that is not a PEFT model;
            with ``balanced``, on every rank when any rank's model differs from the index.
    """
    model_dir = directory / MODEL_DIR
    if (model_dir / ADAPTER_CONFIG).is_file():
        hf_export.load_adapter(model_dir, model)
    elif (model_dir / DCP_METADATA).is_file():
        from resilience.checkpoint.storage import dcp_io  # DCP, imported only for DCP's files

        state = get_model_state_dict(model)
        dcp_io.load_tensors(state, model_dir, group=group)
        set_model_state_dict(model, state)
    else:
        layout, aliases = sharded_model.read_index(model_dir)  # one parse; a rule's pieces are found by the loader
        live = get_model_state_dict(model)  # the model's own tensors: read into them in place
        if pieces.is_sharded(live) or any(info["shard"] is None for info in layout.values()):
            shard_files.load_by_slices(model_dir, layout, live, aliases, check)  # each rank reads what overlaps its blocks
            return
        if balanced is not None:
            _load_balanced(balanced, directory, layout, aliases, live, model, check)
            return
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted({info["shard"] for info in layout.values()}):
            rel = f"{MODEL_DIR}/{shard}"
            hasher = check.claim(rel) if check is not None else None  # digest the bytes as they pass
            tensors.update(read_safetensors(model_dir / shard, live, digest=hasher))
            if check is not None and hasher is not None:
                check.report(rel, hasher)
        if set(tensors) != set(layout):
            differ = sorted(set(tensors) ^ set(layout))[:5]
            raise ValueError(f"{model_dir}: the shards and {SHARD_INDEX} disagree on {differ}")
        _restore_aliases(model_dir, tensors, aliases, live)
        if set(tensors) != set(live) or any(t is not live[key] for key, t in tensors.items()):
            set_model_state_dict(model, tensors)  # some did not fit in place (or keys differ: its error)


def _load_balanced(ctx: DistContext, directory: Path, layout: dict, aliases: dict, live: dict, model: torch.nn.Module, check: ContentCheck | None) -> None:
    """The replicated branch of :func:`load_model` through :func:`balanced_load.load`; a model
    whose keys or shapes differ from the index is the same ValueError on every rank, before any
    byte moves."""
    specs, problem = balanced_load.model_specs(layout, aliases, live)
    ctx.gather_or_raise(problem and f"the model does not match {directory / MODEL_SHARD_INDEX}: {problem}", fail=ValueError)
    rels = balanced_load.stream_files("model", check, specs)
    with torch.no_grad():
        tensors = balanced_load.load(ctx, directory, rels, specs, live, check)
    _restore_aliases(directory / MODEL_DIR, tensors, aliases, live)
    if set(tensors) != set(live) or any(t is not live[key] for key, t in tensors.items()):
        set_model_state_dict(model, tensors)  # some did not fit in place (another dtype)


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
    from resilience.checkpoint.storage import dcp_io  # DCP, imported only for DCP's files

    return [rec.under(MODEL_DIR) for rec in dcp_io.save_tensors(state, staging / MODEL_DIR, rank=rank, group=group)]


# -- safetensors: per-rank shards ------------------------------------------------------------------
def _save_sharded(
    staging: Path,
    model: torch.nn.Module,
    state: dict[str, torch.Tensor],
    *,
    rank: int,
    world_size: int,
    group: Any,
    plan: pieces.Plan | None,
    consolidated: bool,
    tokenizer: Any,
    max_file_bytes: int,
    aliases: dict[str, str],
    layout_cache: LayoutCache | None = None,
) -> list[str | FileRecord]:
    problem = pieces.unsupported(state)
    if problem:
        raise NotImplementedError(f"model_save_format: safetensors: {problem}")
    cache = layout_cache if layout_cache is not None else LayoutCache(enabled=False)
    if plan is None:
        plan = cache.plan(state, rank=rank, world_size=world_size, gather=DistContext(rank, world_size, group).all_gather_object, aliases=aliases)
    originals = hf_export.original_tensors(model)
    index = cache.index(plan)  # built once per layout
    if index is None:
        nbytes = [(key, math.prod(info["shape"]) * getattr(torch, info["dtype"]).itemsize) for key, info in plan.tensors.items()]
        file_of, num_files = _file_plan(nbytes, originals, max_file_bytes)
        index = cache.keep_index(plan, shard_files.index_doc(plan, file_of, num_files, originals, aliases, bundle_omits(model, aliases)))
    written: list[str | FileRecord] = list(shard_files.write_rank_files(staging / MODEL_DIR, state, plan, index, rank))
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
    # A sharded model's bundle is a part of its own (parts.py: after every rank's shards are
    # durable, streamed from them), so ``consolidated`` is False for it here.
    if consolidated and not pieces.is_sharded(state):
        layout = sharded_model.read_layout(staging / MODEL_DIR)
        out = staging / MODEL_CONSOLIDATED
        cpu = consolidation.cpu_copies(state)
        written += [
            f"{MODEL_CONSOLIDATED}/{rel}"
            for rel in consolidation.write_bundle(out, layout, fetch=cpu, sidecar_dir=sidecars, aliases=aliases, bundle_omits=index["bundle_omits"])
        ]
    return written


def consolidate_script() -> str:
    """The text of ``model/consolidate.sh`` (package data ``resilience/checkpoint/formats/consolidate.sh``)."""
    return importlib.resources.files("resilience.checkpoint.formats").joinpath(CONSOLIDATE_SH).read_text()


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
