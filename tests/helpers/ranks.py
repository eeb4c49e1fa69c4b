"""The start and the small helpers every rank script in this folder shares (imported by name: a script's folder is on its path)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def join() -> tuple[int, int]:
    """Join the gloo process group when ``WORLD_SIZE`` > 1 and use one CPU thread: (world size, rank)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    return world, (dist.get_rank() if world > 1 else 0)


def pause_for_release(events: str, rank: int, timeout_s: float = 60.0) -> None:
    """Create ``EVENTS/paused_<rank>`` and wait until ``EVENTS/release`` exists, so a test can signal
    while every rank is known to be in this step. Raises RuntimeError after ``timeout_s`` seconds."""
    Path(events, f"paused_{rank}").touch()
    deadline = time.monotonic() + timeout_s
    while not Path(events, "release").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: never released")
        time.sleep(0.01)


def preemptible_config(ckpt_dir: str, overrides: list[str]):
    """The configuration of the 2-epoch helpers that a test preempts: no periodic save, stop on
    USR1 or TERM, agreement every step; then ``overrides`` (dotted)."""
    from resilience import load_config

    return load_config(
        None,
        [
            f"checkpoint.checkpoint_dir={ckpt_dir}",
            "step_scheduler.num_epochs=2",
            "step_scheduler.ckpt_every_steps=100",
            "step_scheduler.preemption_signal=[USR1, TERM]",
            "step_scheduler.agreement_every_steps=1",
            *overrides,
        ],
    )


def leave(world: int) -> None:
    """Destroy the process group after the caller dropped its DDP module (collected here first):
    either left alive at interpreter exit can abort the process with SIGABRT (torch 2.13 + gloo)."""
    import gc

    gc.collect()
    if world > 1:
        dist.destroy_process_group()
