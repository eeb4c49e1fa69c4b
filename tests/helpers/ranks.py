"""The start every rank script in this folder shares (imported by name: a script's folder is on its path)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def join() -> tuple[int, int]:
    """Join the gloo process group when ``WORLD_SIZE`` > 1 and use one CPU thread: (world size, rank)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    return world, (dist.get_rank() if world > 1 else 0)
