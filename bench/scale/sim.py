"""Rank r of N in one process: the collectives answer with every rank's data, rank r's own real.

:class:`SimContext` is a :class:`~resilience.distributed.DistContext` whose gathers return a list of
N entries: on rank 0 (simulated first) its own object and, for every other rank q, the object rank
q would contribute, made by :meth:`Cell.peer_object` from the same inputs the library uses (torch's
own shard arithmetic for ``Block``\\ s; the library's own per-rank file writers for file records,
see :mod:`bench.scale.save`). On rank r (simulated next) the list rank 0 saw is returned with slot
r replaced by rank r's real object, which is compared with the one made for it: a mismatch is a
bench bug and fails the cell. Broadcasts return rank 0's object.

:class:`SimDistWrapper` does the same for DCP (it replaces ``torch.distributed.checkpoint``'s
``_DistWrapper`` in the saver and the loader): each rank's map step and the coordinator's
reduce step run for real; the other ranks' save plans are rank 0's with each ``DTensor`` chunk
moved to rank q's block (torch's function), their write results what :func:`sparse.dcp_results`
gives for rank q's central plan. Load plans are not synthesised (the coordinator's load step
passes them through): their sizes are taken as rank r's own.

Bytes received are added to ``PROBE.received`` with torch's padding rules (:func:`probe.received`);
the flag all-reduces (:meth:`DistContext.max_over_ranks`) count twice their buffer, and the gather
of the records to rank 0 (:meth:`DistContext.gather_to_root`) the payloads at rank 0 only.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.utils import _DistWrapper

from bench.scale import sparse
from bench.scale.llama import local_block
from bench.scale.probe import PROBE, pickled_size, received
from resilience.checkpoint.formats.pieces import Block
from resilience.checkpoint.storage.durable import FileRecord
from resilience.distributed import DistContext


@dataclasses.dataclass
class Cell:
    """What the simulated ranks of one (mode, N) cell share: rank 0's collective results (by
    phase and call order) for rank r to receive, and the per-rank file writer of the save."""

    mode: str
    world_size: int
    sim_rank: int
    peer_records: Any = None
    """Rank q's file records of the save, its files made (a :class:`~bench.scale.save.PeerFiles`, set
    by the save before its gathers): ``listed(q)`` (what it sends rank 0), ``own(q)`` (to its block's leader)."""
    results: dict[tuple, Any] = dataclasses.field(default_factory=dict)
    mismatches: list[str] = dataclasses.field(default_factory=list)
    dcp_target: Path | None = None
    dcp_peer_records: dict[int, list[FileRecord]] = dataclasses.field(default_factory=dict)
    own_records: list[FileRecord] = dataclasses.field(default_factory=list)
    """The simulated rank's own file records, as it gave them to the records gather."""
    rank: int = 0
    phase: str = "save"
    _calls: dict[tuple, int] = dataclasses.field(default_factory=dict)

    def begin(self, rank: int, phase: str) -> None:
        """Simulate ``rank`` in ``phase`` (``save``/``resume``) from now on."""
        self.rank, self.phase = rank, phase
        self._calls = {}
        self.own_records = []

    def key(self, kind: str) -> tuple:
        """A collective's identity: phase, kind, and its place among this rank's calls of that kind."""
        n = self._calls.get((self.phase, kind), 0)
        self._calls[(self.phase, kind)] = n + 1
        return (self.phase, kind, n)

    def peer_object(self, obj: Any, q: int) -> Any:
        """What rank q contributes to a gather where rank 0 contributes ``obj``."""
        if obj is None or isinstance(obj, (str, int, float, bool)):
            return obj  # a verdict (no error) or a fingerprint every rank holds alike
        if isinstance(obj, dict) and obj and all(isinstance(b, Block) for b in obj.values()):
            return {key: _block_of(b, q, self.world_size) for key, b in obj.items()}
        if isinstance(obj, list) and obj and all(isinstance(rec, FileRecord) for rec in obj) and self.peer_records is not None:
            return self.peer_records.listed(q)  # the records gathered to rank 0
        if isinstance(obj, tuple) and len(obj) == 2 and obj[1] is None:
            payload = obj[0]
            if payload is None:
                return (None, None)
            if isinstance(payload, list) and self.peer_records is not None:
                return (self.peer_records.listed(q), None)
        raise TypeError(f"the scale bench cannot make rank {q}'s part of a gather of {type(obj).__name__}: {str(obj)[:200]}")

    def compare(self, where: str, made: Any, real: Any) -> None:
        """Record a difference between what was made for rank r and what rank r gave."""
        if _comparable(made) != _comparable(real):
            self.mismatches.append(f"{where}: made {str(_comparable(made))[:300]}, rank {self.rank} gave {str(_comparable(real))[:300]}")


def _block_of(block: Block, q: int, world_size: int) -> Block:
    shape, offsets = local_block(tuple(block.global_shape), q, world_size)
    return Block(block.global_shape, tuple(offsets), tuple(shape), block.dtype)


def _comparable(obj: Any) -> Any:
    if isinstance(obj, list) and obj and all(isinstance(rec, FileRecord) for rec in obj):
        return sorted((rec.path, rec.size) for rec in obj)
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], list):
        return sorted((rec.path, rec.size) for rec in obj[0])  # records: digests are stand-ins
    return obj


class SimContext(DistContext):
    """Rank ``cell.rank`` of ``cell.world_size``, its collectives simulated (see the module docstring)."""

    def __init__(self, cell: Cell):
        super().__init__(rank=cell.rank, world_size=cell.world_size)
        self.cell = cell

    @property
    def distributed(self) -> bool:
        """Always: N > 1 ranks are simulated."""
        return True

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (see the module docstring)."""
        cell = self.cell
        with PROBE.excluded():
            key = cell.key("all_gather")
            if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], list):
                cell.own_records = list(obj[0])
            if self.rank == 0:
                gathered = [obj] + [cell.peer_object(obj, q) for q in range(1, self.world_size)]
                sizes = [pickled_size(x) for x in gathered]
                cell.results[key] = (gathered, sizes)
            else:
                gathered, sizes = cell.results[key]
                cell.compare(f"{key}", gathered[self.rank], obj)
                gathered = list(gathered)
                gathered[self.rank] = obj
            PROBE.received["ours"] += received("all_gather", sizes, self.rank)
        return gathered

    def max_over_ranks(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` (no simulated peer fails; a payload size is agreed again by the
        gather it precedes); an all-reduce of int64s receives about twice its buffer (a ring)."""
        with PROBE.excluded():
            self.cell.key("all_reduce")
            PROBE.received["ours"] += 2 * 8 * len(values)
        return list(values)

    def same_everywhere(self, fingerprint: str) -> bool:
        """True (the simulated peers hold what rank 0 holds); one all-reduce of two int64s."""
        self.max_over_ranks([0, 0])  # counted as the all-reduce it is
        return True

    def gather_to_leaders(self, obj: Any, block: int) -> list[Any] | None:
        """Rank 0 (a leader): its block's own file records, rank q's made by ``peer_records.own(q)``;
        rank r (not a leader here): ``None``, its records compared with the ones made for it. The
        point-to-point messages are counted at rank 0 (each its pickled size)."""
        cell = self.cell
        with PROBE.excluded():
            key = cell.key("gather_to_leaders")
            cell.own_records += list(obj)
            if self.rank == 0:
                gathered = [obj] + [cell.peer_records.own(q) for q in range(1, min(block, self.world_size))]
                cell.results[key] = gathered
                PROBE.received["ours"] += sum(8 + pickled_size(x) for x in gathered[1:])
                return gathered
            if self.rank % block == 0:
                raise ValueError(f"the scale bench simulates rank {self.rank} as a block member, but it leads a block of {block}")
            cell.compare(f"{key}", cell.peer_records.own(self.rank), obj)
        return None

    def gather_to_root(self, obj: Any, *, largest: int | None = None) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0, ``None`` on rank r (its own compared with the one made for it)."""
        cell = self.cell
        with PROBE.excluded():
            key = cell.key("gather_to_root")
            if isinstance(obj, list) and obj and isinstance(obj[0], FileRecord):
                cell.own_records += list(obj)
            if self.rank == 0:
                gathered = [obj] + [cell.peer_object(obj, q) for q in range(1, self.world_size)]
                sizes = [pickled_size(x) for x in gathered]
                cell.results[key] = (gathered, sizes)
                PROBE.received["ours"] += (self.world_size - 1) * max(sizes)  # padded to the largest, sizes agreed by the all-reduce
                return gathered
            gathered, _ = cell.results[key]
            cell.compare(f"{key}", gathered[self.rank], obj)
        return None

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank 0's ``obj`` (rank 0 is simulated first)."""
        cell = self.cell
        with PROBE.excluded():
            key = cell.key("broadcast")
            if self.rank == src:
                cell.results[key] = (copy.deepcopy(obj), pickled_size(obj))  # as sent: the sender may change its own copy later
            obj, size = cell.results[key]
            obj = copy.deepcopy(obj)  # each receiver unpickles a copy of its own
            PROBE.received["ours"] += 0 if self.rank == src else 8 + size
        return obj

    def broadcast_tensor(self, tensor: Any, src: int) -> None:
        """Moves nothing (the balanced load's buckets); counts what rank ``src`` would send."""
        if self.rank != src:
            PROBE.received["ours"] += tensor.numel() * tensor.element_size()

    def barrier(self) -> None:
        """Nothing to wait for."""


CELL: Cell | None = None
"""The cell being simulated (read by :class:`SimDistWrapper`, which torch builds itself)."""


class SimDistWrapper(_DistWrapper):
    """DCP's collective wrapper for the rank being simulated (see the module docstring)."""

    def __init__(self, group: Any, use_dist: bool, coordinator_rank: int):
        self.cell = CELL
        self.group, self.use_dist, self.coordinator_rank, self.global_coordinator_rank = None, True, 0, 0
        self.rank = self.cell.rank
        self.is_coordinator = self.rank == 0

    def get_world_size(self) -> int:
        """N."""
        return self.cell.world_size

    def reduce_scatter(self, step: str, map_fun: Callable, reduce_fun: Callable) -> Any:
        """Map here; the coordinator reduces over every rank's result; each rank gets its share."""
        local, cell, n = map_fun(), self.cell, self.cell.world_size
        with PROBE.excluded():
            key = cell.key(f"dcp.{step}")
        if self.is_coordinator:
            with PROBE.excluded():
                if cell.phase == "save":
                    peers = [local] + [_save_plan_of(local, q, n) for q in range(1, n)]
                else:
                    peers = [local] * n
                sizes = _sampled_sizes(peers) if cell.phase == "save" else [pickled_size(local)] * n
            results = reduce_fun(peers)  # the coordinator's own work: timed
            with PROBE.excluded():
                plan_sizes = _sampled_sizes(results)
                cell.results[key] = {"results": results, "made": peers[cell.sim_rank], "sizes": sizes, "plan_sizes": plan_sizes}
                PROBE.received["dcp"] += received("gather", sizes, 0)
            return results[0]
        with PROBE.excluded():
            entry = cell.results[key]
            if cell.phase == "save":
                cell.compare(f"{key}", entry["made"].items, local.items)
            PROBE.received["dcp"] += received("gather", entry["sizes"], self.rank) + received("scatter", entry["plan_sizes"], self.rank)
        return entry["results"][self.rank]

    def all_reduce(self, step: str, map_fun: Callable, reduce_fun: Callable) -> Any:
        """Map here; the coordinator reduces over every rank's result and broadcasts it."""
        local, cell, n = map_fun(), self.cell, self.cell.world_size
        with PROBE.excluded():
            key = cell.key(f"dcp.{step}")
            plans = cell.results[(cell.phase, "dcp.plan", key[2])]["results"]
        if self.is_coordinator:
            with PROBE.excluded():
                peers = [local] + [self._peer_write(plans[q], q) for q in range(1, n)]
                sizes = _sampled_sizes(peers)
            result = reduce_fun(peers)  # finish_checkpoint: .metadata, written by the coordinator
            with PROBE.excluded():
                cell.results[key] = (result, pickled_size(result), sizes)
                PROBE.received["dcp"] += received("gather", sizes, 0)
            return result
        with PROBE.excluded():
            result, size, sizes = cell.results[key]
            PROBE.received["dcp"] += received("gather", sizes, self.rank) + 8 + size
        return result

    def _peer_write(self, plan: Any, q: int) -> list[Any]:
        """Rank q's write results: its data file made as rank q's writer would make it."""
        name = f"{plan.storage_data.prefix}0{sparse.dcp_fs.DEFAULT_SUFFIX}"
        records: dict[Path, FileRecord] = {}
        results = sparse.dcp_file(_Records(records), self.cell.dcp_target / name, plan.items)
        self.cell.dcp_peer_records[q] = list(records.values())
        return results

    def all_gather(self, step: str, map_fun: Callable) -> list[Any]:
        """Map here; every rank's result (alike: the load's read step returns nothing)."""
        local = map_fun()
        with PROBE.excluded():
            self.cell.key(f"dcp.{step}")
            PROBE.received["dcp"] += received("all_gather", [pickled_size(local)] * self.cell.world_size, self.rank)
        return [local] * self.cell.world_size

    def broadcast(self, step: str, map_fun: Callable) -> Any:
        """The coordinator's result (computed on rank 0, simulated first)."""
        cell = self.cell
        with PROBE.excluded():
            key = cell.key(f"dcp.{step}")
        if self.is_coordinator:
            result = map_fun()
            with PROBE.excluded():
                cell.results[key] = (result, pickled_size(result))
            return result
        with PROBE.excluded():
            result, size = cell.results[key]
            PROBE.received["dcp"] += 8 + size
        return result

    def broadcast_tensor(self, tensor: Any, src: int) -> None:
        """Moves nothing (the balanced load's buckets); counts what rank ``src`` would send."""
        if self.rank != src:
            PROBE.received["ours"] += tensor.numel() * tensor.element_size()

    def barrier(self) -> None:
        """Nothing to wait for."""


@dataclasses.dataclass
class _Records:
    records: dict[Path, FileRecord]


def _save_plan_of(plan: Any, q: int, world_size: int) -> Any:
    """Rank q's DCP save plan, from rank 0's: every ``DTensor`` chunk moved to rank q's block (the
    items built directly: ``dataclasses.replace`` is several times slower at a million items)."""
    items = []
    for item in plan.items:
        if item.type == WriteItemType.SHARD:
            data = item.tensor_data
            shape, offsets = local_block(tuple(data.size), q, world_size)
            offsets, shape = torch.Size(offsets), torch.Size(shape)
            chunk = ChunkStorageMetadata(offsets=offsets, sizes=shape)
            data = TensorWriteData(chunk=chunk, properties=data.properties, size=data.size)
            item = WriteItem(index=MetadataIndex(item.index.fqn, offsets), type=item.type, tensor_data=data)
        items.append(item)
    return dataclasses.replace(plan, items=items)


def _sampled_sizes(objs: list[Any]) -> list[int]:
    """Pickled sizes of DCP's per-rank plans and results, from ranks 0, 1, N/2 and N-1 (pickling a
    million items per rank costs more than the simulation itself): the other ranks' payloads
    differ from these only in the digits of their offsets, and torch pads to the largest anyway."""
    n = len(objs)
    sample = {q: pickled_size(objs[q]) for q in {0, min(1, n - 1), n // 2, n - 1}}
    others = max(size for q, size in sample.items() if q != 0) if n > 1 else sample[0]
    return [sample.get(q, others) for q in range(n)]


def install_dcp_wrapper() -> Callable[[], None]:
    """Make DCP's saver and loader build :class:`SimDistWrapper`; returns the undo."""
    saved = state_dict_saver._DistWrapper, state_dict_loader._DistWrapper
    state_dict_saver._DistWrapper = state_dict_loader._DistWrapper = SimDistWrapper

    def undo() -> None:
        state_dict_saver._DistWrapper, state_dict_loader._DistWrapper = saved

    return undo
