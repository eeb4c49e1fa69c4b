"""A small deterministic training under resilient_loop() whose DataLoader has worker processes.

Usage: worker_train.py CKPT_DIR EVENTS_DIR [dotted overrides...]

Env:
  LOADER        ``plain`` (torch's DataLoader, default) or ``stateful`` (torchdata's StatefulDataLoader)
  NUM_WORKERS   worker processes per rank (default 2)
  PERSISTENT    ``1``: ``persistent_workers=True`` (default 0)
  PAUSE_AT_STEP N: in step N's body every rank creates ``EVENTS_DIR/paused_<rank>`` and waits
                until ``EVENTS_DIR/release`` exists (at most 60 s), so a test can signal while
                every rank and its workers are known to be running.

The loader's own ``worker_init_fn`` creates ``EVENTS_DIR/worker_<rank>_<pid>`` in each worker (so a
test can check that the user's function still runs, and that no worker outlives its rank). Each
rank prints ``rank R: exit CODE, resumed from NAME, stop step S`` and exits with the loop's code.

Training: 2 ranks x 2 epochs x 10 steps (160 samples, DistributedSampler shuffle, batch 8), an
MLP under DistributedDataParallel, AdamW; ``preemption_signal: [USR1, TERM]``, agreement every step.
"""

import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ranks  # this folder's shared rank start
from resilience import resilient_loop

KEEP = []


class UserWorkerInit:
    """The user's worker_init_fn (a class, so it pickles with any start method)."""

    def __init__(self, events: str, rank: int) -> None:
        self.events, self.rank = events, rank

    def __call__(self, worker_id: int) -> None:
        Path(self.events, f"worker_{self.rank}_{os.getpid()}").touch()


def main() -> int:
    ckpt_dir, events, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    world, rank = ranks.join()
    os.makedirs(events, exist_ok=True)
    cfg = ranks.preemptible_config(ckpt_dir, overrides)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1234)
    dataset = TensorDataset(torch.randn(160, 8, generator=g), torch.randn(160, 1, generator=g))
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    kind = os.environ.get("LOADER", "plain")
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader as Loader
    else:
        Loader = DataLoader
    workers = int(os.environ.get("NUM_WORKERS", "2"))
    loader = Loader(
        dataset,
        batch_size=8,
        sampler=sampler,
        num_workers=workers,
        persistent_workers=os.environ.get("PERSISTENT") == "1" and workers > 0,
        worker_init_fn=UserWorkerInit(events, rank),
    )
    pause_at = int(os.environ.get("PAUSE_AT_STEP", "0"))

    loop = resilient_loop(cfg, model=net, optimizer=optimizer, dataloader=loader)
    with loop:
        for step in loop:
            if step.global_step == pause_at:
                ranks.pause_for_release(events, rank)
            x, y = step.batch
            loss = torch.nn.functional.mse_loss(net(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loop.log(loss=loss.item(), lr=optimizer.param_groups[0]["lr"])
    code = int(loop.exit_code)
    resumed = loop.resumed_from.name if loop.resumed_from else None
    print(f"rank {rank}: exit {code}, resumed from {resumed}, stop step {loop.stop_step}", flush=True)
    # The loader stays alive until the interpreter exits: persistent workers are then stopped by
    # multiprocessing's exit handler (a SIGTERM from their parent), the path users get.
    KEEP.append(loader)
    # DDP freed before the group is destroyed (torch 2.13 + gloo can abort at exit otherwise).
    del net, loop, loader
    gc.collect()
    if world > 1:
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
