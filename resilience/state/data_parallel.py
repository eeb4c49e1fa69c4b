"""Which ranks share a data-parallel replica (train on the same batches), for the global batch and the data position.

A rank's replica, in this order:

1. what ``resilient_loop(data_parallel=(dp_rank, dp_size))`` states;
2. the loader's ``DistributedSampler`` (its ``rank`` and ``num_replicas``, on the loader's sampler or
   batch sampler): ranks whose samplers have the same ``rank`` draw the same samples;
3. the rank itself (every rank its own replica) when the model holds no ``DTensor``, or only
   FSDP2's own layouts over all ranks (``fully_shard``: ``Shard`` on a 1-D mesh; HSDP:
   ``(Replicate, Shard)`` on a 2-D one).

Otherwise (a tensor-parallel ``DTensor``, FSDP2 over a tensor-parallel one, a mesh over part of the
ranks) the ranks of a non-data-parallel mesh dimension may see the same batches and nothing says
which: :func:`data_parallel_layout` refuses rather than guess. A tensor-parallel x2 run with one
replica counts its batch once, not twice; summed over its two ranks, a resume under FSDP2 x2 would
skip half an epoch.

A stated or sampler-given layout is checked against the model: the ranks holding different shards
of one ``DTensor`` parameter (not FSDP2's) along a mesh dimension train on the same batches, so
they must be one replica, or the global batch would count them twice and a resume skip samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeGuard

import torch

from resilience.config.checks import ConfigError
from resilience.distributed import DistContext
from resilience.sharded_types import is_dtensor, loaded_class
from resilience.torch_private import placement_classes

KEY = "data_parallel"
HOW = (
    "state it: resilient_loop(..., data_parallel=(dp_rank, dp_size)), this rank's index among the data-parallel "
    "replicas and their number (with a device mesh: (mesh['dp'].get_local_rank(), mesh['dp'].size())), or give the "
    "loader a DistributedSampler(num_replicas=dp_size, rank=dp_rank)"
)


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """A run's data-parallel layout: ``replicas[r]`` is global rank r's replica (0 .. size - 1)."""

    replicas: tuple[int, ...]

    @property
    def size(self) -> int:
        """The number of data-parallel replicas."""
        return len(set(self.replicas))


def data_parallel_layout(loader: Any, model: torch.nn.Module, ctx: DistContext, stated: Any = None) -> DataParallel:
    """Every rank's data-parallel replica (see the module doc); a collective (one all-gather).

    Args:
        loader: the run's dataloader.
        model: the module being trained.
        ctx: the run's ranks.
        stated: ``resilient_loop()``'s ``data_parallel``: ``(dp_rank, dp_size)`` or ``None``.

    Raises:
        ConfigError: on every rank alike: ``stated`` is not two ints with ``0 <= dp_rank < dp_size``,
            it disagrees with the loader's ``DistributedSampler``, the ranks' sizes differ or leave a
            replica without a rank, the replica cannot be known (the message says how to state it), or
            ranks that hold different shards of one ``DTensor`` parameter (:func:`sharded_rank_groups`:
            tensor parallel, outside FSDP2) are in different replicas (their batches would count twice).
    """
    own, error = _own_replica(loader, model, ctx, stated)
    groups = sharded_rank_groups(model) if ctx.world_size > 1 else {}
    gathered = ctx.gather_or_raise(error, (own, groups), fail=lambda detail: ConfigError(f"{KEY}: {detail}; {HOW}"))
    sizes = [size for (_, size), _ in gathered]
    replicas = tuple(replica for (replica, _), _ in gathered)
    if len(set(sizes)) > 1:
        raise ConfigError(f"{KEY}: the ranks give different data-parallel sizes (rank -> size: {dict(enumerate(sizes))}); {HOW}")
    missing = sorted(set(range(sizes[0])) - set(replicas))
    if missing:
        raise ConfigError(
            f"{KEY}: a data-parallel size of {sizes[0]} but no rank holds replica(s) {missing} (rank -> replica: "
            f"{dict(enumerate(replicas))}): their samples would never be trained; {HOW}"
        )
    for _, rank_groups in gathered:  # every rank checks every rank's groups: one verdict everywhere
        for ranks, (name, dim) in rank_groups.items():
            stated_replicas = {r: replicas[r] for r in ranks}
            if len(set(stated_replicas.values())) > 1:
                raise ConfigError(
                    f"{KEY}: parameter {name!r} is a DTensor sharded along mesh dimension {dim} over ranks {list(ranks)}, "
                    f"which must train on the same batches, but they are stated in different replicas (rank -> replica: "
                    f"{stated_replicas}); state data_parallel=(mesh['dp'].get_local_rank(), mesh['dp'].size()) "
                    "((0, 1) for tensor parallel alone) or a DistributedSampler over the data-parallel dimension only"
                )
    return DataParallel(replicas)


def sampler_replica(loader: Any) -> tuple[int, int] | None:
    """``(rank, num_replicas)`` of the loader's ``DistributedSampler`` (its sampler, batch sampler, or
    the batch sampler's sampler: the first with both as ints), else ``None``."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for obj in (getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)):
        rank, size = getattr(obj, "rank", None), getattr(obj, "num_replicas", None)
        if _is_int(rank) and _is_int(size):
            return rank, size
    return None


def non_data_parallel_parameter(model: torch.nn.Module, world_size: int) -> str | None:
    """The name of the first ``DTensor`` parameter not laid out by FSDP2 alone over all
    ``world_size`` ranks (its mesh has a dimension whose ranks may share batches), else ``None``."""
    managed = _fsdp2_managed(model)
    for name, param in model.named_parameters():
        if is_dtensor(param) and (id(param) not in managed or not _fsdp_placements(param, world_size)):
            return name
    return None


def sharded_rank_groups(model: torch.nn.Module | None) -> dict[tuple[int, ...], tuple[str, int]]:
    """The groups of global ranks that hold different shards of one ``DTensor`` parameter along a
    mesh dimension (a ``Shard`` placement), each with its first such parameter's name and that
    dimension: tensor parallel, whose ranks must share batches. Parameters of FSDP2-managed modules
    are left out (FSDP2's own ``Shard`` is data parallel, and its mesh dimensions cannot be told
    from tensor-parallel ones by public API); so is a non-``Shard`` placement (``Replicate``, ``Partial``).
    Only the groups that hold this rank: its payload in the layout's all-gather stays a few groups of
    the tensor-parallel size at any world size (all of a mesh's groups would be O(N) per rank, O(N^2) received)."""
    if model is None:
        return {}
    managed = _fsdp2_managed(model)
    groups: dict[tuple[int, ...], tuple[str, int]] = {}
    for name, param in model.named_parameters():
        if not is_dtensor(param) or id(param) in managed:
            continue
        Shard = placement_classes()[1]
        ranks, coordinate = param.device_mesh.mesh, param.device_mesh.get_coordinate()
        if coordinate is None:  # this rank is outside the parameter's mesh
            continue
        for dim, placement in enumerate(param.placements):
            if isinstance(placement, Shard) and ranks.size(dim) > 1:
                index = [slice(None) if d == dim else c for d, c in enumerate(coordinate)]
                groups.setdefault(tuple(ranks[tuple(index)].tolist()), (name, dim))
    return groups


def position_rank(saved_replicas: Sequence[int] | None, saved_world: int, layout: DataParallel, rank: int) -> int | None:
    """The saved rank whose data position ``rank`` continues: one of the replica it now belongs to
    (itself when it still does), when the checkpoint's layout had as many replicas; else ``None``
    (the epoch's order is replayed). ``saved_replicas`` ``None``: a checkpoint from before the layout
    was recorded, every rank its own replica."""
    saved = list(saved_replicas) if saved_replicas is not None else list(range(saved_world))
    if len(set(saved)) != layout.size:
        return None
    mine = layout.replicas[rank]
    if rank < len(saved) and saved[rank] == mine:
        return rank
    return next((r for r, replica in enumerate(saved) if replica == mine), None)


def _own_replica(loader: Any, model: torch.nn.Module, ctx: DistContext, stated: Any) -> tuple[tuple[int, int] | None, str | None]:
    """This rank's ``(replica, size)``, or the reason it cannot be given (a short line)."""
    if stated is not None:
        if not (isinstance(stated, (tuple, list)) and len(stated) == 2 and all(_is_int(v) for v in stated) and 0 <= stated[0] < stated[1]):
            return None, f"expected (dp_rank, dp_size), two ints with 0 <= dp_rank < dp_size, got {stated!r}"
        stated = (stated[0], stated[1])
    sampler = sampler_replica(loader)
    if stated is not None and sampler is not None and stated != sampler:
        return None, f"{stated} disagrees with the loader's DistributedSampler (rank={sampler[0]}, num_replicas={sampler[1]})"
    if stated is not None or sampler is not None:
        return stated or sampler, None
    if ctx.world_size == 1:
        return (0, 1), None
    name = non_data_parallel_parameter(model, ctx.world_size)
    if name is not None:
        return None, (
            f"which ranks train on the same batches cannot be known: parameter {name!r} is a DTensor over a mesh "
            "dimension that is not data parallel (tensor parallel: its ranks share batches), and the loader has no DistributedSampler"
        )
    return (ctx.rank, ctx.world_size), None


def _fsdp_placements(param: Any, world_size: int) -> bool:
    """FSDP2's own layout over every rank: ``Shard`` on a 1-D mesh, or HSDP's ``(Replicate, Shard)``."""
    Replicate, Shard = placement_classes()
    placements = tuple(param.placements)
    if param.device_mesh.size() != world_size:
        return False
    if len(placements) == 1:
        return isinstance(placements[0], Shard)
    return len(placements) == 2 and isinstance(placements[0], Replicate) and isinstance(placements[1], Shard)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _fsdp2_managed(model: torch.nn.Module) -> set[int]:
    """``id`` of every parameter of an FSDP2 (``fully_shard``) module; none when FSDP2 was never imported."""
    fsdp = loaded_class("torch.distributed.fsdp", "FSDPModule") or loaded_class("torch.distributed._composable.fsdp", "FSDPModule")  # torch < 2.6
    if fsdp is None:
        return set()
    return {id(p) for module in model.modules() if isinstance(module, fsdp) for p in module.parameters()}
