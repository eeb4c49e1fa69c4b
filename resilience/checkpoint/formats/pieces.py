"""Which rank writes which piece of each model tensor (``model_save_format: safetensors``).

A rank's *piece* of a tensor is the block of the global tensor it holds: the whole tensor for a
plain (replicated) one, the local shard of a ``DTensor`` (FSDP2 ``fully_shard``, tensor parallel
``parallelize_module``, 2-D meshes) at the global offsets torch's own
``compute_local_shape_and_global_offset`` gives, as DCP does (uneven shards included). Ranks that
hold the same block (a replicated tensor; the copies along a ``Replicate`` mesh dimension; a
tensor-parallel submesh repeated over the data-parallel ranks, which the ``DTensor`` itself does
not see) hold copies: one of them writes it. A tensor with a sharding rule
(:mod:`~resilience.checkpoint.formats.shard_rule`: a ``DTensor`` on a mesh over the whole job,
or a plain tensor of a sharded model) is planned locally from its rule, no collective. The other
ranks' blocks of the rest (a submesh repeated over data-parallel ranks, ``_StridedShard``) are
all-gathered (names, offsets and shapes only) and every rank computes the same plan from them: a
block held by one rank is written by it; a copied block goes, largest first, to the least loaded
of its holders (bytes), so each rank writes about 1/N of the model and nothing is written twice.
For a replicated model this is :func:`resilience.checkpoint.balance.balance` over whole tensors,
and no collective is needed (every rank holds everything).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable
from typing import Any

import torch

from resilience.checkpoint.balance import balance
from resilience.checkpoint.formats.shard_rule import Rule, balance_replicas, rule_of, strided_shard
from resilience.sharded_types import any_dtensor, is_dtensor
from resilience.torch_private import local_shape_and_offset


@dataclasses.dataclass(frozen=True)
class Block:
    """The block of a global tensor one rank holds: ``offsets`` and ``shape`` (elements, per dim)
    inside ``global_shape``; ``dtype`` a torch dtype name (``"float32"``)."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        """Elements in the block."""
        return math.prod(self.shape)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the names our JSON files use)."""
    return str(dtype).removeprefix("torch.")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a ``DTensor``'s local shard, a plain tensor itself (detached)."""
    return t.to_local().detach() if is_dtensor(t) else t.detach()


def block_of(t: torch.Tensor) -> Block:
    """The block of ``t``'s global tensor this rank holds (see the module docstring)."""
    if is_dtensor(t):
        shape, offsets = local_shape_and_offset(t)
        return Block(tuple(t.shape), offsets, shape, dtype_name(t.dtype))
    return Block(tuple(t.shape), (0,) * t.dim(), tuple(t.shape), dtype_name(t.dtype))


def is_sharded(state: dict[str, Any]) -> bool:
    """True when any value of ``state`` is a ``DTensor``."""
    return any_dtensor(state.values())


def unsupported(state: dict[str, Any]) -> str | None:
    """Why ``state`` cannot be saved piece by piece, or ``None``: a ``DTensor`` placement other
    than ``Shard`` or ``Replicate`` (``Partial``: a pending reduction, not values to store).
    FSDP2 over tensor parallel shards a TP shard again (``_StridedShard``): accepted, as its
    blocks are contiguous in the layouts torch builds; :func:`make_plan` checks they tile."""
    for key, t in state.items():
        if is_dtensor(t):
            odd = [p for p in t.placements if not (p.is_shard() or p.is_replicate() or isinstance(p, strided_shard()))]
            if odd:
                return f"{key} is a DTensor with placement {odd[0]!r} (only Shard and Replicate placements hold storable values)"
    return None


@dataclasses.dataclass
class Plan:
    """Every rank's writing plan of one save, alike on every rank.

    ``tensors``: per key (state-dict order), its global shape, dtype and either its ``rule`` (a
    :class:`~resilience.checkpoint.formats.shard_rule.Rule`) or its ``pieces``, each a dict
    ``{"offsets", "shape", "rank"}`` (the writing rank), in offset order. ``world_size``: ranks.
    """

    tensors: dict[str, dict[str, Any]]
    world_size: int

    def mine(self, rank: int) -> list[tuple[str, dict[str, Any]]]:
        """``(key, piece)`` of every piece ``rank`` writes, in state-dict order (a rule's by
        arithmetic on ``rank`` alone)."""
        out = []
        for key, info in self.tensors.items():
            rule = info.get("rule")
            if rule is None:
                out += [(key, piece) for piece in info["pieces"] if piece["rank"] == rank]
            elif rule.writes(rank):
                offsets, shape = rule.block(tuple(info["shape"]), rank)
                if math.prod(shape):
                    out.append((key, {"offsets": list(offsets), "shape": list(shape), "rank": rank}))
        return out

    def pieces(self, key: str) -> list[dict[str, Any]]:
        """Every piece of ``key`` (``{"offsets", "shape", "rank"}``, offset order), a rule's expanded."""
        info = self.tensors[key]
        if "rule" not in info:
            return info["pieces"]
        return [{"offsets": list(o), "shape": list(s), "rank": r} for r, o, s in info["rule"].pieces(tuple(info["shape"]))]


def make_plan(state: dict[str, torch.Tensor], *, rank: int, world_size: int, gather: Callable[[Any], list[Any]]) -> Plan:
    """The plan of who writes what (see the module docstring). A collective through ``gather``
    (``DistContext.all_gather_object``: every rank's object, indexed by rank) only when ``state``
    holds a ``DTensor`` without a sharding rule (:func:`~resilience.checkpoint.formats.shard_rule.rule_of`);
    local otherwise (a replicated model: every rank holds every tensor).

    Raises:
        ValueError: ranks disagree on a tensor's global shape or dtype, a tensor's pieces do
            not tile it exactly (a layout the offsets cannot describe), or this rank's block is
            not the one its rule gives; the same on every rank.
    """
    if not is_sharded(state):
        return _replicated_plan(state, world_size)
    rules = rules_of(state, world_size)
    rest = {key: block_of(t) for key, t in state.items() if rules[key] is None}
    for key, rule in rules.items():
        if rule is not None and is_dtensor(state[key]):
            block = block_of(state[key])
            if rule.block(block.global_shape, rank) != (block.offsets, block.shape):
                raise ValueError(f"{key}: rank {rank} holds the block at {list(block.offsets)} of shape {list(block.shape)}, not its rule's {rule}")
    planned = _assign(gather(rest) if world_size > 1 else [rest], world_size).tensors if rest else {}
    tensors = {}
    for key, t in state.items():
        rule = rules[key]
        tensors[key] = planned[key] if rule is None else {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "rule": rule}
    return Plan(tensors, world_size)


def layout_fingerprint(state: dict[str, torch.Tensor], world_size: int) -> str:
    """A digest (hex) of what a plan depends on: keys, global shapes, dtypes, placements, mesh
    shapes and world size (and whether each tensor has a sharding rule); O(tensors)."""
    h = hashlib.sha256(str(world_size).encode())
    for key, t in state.items():
        where = (tuple(t.device_mesh.shape), tuple(repr(p) for p in t.placements)) if is_dtensor(t) else None
        h.update(repr((key, tuple(t.shape), str(t.dtype), where)).encode())
    return h.hexdigest()


def rules_of(state: dict[str, torch.Tensor], world_size: int) -> dict[str, Rule | None]:
    """Per key of a sharded ``state``, its sharding rule or ``None`` (planned from the gather)."""
    rules = {key: rule_of(t, world_size) for key, t in state.items()}
    return balance_replicas(rules, {key: t.numel() * t.element_size() for key, t in state.items()})


def _replicated_plan(state: dict[str, torch.Tensor], world_size: int) -> Plan:
    """The plan of a replicated ``state`` (every rank holds every tensor whole): :func:`balance`
    over whole tensors, O(tensors log tensors) whatever the ranks. It is :func:`_assign`'s split for
    N identical holders (largest first to the least loaded rank, ties to the lowest; an empty
    tensor to rank 0), without its N holders per tensor (O(tensors x N): 1-3 s per save at 8,192)."""
    tensors: dict[str, dict[str, Any]] = {}
    sizes: dict[str, int] = {}
    for key, t in state.items():
        tensors[key] = {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "pieces": []}
        if t.numel():
            sizes[key] = t.numel() * t.element_size()
    owner = balance(sizes, world_size)
    for key, t in state.items():
        tensors[key]["pieces"].append({"offsets": [0] * t.dim(), "shape": list(t.shape), "rank": owner.get(key, 0)})
    return Plan(tensors, world_size)


def _assign(held: list[dict[str, Block]], world_size: int) -> Plan:
    """The plan from every rank's blocks (``held[r]``: rank r's ``{key: Block}``)."""
    order: dict[str, None] = {}
    for blocks in held:
        order.update(dict.fromkeys(blocks))
    tensors: dict[str, dict[str, Any]] = {}
    holders: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for key in order:
        first = next(blocks[key] for blocks in held if key in blocks)
        tensors[key] = {"shape": list(first.global_shape), "dtype": first.dtype, "pieces": []}
        for r, blocks in enumerate(held):
            block = blocks.get(key)
            if block is None:
                continue
            if (block.global_shape, block.dtype) != (first.global_shape, first.dtype):
                raise ValueError(f"{key}: ranks disagree on its global shape or dtype ({first} vs {block} on rank {r})")
            if block.numel or math.prod(block.global_shape) == 0:  # empty shards of uneven sharding hold nothing
                holders.setdefault((key, block.offsets, block.shape), []).append(r)
    load = [0] * world_size
    owner: dict[tuple, int] = {}
    items = list(holders)
    nbytes = {item: math.prod(item[2]) * getattr(torch, tensors[item[0]]["dtype"]).itemsize for item in items}
    for item in items:  # a block only one rank holds is written by it
        if len(holders[item]) == 1 or math.prod(tensors[item[0]]["shape"]) == 0:
            owner[item] = holders[item][0]
            load[owner[item]] += nbytes[item]
    for i in sorted((i for i, item in enumerate(items) if item not in owner), key=lambda i: (-nbytes[items[i]], i)):
        item = items[i]
        owner[item] = min(holders[item], key=lambda r: (load[r], r))
        load[owner[item]] += nbytes[item]
    for (key, offsets, shape), r in owner.items():
        tensors[key]["pieces"].append({"offsets": list(offsets), "shape": list(shape), "rank": r})
    for key, info in tensors.items():
        info["pieces"].sort(key=lambda piece: piece["offsets"])
        problem = tiling_problem(info["shape"], info["pieces"])
        if problem:
            raise ValueError(f"{key}: {problem}")
    return Plan(tensors, world_size)


def tiling_problem(global_shape: list[int], pieces: list[dict[str, Any]]) -> str | None:
    """Why ``pieces`` (each ``{"offsets", "shape"}``, sorted by offsets) do not tile a tensor of
    ``global_shape`` exactly (outside it, overlapping, or leaving a gap), else ``None``."""
    total = math.prod(global_shape)
    if not pieces:
        return "no rank holds any of it"
    covered = 0
    for piece in pieces:
        offsets, shape = piece["offsets"], piece["shape"]
        if len(offsets) != len(global_shape) or any(o < 0 or o + s > g for o, s, g in zip(offsets, shape, global_shape)):
            return f"piece at {offsets} of shape {shape} lies outside the global shape {global_shape}"
        covered += math.prod(shape)
    for i, a in enumerate(pieces):  # sorted by offsets: stop at the first piece past a's first dim
        for b in pieces[i + 1 :]:
            if global_shape and b["offsets"][0] >= a["offsets"][0] + a["shape"][0]:
                break
            if _overlap(a, b):
                return f"pieces at {a['offsets']} and {b['offsets']} overlap"
    if covered != total and total:
        return f"its pieces cover {covered} of its {total} elements"
    return None


def _overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(max(oa, ob) < min(oa + sa, ob + sb) for oa, sa, ob, sb in zip(a["offsets"], a["shape"], b["offsets"], b["shape"])) and bool(
        math.prod(a["shape"]) and math.prod(b["shape"])
    )


def overlap_slices(dest_offsets: list[int], dest_shape: list[int], offsets: list[int], shape: list[int]) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Where a stored piece (``offsets``, ``shape``) and a destination block (``dest_offsets``,
    ``dest_shape``) of the same global tensor overlap: ``(slices into the piece, slices into the
    destination)``, or ``None`` when they do not (a 0-dim tensor always overlaps itself)."""
    src, dst = [], []
    for d_off, d_len, p_off, p_len in zip(dest_offsets, dest_shape, offsets, shape):
        lo, hi = max(d_off, p_off), min(d_off + d_len, p_off + p_len)
        if hi <= lo:
            return None
        src.append(slice(lo - p_off, hi - p_off))
        dst.append(slice(lo - d_off, hi - d_off))
    return tuple(src), tuple(dst)
