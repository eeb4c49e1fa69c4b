"""A DDP model + Adam under resilient_loop() that records what its resume read and loaded.

Usage: balanced_train.py CKPT_DIR OUT_DIR [dotted overrides...]

Trains ``step_scheduler.max_steps`` steps of a 4-layer MLP (~1 MB of fp32 weights, Adam's
moments twice that) on random batches. At the end of a run each rank writes
``OUT_DIR/end.rank<R>.pt`` (model and optimizer state); a run that resumes also writes
``OUT_DIR/loaded.rank<R>.pt`` (the state right after the load) and ``OUT_DIR/read.rank<R>.json``
(``{"rchar": bytes}``: what ``Resuming.load`` read through read()/pread() in this process, its
digest thread included, from ``/proc/self/io``; gloo's traffic does not count there). Env
``OLD_OPTIM_FILES=1``: every rank writes its optimizer file, empty or not, as releases before
the no-empty-files change did; ``SMALL=1``: one bias-free layer instead; ``MISMATCH_RANK=R``: rank R's
layer has other shapes, and no DDP (the error resilient_loop() raises goes to ``OUT_DIR/error.rank<R>``). Exits with ``loop.exit_code``.
"""

import json
import os
import sys

import torch

import ranks  # this folder's shared rank start
from resilience import load_config, resilient_loop
from resilience.checkpoint import resume
from resilience.checkpoint.formats import optim_files
from resilience.checkpoint.layout import optim_shard_name

ckpt_dir, out_dir, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
world, rank = ranks.join()


def rchar() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar"))


def snapshot(model, optimizer) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": optimizer.state_dict()}


original_load = resume.Resuming.load


def measured_load(self, directory, state):
    before = rchar()
    restored = original_load(self, directory, state)
    read = rchar() - before
    with open(os.path.join(out_dir, f"read.rank{rank}.json"), "w") as fh:
        json.dump({"rchar": read}, fh)
    torch.save(snapshot(getattr(state.model, "module", state.model), state.optimizer), os.path.join(out_dir, f"loaded.rank{rank}.pt"))
    return restored


resume.Resuming.load = measured_load
if os.environ.get("OLD_OPTIM_FILES"):
    original_assign = optim_files.assign

    def assign_every_rank(tensors, skeleton, world_size):
        original_assign(tensors, skeleton, world_size)
        skeleton["files"] = [optim_shard_name(r + 1, world_size) for r in range(world_size)]

    optim_files.assign = assign_every_rank

cfg = load_config(None, [f"checkpoint.checkpoint_dir={ckpt_dir}", "step_scheduler.num_epochs=1", *overrides])
torch.manual_seed(0)
# SMALL=1: one bias-free layer, 3 optimizer tensors (fewer than 4 ranks)
model = torch.nn.Linear(256, 256, bias=False) if os.environ.get("SMALL") else torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
mismatch = os.environ.get("MISMATCH_RANK")  # that rank's model has other shapes (no DDP, which would refuse it)
if mismatch is not None and int(mismatch) == rank:
    model = torch.nn.Linear(256, 128, bias=False)
net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 and mismatch is None else model
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
batches = [torch.randn(4, 256, generator=g) for _ in range(20)]


def train() -> None:
    global loop
    loop = resilient_loop(cfg, model=net, optimizer=optimizer, dataloader=batches)
    with loop:
        for step in loop:
            loss = net(step.batch).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


try:
    try:
        train()
    except Exception as exc:
        with open(os.path.join(out_dir, f"error.rank{rank}"), "w") as fh:
            fh.write(f"{type(exc).__name__}: {exc}")
        raise
    torch.save(snapshot(model, optimizer), os.path.join(out_dir, f"end.rank{rank}.pt"))
finally:
    net = None
    ranks.leave(world)
sys.exit(int(loop.exit_code))
