"""The run's distributed context: rank, world size, and one dedicated gloo group.

All of our own collectives (stop agreement, checkpoint success/failure, file lists) go over a
gloo group of their own, so they work when training uses NCCL and never interleave with the
training's collectives on the default group. Without an initialised default process group the
context is local (rank 0 of 1) and every collective is the identity.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
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
        """Every rank's ``obj``, indexed by rank (small, picklable objects only; save path only)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_or_raise(self, error: str | None, payload: Any = None, *, fail: Callable[[str], BaseException]) -> list[Any]:
        """Every rank's ``payload``, indexed by rank, or the same exception on every rank.

        One all-gather of ``(payload, error)`` (a collective: every rank calls it, failed or not).
        When any rank's ``error`` is set (a one-line description of its failure), every rank raises
        ``fail(detail)``, ``detail`` being ``"rank R: error"`` of each failed rank joined by ``"; "``;
        so a failure seen by one rank stops all of them at the same point.
        """
        gathered = self.all_gather_object((payload, error))
        failed = [f"rank {rank}: {err}" for rank, (_, err) in enumerate(gathered) if err]
        if failed:
            raise fail("; ".join(failed))
        return [item for item, _ in gathered]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

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
