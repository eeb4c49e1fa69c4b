"""The sharding rule of a tensor: its pieces from (global shape, mesh shape, placements), no gather.

A ``DTensor`` on a mesh that covers every rank of the job in order (``mesh.size() == world_size``,
ranks ``0..N-1`` row-major over the mesh: ``init_device_mesh`` over the world, FSDP2
``fully_shard``, tensor parallel, HSDP's 2-D mesh) with ``Shard``/``Replicate`` placements holds,
on every rank, the block torch's own arithmetic gives
(``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``: along each mesh dim
that shards tensor dim ``d``, the current length is cut into ``torch.chunk`` chunks of
``ceil(length / n)``, mesh dims applied left to right). So every rank knows every piece from the
:class:`Rule` alone: the pieces are the distinct non-empty blocks; along the ``Replicate`` mesh
dims the copy is written by one coordinate, ``replica`` (row-major over those dims), chosen per
tensor so that the replicas write about the same bytes (:func:`balance_replicas`). A plain
tensor of a sharded model (a buffer, an unsharded norm) is the rule ``Replicate`` over the world.

Anything else (a submesh repeated over data-parallel ranks, ``_StridedShard`` of FSDP2 over TP,
an empty tensor) has no rule and is planned from every rank's blocks
(:func:`~resilience.checkpoint.formats.pieces.make_plan`'s gather).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections import Counter
from typing import Any

import torch

from resilience.sharded_types import DTENSOR_MODULE, is_dtensor, loaded_class


def strided_shard() -> type | tuple[()]:
    """torch's ``_StridedShard`` placement (FSDP2 over tensor parallel), ``()`` where torch has none;
    asked only of a ``DTensor``, so its module is loaded already."""
    return loaded_class(f"{DTENSOR_MODULE}.placement_types", "_StridedShard") or ()


@dataclasses.dataclass(frozen=True)
class Rule:
    """How a tensor lies over the ranks: ``mesh`` (the mesh shape; rank = the row-major index of
    a coordinate), ``dims`` (per mesh dim, the tensor dim it shards, ``None`` for ``Replicate``)
    and ``replica`` (the row-major index, over the ``Replicate`` mesh dims only, of the
    coordinate that writes the copies)."""

    mesh: tuple[int, ...]
    dims: tuple[int | None, ...]
    replica: int = 0

    def to_json(self) -> dict[str, Any]:
        """The rule as ``shard_index.json`` stores it."""
        return {"mesh": list(self.mesh), "dims": list(self.dims), "replica": self.replica}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Rule:
        """The rule :meth:`to_json` wrote."""
        return cls(tuple(int(n) for n in doc["mesh"]), tuple(None if d is None else int(d) for d in doc["dims"]), int(doc.get("replica", 0)))

    @property
    def replicas(self) -> int:
        """Copies of each block: the product of the ``Replicate`` mesh dims' sizes."""
        return math.prod(n for n, d in zip(self.mesh, self.dims) if d is None)

    @property
    def world_size(self) -> int:
        """Ranks the mesh covers."""
        return math.prod(self.mesh)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinate of ``rank`` (row-major)."""
        out = []
        for size in reversed(self.mesh):
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))

    def rank_at(self, coordinate: tuple[int, ...]) -> int:
        """The rank at a mesh ``coordinate`` (row-major)."""
        rank = 0
        for c, size in zip(coordinate, self.mesh):
            rank = rank * size + c
        return rank

    def writer_coordinates(self) -> dict[int, int]:
        """``{mesh dim: coordinate}`` of the ``Replicate`` mesh dims: the copy these write."""
        rep = [i for i, d in enumerate(self.dims) if d is None]
        out, left = {}, self.replica
        for i in reversed(rep):
            left, out[i] = divmod(left, self.mesh[i])
        return out

    def block(self, global_shape: tuple[int, ...], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(offsets, shape)`` of the block ``rank`` holds (torch's arithmetic, see the module docstring)."""
        coord = self.coordinate(rank)
        offsets, shape = [0] * len(global_shape), list(global_shape)
        for i, d in enumerate(self.dims):
            if d is not None:
                start, size = _chunk(shape[d], self.mesh[i], coord[i])
                offsets[d] += start
                shape[d] = size
                if not size:
                    offsets[d] = global_shape[d]  # torch's offset of an empty shard
        return tuple(offsets), tuple(shape)

    def writes(self, rank: int) -> bool:
        """Whether ``rank`` is the one writing its block (its ``Replicate`` coordinates are the writer's)."""
        coord = self.coordinate(rank)
        return all(coord[i] == c for i, c in self.writer_coordinates().items())

    def pieces(
        self, global_shape: tuple[int, ...], offsets: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None
    ) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """``(writer rank, offsets, shape)`` of every stored (non-empty) piece, in offset order;
        with ``offsets``/``shape`` (a destination block) only those overlapping it, found per
        tensor dim by arithmetic over the chunks (work grows with the overlapping pieces, not
        with the ranks)."""
        offsets = (0,) * len(global_shape) if offsets is None else offsets
        shape = tuple(global_shape) if shape is None else shape
        per_dim = []
        for d, length in enumerate(global_shape):
            sharding = [i for i, dim in enumerate(self.dims) if dim == d]
            per_dim.append(_intervals(0, length, [self.mesh[i] for i in sharding], offsets[d], offsets[d] + shape[d], sharding))
        fixed = self.writer_coordinates()
        out = []
        for combo in itertools.product(*per_dim):
            coord = dict(fixed)
            for coords, _, _ in combo:
                coord.update(coords)
            rank = self.rank_at(tuple(coord[i] for i in range(len(self.mesh))))
            out.append((rank, tuple(start for _, start, _ in combo), tuple(size for _, _, size in combo)))
        return out


def _chunk(length: int, n: int, k: int) -> tuple[int, int]:
    """``(start, size)`` of chunk ``k`` of ``n`` of a dim of ``length`` (``torch.chunk``; empty
    chunks start at ``length``), as torch's ``Shard.local_shard_size_and_offset``."""
    full = -(-length // n)
    start = min(length, full * k)
    return start, max(0, min(length, full * k + full) - full * k)


def _intervals(base: int, length: int, sizes: list[int], lo: int, hi: int, mesh_dims: list[int]) -> list[tuple[dict[int, int], int, int]]:
    """The non-empty chunks of ``[base, base + length)`` cut by the mesh dims ``mesh_dims`` (of
    ``sizes``) in turn that overlap ``[lo, hi)``: ``({mesh dim: coordinate}, start, size)``."""
    if hi <= lo or length <= 0:
        return []
    if not sizes:
        return [({}, base, length)] if base < hi and lo < base + length else []
    n, full = sizes[0], -(-length // sizes[0])
    first, last = max(0, (lo - base) // full), min(n - 1, (hi - 1 - base) // full)
    out = []
    for k in range(first, last + 1):
        start, size = _chunk(length, n, k)
        if size:
            for coords, s, z in _intervals(base + start, size, sizes[1:], lo, hi, mesh_dims[1:]):
                out.append(({mesh_dims[0]: k, **coords}, s, z))
    return out


_MESH_ORDERED: dict[int, tuple[Any, bool]] = {}


def balance_replicas(rules: dict[str, Rule | None], nbytes: dict[str, int]) -> dict[str, Rule | None]:
    """``rules`` with each replicated rule's ``replica`` chosen so that the copies' writers share
    the bytes: largest first (ties in key order), each to the least loaded replica of its mesh
    and placements (a heap per kind of at most its tensor count: O(tensors log tensors), whatever
    the ranks; a heap of every replica cost O(tensors x N), 0.2 s per save at 8,192); the same on every rank, which
    holds the same keys and shapes."""
    out = dict(rules)
    order = {key: i for i, key in enumerate(rules)}
    replicated = {k: r for k, r in rules.items() if r is not None and r.replicas > 1}
    kinds = Counter(_kind(r) for r in replicated.values())
    heaps: dict[tuple, list[tuple[int, int]]] = {}
    for key in sorted(replicated, key=lambda k: (-nbytes[k], order[k])):
        rule = replicated[key]
        kind = _kind(rule)
        if kind not in heaps:  # replicas past the kind's tensor count never get one (ties go to the lowest)
            heaps[kind] = [(0, r) for r in range(min(rule.replicas, kinds[kind]))]
        heap = heaps[kind]
        load, replica = heapq.heappop(heap)
        out[key] = dataclasses.replace(rule, replica=replica)
        heapq.heappush(heap, (load + nbytes[key] // (rule.world_size // rule.replicas), replica))
    return out


def _kind(rule: Rule) -> tuple:
    """Rules whose replicas share one load balance: the same mesh and ``Replicate`` dims."""
    return rule.mesh, tuple(d is None for d in rule.dims)


def rule_of(t: torch.Tensor, world_size: int) -> Rule | None:
    """The rule of ``t`` (see the module docstring; ``replica`` 0, see :func:`balance_replicas`),
    or ``None`` when it has none (then its pieces come from every rank's blocks)."""
    if math.prod(t.shape) == 0:
        return None
    if not is_dtensor(t):
        return Rule((world_size,), (None,))
    mesh = t.device_mesh
    if mesh.size() != world_size or not _ordered(mesh):
        return None
    dims: list[int | None] = []
    strided = strided_shard()
    for p in t.placements:
        if strided and isinstance(p, strided):
            return None
        if p.is_shard():
            dims.append(p.dim)  # type: ignore[attr-defined]  # a Shard: torch types is_shard() as bool, not TypeIs[Shard]
        elif p.is_replicate():
            dims.append(None)
        else:
            return None  # Partial: refused by pieces.unsupported
    return Rule(tuple(mesh.shape), tuple(dims))


def _ordered(mesh: Any) -> bool:
    """Whether ``mesh`` holds ranks ``0..N-1`` row-major (computed once per mesh object)."""
    cached = _MESH_ORDERED.get(id(mesh))
    if cached is not None and cached[0] is mesh:
        return cached[1]
    ranks = mesh.mesh.flatten()
    ordered = bool(torch.equal(ranks, torch.arange(ranks.numel(), dtype=ranks.dtype)))
    _MESH_ORDERED[id(mesh)] = (mesh, ordered)
    return ordered
