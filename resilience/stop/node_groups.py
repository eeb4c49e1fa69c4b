"""Node-local and node-leader gloo groups: the stop agreement's MAX in two short rings, not one long one.

Gloo's all-reduce is a ring of ``2(N - 1)`` sequential hops, so one over every rank grows with the
job (16,382 hops at 8,192 ranks). :class:`NodeGroups` does the same MAX in three steps on smaller
groups: an all-reduce within the node (``L`` ranks), an all-reduce among the node leaders (one
rank per node, ``M = N / L``), and a broadcast from the leader back within the node, about
``3(L - 1) + 2(M - 1)`` hops (2,067 at 8,192 ranks, 8 per node).

Which node a rank is on comes from the launcher's environment (:func:`node_key`) and is
exchanged once with one all-gather, so ranks need not be numbered node by node (Slurm's cyclic
distribution). Every rank makes the same ``dist.new_group`` calls in the same order (each node's
group, then the leaders'), as torch requires; a call for a group the rank is not in is local
and cheap (no store traffic). Groups named from a hash of their ranks
(``use_local_synchronization``) would spare those calls but reuse a name, and its stale store
keys, when an agreement is made a second time. Gloo connects a group's members when it is made
(``TORCH_GLOO_LAZY_INIT=1``: at its first collective).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from resilience.env_names import SLURM, TORCH

UNKNOWN = -1


def node_key(env: Mapping[str, str]) -> int:
    """This rank's node index from the launcher's environment, or :data:`UNKNOWN` (-1).

    ``GROUP_RANK`` (torchrun, ``resilience run``) first, then ``SLURM_NODEID`` (srun); a value
    that is not an integer >= 0 counts as unknown.
    """
    for name in (TORCH["group_rank"], *SLURM["node_id"]):
        text = env.get(name, "").strip()
        if text.isdigit():
            return int(text)
    return UNKNOWN


def node_plan(keys: Sequence[int]) -> list[list[int]] | None:
    """The ranks of each node (``keys[r]`` is rank r's node), nodes ordered by their lowest rank.

    Returns ``None`` when one flat ring is as good or the layout is not known: a rank's key is
    :data:`UNKNOWN`, all ranks are on one node, or every node holds a single rank.
    """
    if not keys or UNKNOWN in keys:
        return None
    nodes: dict[int, list[int]] = {}
    for rank, key in enumerate(keys):
        nodes.setdefault(key, []).append(rank)
    if len(nodes) < 2 or len(nodes) == len(keys):
        return None
    return list(nodes.values())


def ring_hops(world: int, per_node: int | None = None) -> int:
    """Sequential hops of one MAX over ``world`` ranks: the flat ring's ``2(N - 1)`` (``per_node``
    None), or :class:`NodeGroups`' ``3(L - 1) + 2(M - 1)`` with ``L = per_node`` ranks per node and
    ``M = ceil(N / L)`` nodes (the broadcast counted as ``L - 1`` sends from the leader, an upper bound)."""
    if per_node is None or per_node >= world:
        return 2 * (world - 1)
    nodes = -(-world // per_node)
    return 3 * (per_node - 1) + 2 * (nodes - 1)


class NodeGroups:
    """This rank's node group and, on a node's leader (its lowest rank), the leaders' group.

    :meth:`start` runs one MAX over all ranks on a worker thread (the three steps must run in
    order, each waiting for the last) and returns its :class:`~concurrent.futures.Future`; calls
    run in the order they were made, so every rank issues the same collectives in the same order.
    A dead peer fails the round after the groups' timeout (``RuntimeError`` from the future).

    Create with :meth:`build` on every rank at the same point (it is collective).
    """

    def __init__(self, plan: list[list[int]], rank: int, timeout: datetime.timedelta | None) -> None:
        members = next(ranks for ranks in plan if rank in ranks)
        self.nodes = len(plan)
        self.per_node = max(len(ranks) for ranks in plan)
        self.leader = members[0]
        for ranks in plan:  # every rank, every group, in one order; a non-member gets a placeholder
            group = dist.new_group(ranks, backend="gloo", timeout=timeout)
            if ranks is members:
                self._node = group
        leaders = dist.new_group([ranks[0] for ranks in plan], backend="gloo", timeout=timeout)
        self._leaders = leaders if rank == self.leader else None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stop-agreement")

    @classmethod
    def build(cls, keys: Sequence[int], rank: int, timeout_s: float | None) -> NodeGroups | None:
        """Groups for the node layout ``keys`` (every rank's :func:`node_key`, the same list on
        every rank), or ``None`` when :func:`node_plan` finds a flat ring as good."""
        plan = node_plan(keys)
        if plan is None:
            return None
        return cls(plan, rank, datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None)

    def start(self, tensor: torch.Tensor) -> Future:
        """Begin ``tensor = MAX over all ranks`` (in place); the future's result is ``None``."""
        return self._thread.submit(self._max, tensor)

    def _max(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._node)
        if self._leaders is not None:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._leaders)
        dist.broadcast(tensor, src=self.leader, group=self._node)

    def close(self) -> None:
        """Wait for the rounds queued, stop the thread, destroy the groups (idempotent)."""
        self._thread.shutdown(wait=True)
        groups, self._node, self._leaders = [self._node, self._leaders], None, None
        for group in groups:
            if group is not None and dist.is_initialized():
                try:
                    dist.destroy_process_group(group)
                except (RuntimeError, ValueError):
                    pass  # already gone with the default group
