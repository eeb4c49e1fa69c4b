"""Sharded optimizer state (the ``DTensor`` moments of FSDP2, TP, 2-D meshes) as per-rank
safetensors pieces, written and read as the model's sharded weights are
(:mod:`~resilience.checkpoint.formats.shard_files`), not through DCP::

    optim/shard-0000K-model-00001-of-00001.safetensors   rank K-1's pieces (DCP_SHARDING_INFO offsets)
    optim/skeleton.json   the structure; "storage": "sharded_safetensors"; "index": the pieces'
                          shard_index document (per tensor its sharding rule: O(tensors) bytes)

The plan (:func:`~resilience.checkpoint.formats.pieces.make_plan`: each rank alone from the
sharding rules, a gather only for state without one) is made when the state is captured, on the
training thread, and reused while the layout is unchanged (a
:class:`~resilience.checkpoint.formats.plan_cache.LayoutCache`); each rank then writes its own
blocks, a replicated tensor (the step counters) once. Loading reads, for each state tensor this
rank holds, only the stored pieces overlapping its block, so it reshards across world sizes and
meshes as DCP did. Checkpoints whose optimizer went through DCP (``optim/.metadata``) still load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from resilience.checkpoint.formats import shard_files
from resilience.checkpoint.formats.plan_cache import LayoutCache
from resilience.checkpoint.formats.sharded_model import layout_of
from resilience.checkpoint.layout import OPTIM_DIR
from resilience.checkpoint.storage.content_check import ContentCheck
from resilience.checkpoint.storage.durable import FileRecord

STORAGE = "sharded_safetensors"  # skeleton.json's "storage" for these files
PLAN = "_plan"  # the skeleton's Plan between capture and write; never written


def capture(tensors: dict[str, torch.Tensor], skeleton: dict[str, Any], *, rank: int, world_size: int, gather: Any, cache: LayoutCache | None = None) -> None:
    """Mark ``skeleton`` as this storage and attach the plan of ``tensors`` (made now: a
    collective through ``gather`` only for state without a sharding rule, none on a cache hit).

    Raises:
        ValueError: the pieces do not tile a tensor (see :func:`pieces.make_plan`).
    """
    cache = cache if cache is not None else LayoutCache(enabled=False)
    plan = cache.plan(tensors, rank=rank, world_size=world_size, gather=gather, aliases={})
    skeleton["storage"] = STORAGE
    skeleton[PLAN] = plan
    skeleton["index"] = cache.index(plan) or cache.keep_index(plan, shard_files.index_doc(plan, dict.fromkeys(plan.tensors, 1), 1, {}, {}, []))


def save(staging: Path, tensors: dict[str, torch.Tensor], skeleton: dict[str, Any], rank: int) -> list[FileRecord]:
    """Write the pieces ``rank`` owns of ``tensors`` under ``staging/optim/``; returns their
    records (digested and fsync'd while written). Raises ``OSError`` from the writes."""
    (staging / OPTIM_DIR).mkdir(parents=True, exist_ok=True)
    return shard_files.write_pieces(staging / OPTIM_DIR, tensors, skeleton[PLAN], skeleton["index"], rank)  # paths under optim/


def json_view(skeleton: dict[str, Any]) -> dict[str, Any]:
    """``skeleton`` without the in-memory plan (what ``skeleton.json`` holds)."""
    return {key: value for key, value in skeleton.items() if key != PLAN}


def load(directory: Path, skeleton: dict[str, Any], tensors: dict[str, torch.Tensor], check: ContentCheck | None = None) -> None:
    """Fill ``tensors`` (the load targets, ``DTensor`` where the parameter is one) in place from
    the pieces under ``directory/optim/`` that overlap each one's block on this rank; a file read
    whole (a load at the saver's layout) is digested as it passes when in ``check``'s share.

    Raises:
        ValueError: keys or shapes differ from the saved ones, or the pieces do not cover a block.
    """
    shard_files.load_by_slices(directory / OPTIM_DIR, layout_of(skeleton["index"]), tensors, {}, check)
