"""The per-rank safetensors shard files of ``model/`` and their index: written piece by piece, read
back by slices (``model_save_format: safetensors``; the plan of who writes what is
:mod:`~resilience.checkpoint.formats.pieces`).

Each rank writes the pieces it owns into ``shard-0000K-model-0000I-of-0000N.safetensors`` (K its
rank + 1, I-of-N the Hugging Face output file its tensors belong to), the names torch's
``HuggingFaceStorageWriter(save_distributed=True)`` and NeMo AutoModel give them. A tensor is
stored under its own key in every file holding a piece of it; each file's ``__metadata__`` says
where, as torch's DCP writes it (``torch/distributed/checkpoint/filesystem.py``), so torch's
``HuggingFaceStorageReader`` and ``_consolidate_hf_safetensors`` read our shards too::

    "DCP_SHARDING_INFO": '{"<key>": {"saved_offsets": [0, 64], "global_shape": [128, 128]}, ...}'
    "DCP_VERSION": "1.0",  "format": "pt",  "original_dtypes": '{"<key>": "bfloat16"}'

(``global_shape`` is ours; torch's readers ignore it.) ``shard_index.json`` (rank 0) describes the
whole checkpoint: per key its global ``shape``, ``dtype``, output ``file_index``,
``original_dtype`` and either its sharding ``rule`` (version 3: ``{"mesh", "dims", "replica"}``, see
:mod:`~resilience.checkpoint.formats.shard_rule`; the pieces follow from it, so the index is
O(tensors) at any world size) or, for a tensor without one, its ``pieces`` (``file``, ``offsets``,
``shape``); ``weight_map`` names the file of each key stored whole (one piece); ``aliases`` and
``bundle_omits`` as before (version 1 had no ``pieces``: every key whole, in its ``weight_map``
file; version 2 listed every tensor's pieces).

A loading rank reads, for each tensor it holds (its local shard, or the whole tensor of a plain
model), only the stored pieces that overlap it, and only the overlapping slices of them
(``safetensors.safe_open``), so a resharded load (another world size, another mesh, FSDP2 into a
plain model, replicated into sharded and back) never holds the full model on one rank unless
that rank's model is itself full.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from resilience.checkpoint.formats.pieces import Plan, block_of, local_tensor, overlap_slices
from resilience.checkpoint.formats.shard_rule import Rule
from resilience.checkpoint.layout import SHARD_INDEX, model_shard_name
from resilience.checkpoint.storage.content_check import ContentCheck
from resilience.checkpoint.storage.durable import FileRecord
from resilience.checkpoint.storage.remote_files import ensure_local
from resilience.checkpoint.storage.safetensors_file import read_safetensors, read_safetensors_header, write_safetensors

INDEX_FORMAT = "resilience.sharded_safetensors"
INDEX_VERSION = 3
# The keys torch's DCP writes into a safetensors shard's __metadata__ (torch/distributed/checkpoint/_hf_utils.py).
SHARDING_INFO = "DCP_SHARDING_INFO"
SAVED_OFFSETS = "saved_offsets"
GLOBAL_SHAPE = "global_shape"
DCP_VERSION = ("DCP_VERSION", "1.0")


def index_doc(
    plan: Plan,
    file_of: dict[str, int],
    num_files: int,
    originals: dict[str, dict[str, str]],
    aliases: dict[str, str],
    omits: list[str],
) -> dict[str, Any]:
    """The ``shard_index.json`` document of ``plan`` (see the module docstring); ``file_of``:
    key -> 1-based output file index of ``num_files``; ``originals``: key -> original
    ``{"dtype", "file"}``; ``aliases``/``omits``: the tied keys stored once and those the bundle
    leaves out."""
    tensors, weight_map, total = {}, {}, 0
    for key, info in plan.tensors.items():
        entry = {"dtype": info["dtype"], "shape": info["shape"], "file_index": file_of[key], "original_dtype": originals.get(key, {}).get("dtype")}
        rule = info.get("rule")
        if rule is not None:
            entry["rule"] = rule.to_json()
            if all(d is None for d in rule.dims):  # replicated: one whole piece
                weight_map[key] = piece_file(plan, rule.pieces(tuple(info["shape"]))[0][0], file_of[key], num_files)
        else:
            entry["pieces"] = [
                {"file": piece_file(plan, piece["rank"], file_of[key], num_files), "offsets": piece["offsets"], "shape": piece["shape"]}
                for piece in info["pieces"]
            ]
            if len(entry["pieces"]) == 1 and entry["pieces"][0]["shape"] == info["shape"]:
                weight_map[key] = entry["pieces"][0]["file"]
        total += math.prod(info["shape"]) * getattr(torch, info["dtype"]).itemsize
        tensors[key] = entry
    return {
        "format": INDEX_FORMAT,
        "version": INDEX_VERSION,
        "world_size": plan.world_size,
        "num_files": num_files,
        "metadata": {"total_size": total},
        "weight_map": weight_map,
        "tensors": tensors,
        "aliases": dict(sorted(aliases.items())),  # tied keys: stored once, under the canonical key
        "bundle_omits": omits,
    }


def piece_file(plan: Plan, rank: int, file_index: int, num_files: int) -> str:
    """The shard file rank ``rank`` writes the pieces of output file ``file_index`` into."""
    return model_shard_name(rank + 1, plan.world_size, file_index, num_files)


def write_rank_files(model_dir: Path, state: dict[str, torch.Tensor], plan: Plan, index: dict[str, Any], rank: int) -> list[FileRecord]:
    """Write the pieces ``rank`` owns in ``plan`` (its local blocks of ``state``'s tensors) into its
    shard files under ``model_dir``, each fsync'd and digested while written; returns their
    records (paths relative to the checkpoint directory).

    Raises:
        OSError: from the writes; TypeError: a dtype safetensors cannot store.
    """
    return write_pieces(model_dir, state, plan, index, rank)


def write_pieces(directory: Path, state: dict[str, torch.Tensor], plan: Plan, index: dict[str, Any], rank: int) -> list[FileRecord]:
    """:func:`write_rank_files` into any ``directory`` (the model's, or ``optim/`` for a sharded
    optimizer state, :mod:`~resilience.checkpoint.formats.optim_shards`)."""
    model_dir = directory
    files: dict[str, dict[str, torch.Tensor]] = {}
    info: dict[str, dict[str, Any]] = {}
    for key, piece in plan.mine(rank):
        name = piece_file(plan, rank, index["tensors"][key]["file_index"], index["num_files"])
        files.setdefault(name, {})[key] = _cpu_contiguous(local_tensor(state[key]))
        info.setdefault(name, {})[key] = {SAVED_OFFSETS: piece["offsets"], GLOBAL_SHAPE: index["tensors"][key]["shape"]}
    records = []
    for name, tensors in files.items():
        originals = {k: index["tensors"][k]["original_dtype"] for k in tensors if index["tensors"][k]["original_dtype"]}
        metadata = {"format": "pt", SHARDING_INFO: json.dumps(info[name]), DCP_VERSION[0]: DCP_VERSION[1], "original_dtypes": json.dumps(originals)}
        records.append(write_safetensors(model_dir / name, tensors, f"{model_dir.name}/{name}", metadata))
    return records


def _cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU and contiguous (copied only when it is not)."""
    t = t.cpu() if t.device.type != "cpu" else t
    return t if t.is_contiguous() else t.contiguous()


def pieces_of(index: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """The stored pieces of ``key`` (``{"file", "offsets", "shape"}``), a rule's expanded (all N
    of an FSDP2 tensor: for consolidation and export, which need them all); a version 1 index
    holds every key whole in its ``weight_map`` file."""
    info = index["tensors"][key]
    if "rule" in info:
        return overlapping({**info, "num_files": index["num_files"], "rule": Rule.from_json(info["rule"])})
    if "pieces" in info:
        return info["pieces"]
    return [{"file": index["weight_map"][key], "offsets": [0] * len(info["shape"]), "shape": info["shape"]}]


def overlapping(info: dict[str, Any], offsets: list[int] | None = None, shape: list[int] | None = None) -> list[dict[str, Any]]:
    """The stored pieces (``{"file", "offsets", "shape"}``) of a layout entry ``info`` (see
    :func:`~resilience.checkpoint.formats.sharded_model.read_index`) that overlap the block at
    ``offsets`` of ``shape`` (default: all of them). An entry with a ``rule`` gets them by
    arithmetic per mesh dim (:meth:`Rule.pieces`), never by listing every rank's."""
    rule = info.get("rule")
    if rule is None:
        return info["pieces"]
    found = rule.pieces(tuple(info["shape"]), None if offsets is None else tuple(offsets), None if shape is None else tuple(shape))
    world = rule.world_size
    return [{"file": model_shard_name(r + 1, world, info["file_index"], info["num_files"]), "offsets": list(o), "shape": list(s)} for r, o, s in found]


def load_by_slices(
    model_dir: Path, layout: dict[str, dict[str, Any]], live: dict[str, torch.Tensor], aliases: dict[str, str], check: ContentCheck | None = None
) -> None:
    """Fill every tensor of ``live`` (a model's state dict: plain tensors and ``DTensor``\\ s, the
    model's own storage) in place from the pieces of ``layout`` (see
    :func:`~resilience.checkpoint.formats.sharded_model.read_index`) that overlap this rank's
    block of it (a rule's found by arithmetic, see :func:`overlapping`); an alias reads its
    canonical key's pieces.

    A file whose every piece lies whole in one contiguous run of this rank's tensors (its blocks
    exactly at the saver's layout; whole dim-0 shards when fewer ranks load them, e.g. FSDP2 2 ->
    1) is read whole, in order, straight into them (64 MiB requests), and digested as it passes
    when it is in ``check``'s share (one read of each byte); the others by slices
    (``safetensors.safe_open``).

    Raises:
        ValueError: missing or unexpected keys, another global shape, or a block the stored
            pieces do not cover.
    """
    missing = sorted(key for key in live if aliases.get(key, key) not in layout)
    unexpected = sorted(set(layout) - set(live) - set(aliases.values()))
    if missing or unexpected:
        raise ValueError(f"{model_dir}: the model and {SHARD_INDEX} differ: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        whole, sliced = _plan_reads(model_dir, layout, live, aliases)
        for name, blocks in whole.items():
            if not _read_whole(model_dir, name, blocks, check):
                sliced += [(source, dest, [found]) for source, (dest, found) in blocks.items()]
        _read_slices(model_dir, sliced)


Found = tuple[dict[str, Any], tuple[tuple[slice, ...], tuple[slice, ...]]]  # a stored piece, (its slices, the block's)


def _plan_reads(
    model_dir: Path, layout: dict[str, dict[str, Any]], live: dict[str, torch.Tensor], aliases: dict[str, str]
) -> tuple[dict[str, dict[str, tuple[torch.Tensor, Found]]], list[tuple[str, torch.Tensor, list[Found]]]]:
    """The reads of :func:`load_by_slices`: ``{file: {stored key: (this rank's tensor, piece)}}``
    of the pieces that lie whole in a contiguous run of this rank's tensor, and ``[(stored key,
    this rank's tensor, pieces)]`` of the rest. Raises ``ValueError`` for another global shape or a block the pieces do not cover."""
    whole: dict[str, dict[str, tuple[torch.Tensor, Found]]] = {}
    sliced: list[tuple[str, torch.Tensor, list[Found]]] = []
    for key, t in live.items():
        source = aliases.get(key, key)
        info = layout[source]
        if list(t.shape) != list(info["shape"]):
            raise ValueError(f"{model_dir}: {key} has shape {list(t.shape)} in the model, {info['shape']} saved")
        block, dest = block_of(t), local_tensor(t)
        found: list[Found] = []
        for piece in overlapping(info, list(block.offsets), list(block.shape)):
            where = overlap_slices(list(block.offsets), list(block.shape), piece["offsets"], piece["shape"])
            if where is not None:
                found.append((piece, where))
        covered = sum(math.prod(d.stop - d.start for d in where[1]) for _, where in found)
        if covered != dest.numel():
            raise ValueError(f"{model_dir}: the stored pieces of {source} cover {covered} of the {dest.numel()} elements this rank holds")
        for piece, where in found:
            # a whole piece landing in one contiguous run of this rank's block (the block itself at
            # the saver's layout; a run of rows when fewer ranks load dim-0 shards): read in place
            if _whole(piece, where[0]) and dest[where[1]].is_contiguous() and source not in whole.get(piece["file"], {}):
                whole.setdefault(piece["file"], {})[source] = (dest, (piece, where))
            else:
                sliced.append((source, dest, [(piece, where)]))
    return whole, sliced


def _whole(piece: dict[str, Any], slices: tuple[slice, ...]) -> bool:
    """Whether ``slices`` (into a stored piece) take all of it."""
    return all(s.start == 0 and s.stop == n for s, n in zip(slices, piece["shape"], strict=True))


def _read_whole(model_dir: Path, name: str, blocks: dict[str, tuple[torch.Tensor, Found]], check: ContentCheck | None) -> bool:
    """Read the file ``name`` whole, in order, into ``blocks``' tensors (each piece into the run of
    its tensor it covers) when it holds nothing else (False when it does: the caller reads those
    blocks by slices), digesting it for ``check``."""
    path = model_dir / name
    ensure_local(path)
    if set(read_safetensors_header(path)) - {"__metadata__"} != set(blocks):
        return False
    rel = f"{model_dir.name}/{name}"
    hasher = check.claim(rel) if check is not None else None  # None: another rank's share, or not ours to digest
    targets = {source: dest[where[1]] for source, (dest, (_, where)) in blocks.items()}
    read = read_safetensors(path, targets, digest=hasher)
    for source, target in targets.items():
        if read[source] is not target:  # another dtype or a non-contiguous block: read aside, copied in
            target.copy_(read[source].reshape(target.shape))
    if check is not None and hasher is not None:
        check.report(rel, hasher)
    return True


def _read_slices(model_dir: Path, reads: list[tuple[str, torch.Tensor, list[Found]]]) -> None:
    """Copy the overlapping slice of every stored piece of ``reads`` into its block (``safe_open``)."""
    handles: dict[str, Any] = {}
    try:
        for source, dest, found in reads:
            for piece, where in found:
                if piece["file"] not in handles:
                    ensure_local(model_dir / piece["file"])  # on object storage: fetched now if another rank's
                    handles[piece["file"]] = safe_open(str(model_dir / piece["file"]), framework="pt")
                stored = handles[piece["file"]]
                dest[where[1]].copy_(stored.get_slice(source)[where[0]] if where[0] else stored.get_tensor(source))
    finally:
        handles.clear()
