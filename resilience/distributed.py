"""The run's distributed context: rank, world size, and one dedicated gloo group.

All of our own collectives (stop agreement, checkpoint success/failure, file lists) live here
(each method's docstring says what each rank receives) and go over a gloo group of their own, so
they work when training uses NCCL and never interleave with the training's collectives on the
default group. Without an initialised default process group the
context is local (rank 0 of 1) and every collective is the identity.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from resilience.env_names import COLLECTIVE_TIMEOUT_ENV


def collective_timeout_s(default_s: float, env: Mapping[str, str] | None = None) -> float:
    """Seconds bounding each collective on the library's own gloo groups (the stop agreement, the
    checkpoint's gathers): ``RESILIENCE_COLLECTIVE_TIMEOUT_S`` when set (``resilience run`` derives
    it from its progress timeout), else ``default_s`` (the loop passes ``checkpoint.async_timeout_s``);
    never torch's 30 minutes, so a rank whose peer is gone fails instead of waiting that long.

    Raises ``ValueError`` naming the variable when it is set but not a number of seconds > 0.
    """
    env = os.environ if env is None else env
    raw = env.get(COLLECTIVE_TIMEOUT_ENV)
    if not raw:
        return float(default_s)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{COLLECTIVE_TIMEOUT_ENV}: expected a number of seconds > 0, got {raw!r}")
    return seconds


@dataclasses.dataclass
class DistContext:
    """Rank, world size and our gloo group (``None`` when local)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None
    owned: bool = False
    """True when :meth:`from_env` created ``group`` (then :meth:`close` destroys it)."""

    @classmethod
    def from_env(cls, *, timeout_s: float | None = None) -> DistContext:
        """Describe the current process. When torch.distributed is initialised this creates a new
        gloo group, which is a collective: every rank must call it, in the same order.
        ``timeout_s`` bounds each collective on it (default: torch's, 30 minutes)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
        group = dist.new_group(backend="gloo", timeout=timeout)
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), group=group, owned=True)

    def close(self) -> None:
        """Destroy the group :meth:`from_env` created (a local operation; idempotent). Gloo groups
        left alive until interpreter exit can abort the process while their threads unwind."""
        if self.owned and self.group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(self.group)
            except (RuntimeError, ValueError):
                pass  # already gone with the default group
        self.group = None
        self.owned = False

    @property
    def distributed(self) -> bool:
        """True when there is more than one rank."""
        return self.group is not None and self.world_size > 1

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, indexed by rank, on every rank (small, picklable objects only; each
        rank receives N payloads padded to the largest: use :meth:`gather_to_root` when only rank
        0 needs them)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def max_over_ranks(self, values: list[int]) -> list[int]:
        """The element-wise maximum of ``values`` (ints, the same length on every rank) over every
        rank, on every rank: one all-reduce of ``len(values)`` int64s."""
        if not self.distributed:
            return list(values)
        flags = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in flags.tolist()]

    def gather_to_root(self, obj: Any, *, largest: int | None = None) -> list[Any] | None:
        """Every rank's ``obj`` (picklable), indexed by rank, on rank 0; ``None`` on the other ranks.

        One gather to rank 0 of the pickled objects padded to the largest (``largest``: its size in
        bytes when the caller has agreed on it already, else one :meth:`max_over_ranks` first):
        rank 0 receives N payloads, every other rank nothing.
        """
        data = pickle.dumps(obj)
        if not self.distributed:
            return [obj]
        if largest is None:
            (largest,) = self.max_over_ranks([len(data)])
        buffer = torch.zeros(largest, dtype=torch.uint8)
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        inbox = [torch.empty(largest, dtype=torch.uint8) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(buffer, inbox, group=self.group, group_dst=0)
        if inbox is None:
            return None
        # peers' bytes over our own group, unpickled as torch's object collectives do; never a file's
        return [pickle.loads(item.numpy().tobytes()) for item in inbox]  # pickle ignores the padding

    def gather_to_leaders(self, obj: Any, block: int) -> list[Any] | None:
        """The ranks in blocks of ``block`` consecutive ranks: on each block's first rank (its
        leader), every member's ``obj`` (picklable) in rank order; ``None`` on the others.

        Point-to-point over our gloo group (a length, then the pickled bytes), no subgroup: each
        rank sends once or its leader receives ``block - 1`` times, so no rank's work or bytes
        grow with the world size (a gather to rank 0 receives N payloads).
        """
        if not self.distributed:
            return [obj]
        leader = self.rank - self.rank % block
        if self.rank != leader:
            data = pickle.dumps(obj)
            dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=leader, group=self.group)
            dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=leader, group=self.group)
            return None
        out = [obj]
        for peer in range(leader + 1, min(leader + block, self.world_size)):
            size = torch.empty(1, dtype=torch.int64)
            dist.recv(size, src=peer, group=self.group)
            received = torch.empty(int(size), dtype=torch.uint8)
            dist.recv(received, src=peer, group=self.group)
            # peers' bytes over our own group, unpickled as torch's object collectives do; never a file's
            out.append(pickle.loads(received.numpy().tobytes()))
        return out

    def gather_or_raise(self, error: str | None, payload: Any = None, *, fail: Callable[[str], BaseException]) -> list[Any]:
        """Every rank's ``payload``, indexed by rank, on every rank, or the same exception on every rank.

        A collective (every rank calls it, failed or not): one all-reduce of two flags (did any
        rank fail? did any give a payload?). When any rank's ``error`` is set (a one-line
        description of its failure), the errors are all-gathered and every rank raises
        ``fail(detail)``, ``detail`` being ``"rank R: error"`` of each failed rank joined by ``"; "``;
        so a failure seen by one rank stops all of them at the same point. Otherwise the payloads
        are all-gathered only when some rank gave one: a healthy verdict moves 16 bytes per rank.
        """
        failed, given = self.max_over_ranks([int(bool(error)), int(payload is not None)])
        if failed:
            self._raise_failed(error, fail)
        if not given:
            return [None] * (self.world_size if self.distributed else 1)
        return self.all_gather_object(payload)

    def gather_to_root_or_raise(self, error: str | None, payload: Any, *, fail: Callable[[str], BaseException]) -> list[Any] | None:
        """Rank 0: every rank's ``payload``, indexed by rank; other ranks: ``None``; or the same
        exception on every rank (``fail`` as in :meth:`gather_or_raise`).

        One all-reduce of (failed anywhere?, largest pickled payload), then either the errors
        all-gathered and raised everywhere, or one :meth:`gather_to_root` of the payloads: no rank
        but 0 receives any rank's payload.
        """
        size = len(pickle.dumps(payload))
        failed, largest = self.max_over_ranks([int(bool(error)), size])
        if failed:
            self._raise_failed(error, fail)
        return self.gather_to_root(payload, largest=largest)

    def verdict_from_root(self, error: str | None, share: Any = None, *, fail: Callable[[str], BaseException]) -> Any:
        """Rank 0's ``share`` on every rank (``None`` from rank 0: nothing sent), or the same
        exception on every rank when any rank's ``error`` is set (``fail`` as in :meth:`gather_or_raise`).

        One all-reduce of (failed anywhere?, rank 0 has a share?), then the errors all-gathered on
        failure, else rank 0's share broadcast when it has one: a healthy verdict without a share
        moves 16 bytes per rank; with one, that share (it must not grow with N).
        """
        failed, shared = self.max_over_ranks([int(bool(error)), int(self.rank == 0 and share is not None)])
        if failed:
            self._raise_failed(error, fail)
        return self.broadcast_object(share if self.rank == 0 else None) if shared else None

    def _raise_failed(self, error: str | None, fail: Callable[[str], BaseException]) -> None:
        """Every rank: all-gather the errors (some rank failed) and raise ``fail(detail)``."""
        errors = self.all_gather_object(error)
        raise fail("; ".join(f"rank {rank}: {err}" for rank, err in enumerate(errors) if err))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def broadcast_tensor(self, tensor: Any, src: int) -> None:
        """Overwrite ``tensor`` (a CPU tensor of the same shape and dtype on every rank) with rank
        ``src``'s, in place, over our gloo group."""
        if self.distributed:
            dist.broadcast(tensor, src=src, group=self.group)

    def same_everywhere(self, fingerprint: str) -> bool:
        """Whether every rank passed the same ``fingerprint`` (a hex digest): one all-reduce (MAX)
        of two int64s (its first 60 bits and their negation), not a gather of every rank's."""
        if not self.distributed:
            return True
        value = int(fingerprint[:15], 16)
        box = torch.tensor([value, -value], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.group)
        return int(box[0]) == value and int(box[1]) == -value

    def barrier(self) -> None:
        """Wait for every rank on our gloo group."""
        if self.distributed:
            dist.barrier(group=self.group)
