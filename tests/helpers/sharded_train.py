"""A tiny model trained under resilient_loop() with its parameters laid out one of several ways.

Usage: sharded_train.py CKPT_DIR OUT_DIR LAYOUT [dotted overrides...]

LAYOUT: ``plain`` (DDP over every rank, or one process), ``fsdp`` (FSDP2 ``fully_shard`` over every
rank), ``tp`` (tensor parallel over every rank: ``up`` column-wise, ``down`` row-wise, the rest
plain, replicated), ``fsdp_tp`` (2-D mesh dp x tp = world/2 x 2: TP inside, FSDP2 over dp),
``hsdp`` (2-D mesh replicate x shard = 2 x world/2: ``fully_shard`` on both, placements
(Replicate, Shard)), ``partial`` (plain, with one DTensor parameter of placement Partial).

Env ``LOADER``: ``list`` (default: 12 batches of 4 made on each rank from its data-parallel index;
its batch size cannot be read, and the layouts whose data-parallel identity cannot be known from it,
``tp``, ``fsdp_tp`` and ``partial``, state it: ``resilient_loop(data_parallel=...)``, unless env
``DATA_PARALLEL=unstated``; ``DATA_PARALLEL=per_rank`` states ``(rank, world)``, wrong for ``tp``),
``sampler`` (``DataLoader`` of ``SAMPLES`` (48) samples in batches of ``BATCH`` (4) over a shuffling
``DistributedSampler`` of the data-parallel replicas) or ``stateful``
(the same with a ``StatefulDataLoader``); with the last two each step's record lists the sample ids
this rank trained (``ids``).

Writes OUT_DIR/rank<R>.json ({"steps", "losses", "lrs", "ids", "exit"}) and, from rank 0, the full
weights (OUT_DIR/weights.safetensors) and full optimizer state (OUT_DIR/optim.safetensors,
keys ``<fqn>/<name>``) at the end of the run, gathered from every rank; a resumed run also writes
them as loaded (OUT_DIR/loaded_*.safetensors), before its first step trains. Env DIMS=d,h,o sets
the sizes (default 6,10,3: uneven on purpose, 10 rows over 4 ranks are 3, 3, 3, 1; 3 over 4
leave one rank nothing).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

import ranks  # this folder's shared rank start
from resilience import ConfigError, ExitCode, load_config, resilient_loop

ckpt_dir, out_dir, layout, overrides = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
world, rank = ranks.join()
out_dir.mkdir(parents=True, exist_ok=True)
DIM, HIDDEN, OUT = (int(n) for n in os.environ.get("DIMS", "6,10,3").split(","))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(DIM, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, DIM)
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, OUT)

    def forward(self, x):
        return self.head(self.norm(x + self.down(torch.relu(self.up(x)))))


def shard(model):
    """Lay ``model`` out as LAYOUT says; returns (the module to call, its data-parallel rank and size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp_plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    if layout == "plain":
        return (torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model), rank, world
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for block in (model.up, model.down):
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh), rank, world
    if layout == "tp":
        parallelize_module(model, init_device_mesh("cpu", (world,)), tp_plan)
        return model, 0, 1  # every rank sees the same data
    if layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan)
        return fully_shard(model, mesh=mesh["dp"]), mesh["dp"].get_local_rank(), world // 2
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        return fully_shard(model, mesh=mesh), rank, world
    if layout == "partial":
        from torch.distributed.tensor import DTensor, Partial

        mesh = init_device_mesh("cpu", (world,))
        model.head.bias = torch.nn.Parameter(DTensor.from_local(model.head.bias.detach().clone(), mesh, [Partial()]))
        return model, rank, world
    raise SystemExit(f"unknown layout {layout!r}")


cfg = load_config(None, [f"checkpoint.checkpoint_dir={ckpt_dir}", "step_scheduler.num_epochs=1", *overrides])
torch.manual_seed(0)
model = Net()
net, dp_rank, dp_size = shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
loader_kind, stated = os.environ.get("LOADER", "list"), {}
if loader_kind == "list":
    g = torch.Generator().manual_seed(dp_rank)
    batches = [(torch.randn(4, DIM, generator=g), torch.randn(4, OUT, generator=g)) for _ in range(12)]
    if layout in ("tp", "fsdp_tp", "partial") and os.environ.get("DATA_PARALLEL") != "unstated":
        stated = {"data_parallel": (rank, world) if os.environ.get("DATA_PARALLEL") == "per_rank" else (dp_rank, dp_size)}
else:
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    samples, g = int(os.environ.get("SAMPLES", "48")), torch.Generator().manual_seed(0)
    data = TensorDataset(torch.arange(samples), torch.randn(samples, DIM, generator=g), torch.randn(samples, OUT, generator=g))
    sampler = DistributedSampler(data, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=5)
    batches = (StatefulDataLoader if loader_kind == "stateful" else DataLoader)(data, batch_size=int(os.environ.get("BATCH", "4")), sampler=sampler)

record = {"steps": [], "losses": [], "lrs": [], "ids": []}


def dump(prefix=""):
    """Rank 0 writes the full weights and optimizer state, gathered from every rank (a collective)."""
    full = StateDictOptions(full_state_dict=True)
    weights = get_model_state_dict(net, options=full)
    optim = get_optimizer_state_dict(net, optimizer, options=full)["state"]
    if rank == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out_dir / f"{prefix}weights.safetensors"))
        flat = {f"{fqn}/{name}": v.contiguous() for fqn, entries in optim.items() for name, v in entries.items() if isinstance(v, torch.Tensor)}
        save_file(flat, str(out_dir / f"{prefix}optim.safetensors"))


try:
    loop = resilient_loop(cfg, model=net, optimizer=optimizer, lr_scheduler=lr_scheduler, dataloader=batches, **stated)
except ConfigError as exc:  # found before training, on every rank
    print(f"rank {rank}: ConfigError: {exc}", file=sys.stderr, flush=True)
    sys.exit(int(ExitCode.CONFIG_ERROR))
with loop:
    for step in loop:
        if loop.resumed_from is not None and not record["steps"]:
            dump("loaded_")  # what the resume loaded, before this process trains it
        *ids, x, y = step.batch
        loss = torch.nn.functional.mse_loss(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        lr_scheduler.step()
        record["steps"].append(step.global_step)
        record["losses"].append(loss.item())
        record["lrs"].append(lr_scheduler.get_last_lr()[0])
        record["ids"].append(ids[0].tolist() if ids else None)
        loop.log(loss=loss.item())

dump()
record["exit"] = int(loop.exit_code)
(out_dir / f"rank{rank}.json").write_text(json.dumps(record))
if world > 1:
    dist.barrier()
sys.exit(int(loop.exit_code))
