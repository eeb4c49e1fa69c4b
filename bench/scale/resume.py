"""One resume as one simulated rank runs it, through the library's own resume path.

``Resuming.restore``'s sequence without the ``Checkpointer``: rank 0 removes leftovers, then
:func:`~resilience.checkpoint.reader.find_resume_point` (rank 0 chooses and checks the manifest;
every rank receives it and checks the sizes of its 1/N of the files), then, as ``Resuming.load`` does,
:func:`~resilience.checkpoint.loading.inline_files`,
:func:`~resilience.checkpoint.reader.checking_while_loading` (its digest share planned for real;
the digests accounted by :class:`~bench.scale.sparse.AccountingCheck`) around
:func:`~resilience.checkpoint.loading.load_state` (the model's index and shards, the optimizer's
skeleton and files or DCP's ``.metadata`` and load plan, the counters, this rank's data position),
then this rank's RNG (its rank state file). A DDP state is loaded balanced (``checkpoint.load_balanced``, the
default): ``streamed_bytes`` is the size of the files every rank loads a 1/N of from storage.

``reader._share`` (the digest share: ``balance`` over every file and every rank) is capped at
``cap_s`` seconds: past it, its time is recorded as a lower bound and :func:`fast_share` (the same
assignment with a heap) gives the share so the resume goes on.
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import Any

from bench.scale.probe import PROBE
from bench.scale.sim import Cell, SimContext
from resilience.checkpoint import loading, reader
from resilience.checkpoint.formats import balanced_load
from resilience.checkpoint.resume import Resuming
from resilience.checkpoint.resume_choice import remove_leftovers
from resilience.config import CheckpointConfig
from resilience.state.training_state import TrainingState


def fast_balance(sizes: dict[str, int], ranks: int) -> dict[str, int]:
    """``resilience.checkpoint.balance.balance`` with a heap: the same owners (largest first, each to
    the least loaded rank, ties to the lowest rank), in O(items log ranks)."""
    heap = [(0, rank) for rank in range(ranks)]
    owner = {}
    keys = list(sizes)
    for i in sorted(range(len(keys)), key=lambda i: (-sizes[keys[i]], i)):
        load, rank = heapq.heappop(heap)
        owner[keys[i]] = rank
        heapq.heappush(heap, (load + sizes[keys[i]], rank))
    return owner


def fast_share(files: dict[str, Any], rank: int, world_size: int) -> list[str]:
    """``reader._share`` through :func:`fast_balance`."""
    owner = fast_balance({rel: int(files[rel].get("size", 0)) for rel in sorted(files)}, world_size)
    return sorted(rel for rel, r in owner.items() if r == rank)


def simulate_resume(cell: Cell, rank: int, state: TrainingState, root: Path) -> dict[str, Any]:
    """Rank ``rank``'s resume (rank 0 first: it chooses); returns its measurements."""
    PROBE.reset()
    cell.begin(rank, "resume")
    ctx = SimContext(cell)
    config = CheckpointConfig(checkpoint_dir=str(root))
    out: dict[str, Any] = {}
    with PROBE.measure() as out["choose"]:
        if rank == 0:
            remove_leftovers(root)
        found, manifest = reader.find_resume_point(ctx, root, None, checksums=False)
    if found is None:
        raise RuntimeError(f"the scale bench's checkpoint under {root} was not found valid")
    with PROBE.measure() as out["load"]:
        inline = loading.inline_files(manifest, state, weights_only=False)
        balanced = loading.balanced_loading(config, ctx)
        with reader.checking_while_loading(ctx, found, manifest, inline=inline, balanced=balanced) as check:
            restored = loading.load_state(found, manifest, state, ctx, config, weights_only=False, check=check)
        Resuming.restore_rng(restored)
    out["files"] = len(manifest["files"])
    streams = balanced_load.streams(inline).values() if balanced else []
    out["streamed_bytes"] = sum(int(manifest["files"][rel]["size"]) for stream in streams for rel in stream)
    out["functions"] = dict(PROBE.functions)
    out["lower_bounds"] = dict(PROBE.lower_bounds)
    out["received"] = dict(PROBE.received)
    out["read"] = dict(PROBE.read)
    return out
