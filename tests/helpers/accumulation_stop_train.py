"""Gradient accumulation and the stop step: a rank signals itself in micro-batch M of optimizer step S.

Usage: accumulation_stop_train.py OUT_DIR (1 or 2 ranks, under a launcher).

Runs :func:`stop_after_signal` once per case, one after the other in this process: every
micro-batch position M of step :data:`SIGNAL_STEP` (3 micro-batches per step), without and
with a periodic save at that step. Each rank appends one JSON line per case to
``OUT_DIR/rank_<R>.jsonl``. Only the last rank is signalled, so with 2 ranks the stop reaches
rank 0 through the agreement alone.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

from resilience import resilient_loop
from resilience.checkpoint.storage.manifest import validate

SIGNAL_STEP = 2
ACCUMULATION = 3
CASES = [(every, position) for every in (None, SIGNAL_STEP) for position in range(ACCUMULATION)]
"""(``ckpt_every_steps``, micro-batch position of the signal) of every run :func:`main` makes."""


def stop_after_signal(ckpt_dir: Path, position: int, *, every: int | None, signalled: bool) -> dict:
    """Train Linear(4, 1) on 12 micro-batches (4 optimizer steps of 3) until the loop ends; when
    ``signalled``, send this process SIGUSR1 in micro-batch ``position`` of step ``SIGNAL_STEP``.
    Returns the loop's stop step and exit code, and LATEST's step, reason and data position."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    net = torch.nn.parallel.DistributedDataParallel(model) if torch.distributed.is_initialized() else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(4 * ACCUMULATION)]
    config = {
        "step_scheduler": {
            "num_epochs": 1,
            "gradient_accumulation_steps": ACCUMULATION,
            "ckpt_every_steps": every,
            "preemption_signal": "USR1",
            "agreement_every_steps": 1,
        },
        "checkpoint": {"checkpoint_dir": str(ckpt_dir)},
    }
    loop = resilient_loop(config, model=net, optimizer=optimizer, dataloader=data)
    with loop:
        for step in loop:
            if step.micro_step == 0:
                optimizer.zero_grad()
            if signalled and (step.global_step, step.micro_step) == (SIGNAL_STEP, position):
                os.kill(os.getpid(), signal.SIGUSR1)
            x, y = step.batch
            torch.nn.functional.mse_loss(net(x), y).backward()
            if step.is_optimizer_step:
                optimizer.step()
    meta = validate(ckpt_dir / os.readlink(ckpt_dir / "LATEST"))["meta"]
    counters = json.loads((ckpt_dir / "LATEST" / "step_scheduler.json").read_text())
    return {
        "stop_step": loop.stop_step,
        "exit_code": int(loop.exit_code),
        "latest": [meta["global_step"], meta["reason"]],
        "batches_in_epoch": counters["batches_in_epoch"],
    }


def main() -> None:
    import ranks  # this folder's shared rank start (the script's folder is on its path)

    out = Path(sys.argv[1])
    world, rank = ranks.join()
    with open(out / f"rank_{rank}.jsonl", "a") as results:
        for every, position in CASES:
            ckpt = out / f"every{every}_pos{position}"
            row = stop_after_signal(ckpt, position, every=every, signalled=rank == world - 1)
            results.write(json.dumps({"every": every, "position": position, **row}) + "\n")
            results.flush()
    # resilient_loop() frees each DDP reducer, then the process group, at exit (resilience.teardown)


if __name__ == "__main__":
    main()
