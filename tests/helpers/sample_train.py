"""A deterministic training run under resilient_loop() that records which samples every step saw.

Usage: sample_train.py CKPT_DIR RECORD_FILE [dotted overrides...]

The dataset is the sample ids ``0 .. SAMPLES-1`` (env, default 48); each rank appends one JSON
line per step to ``RECORD_FILE.rank<R>``: ``{"step", "ids", "loss", "lr_step", "lr"}`` where
``lr_step`` is the LR scheduler's step count after the step. Env ``LOADER``: ``plain`` (default:
``DataLoader(shuffle=True)`` on one rank, with a ``DistributedSampler`` on more), ``stateful``
(``StatefulDataLoader`` with a shuffling ``DistributedSampler``) or ``stateful_shuffle``
(``StatefulDataLoader(shuffle=True)``: its order drawn from the global RNG); ``BATCH``: the per-rank batch
size (default 4). With ``step_scheduler.gradient_accumulation_steps`` the optimizer steps on
``step.is_optimizer_step`` and the row of a step lists the ids of all its micro-batches. A model under DDP
on more ranks, SGD, an exponential LR schedule. Exits with ``loop.exit_code`` (2 for a configuration error).
"""

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ranks  # this folder's shared rank start
from resilience import ConfigError, ExitCode, load_config, resilient_loop

ckpt_dir, record, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
world, rank = ranks.join()
samples, batch = int(os.environ.get("SAMPLES", "48")), int(os.environ.get("BATCH", "4"))

try:
    cfg = load_config(None, [f"checkpoint.checkpoint_dir={ckpt_dir}", "step_scheduler.preemption_signal=[USR1, TERM]", *overrides])
except ConfigError as exc:
    print(f"configuration error: {exc}", file=sys.stderr)
    sys.exit(int(ExitCode.CONFIG_ERROR))
torch.manual_seed(0)
dataset = TensorDataset(torch.arange(samples, dtype=torch.float32).unsqueeze(1))
if os.environ.get("LOADER", "plain").startswith("stateful"):
    from torchdata.stateful_dataloader import StatefulDataLoader

    if os.environ["LOADER"] == "stateful_shuffle":
        loader = StatefulDataLoader(dataset, batch_size=batch, shuffle=True)
    else:
        loader = StatefulDataLoader(dataset, batch_size=batch, sampler=DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=7))
elif world > 1:
    loader = DataLoader(dataset, batch_size=batch, sampler=DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=7))
else:
    loader = DataLoader(dataset, batch_size=batch, shuffle=True)
model = torch.nn.Linear(1, 1)
net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
lr_scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.95)
out = os.open(f"{record}.rank{rank}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

try:
    try:
        loop = resilient_loop(cfg, model=net, optimizer=optimizer, lr_scheduler=lr_scheduler, dataloader=loader)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        sys.exit(int(ExitCode.CONFIG_ERROR))
    ids: list[int] = []
    with loop:
        for step in loop:
            (x,) = step.batch
            loss = net(x / samples).sub(1).pow(2).mean()
            loss.backward()
            ids += x.squeeze(1).long().tolist()
            if not step.is_optimizer_step:
                continue
            optimizer.step()
            optimizer.zero_grad()
            lr_scheduler.step()
            loop.log(loss=loss.item())
            row = {"step": step.global_step, "ids": ids, "loss": loss.item(), "lr_step": lr_scheduler.last_epoch, "lr": lr_scheduler.get_last_lr()[0]}
            os.write(out, (json.dumps(row) + "\n").encode())
            ids = []
    print(f"rank {rank}: exit {int(loop.exit_code)}", flush=True)
finally:
    if world > 1:  # free DDP, then the group (either alive at exit can abort the process)
        del net
        gc.collect()
        dist.destroy_process_group()
sys.exit(int(loop.exit_code))
