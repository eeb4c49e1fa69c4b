"""A tiny model sharded over a device mesh (gloo, CPU) under resilient_loop(), for the sharded e2e tests.

Usage (the examples' form, so ``runs.run`` starts it): mesh_train.py --config IGNORED [dotted overrides]
``layout=fsdp2`` (``fully_shard`` per block, then the model, over all ranks), ``tp`` (each block's
``up`` column-wise and ``down`` row-wise over all ranks) or ``dp_tp`` (a 2-D mesh ``(world/2, 2)``:
TP over the inner dimension, FSDP2 over the outer one). ``steps``: optimizer steps; ``sleep_s``: a
pause per step, so a signal sent at a logged step lands mid-run. Deterministic at a fixed world size
and layout: two runs give bitwise-equal losses and weights. (Its sibling ``sharded_train.py`` takes
positional arguments and dumps the gathered full state for the save/reshard tests; this one logs
losses and learning rates to ``training.jsonl`` for ``runs.compare``. Both: ``sharded_runs.py``.)
"""

import argparse
import sys
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ranks  # this folder's shared rank start
from resilience import load_config, resilient_loop

LAYOUTS = ("fsdp2", "tp", "dp_tp")


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(torch.nn.Module):
    """Linear(16, 32) -> 2 residual blocks (32 -> 64 -> 32) -> Linear(32, 4); 9.5 K parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.blocks = torch.nn.ModuleList(Block(32) for _ in range(2))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def shard(model: Net, layout: str, world: int) -> tuple[int, int]:
    """Shard ``model`` in place; returns (data-parallel size, this rank's data-parallel index)."""
    tp_plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    if layout == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return world, mesh.get_local_rank()
    if layout == "tp":
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            parallelize_module(block, mesh, tp_plan)
        return 1, 0
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], tp_plan)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return world // 2, mesh["dp"].get_local_rank()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    world, rank = ranks.join()
    cfg = load_config(None, ["step_scheduler.preemption_signal=[USR1, TERM]", "step_scheduler.agreement_every_steps=1", *args.overrides])
    layout, steps, sleep_s = cfg.extra.get("layout", "fsdp2"), int(cfg.extra.get("steps", 30)), float(cfg.extra.get("sleep_s", 0.02))
    if layout not in LAYOUTS:
        raise SystemExit(f"layout: expected one of {LAYOUTS}, got {layout!r}")

    torch.manual_seed(0)
    model = Net()
    dp_size, dp_rank = shard(model, layout, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.7)
    g = torch.Generator().manual_seed(1234)
    n = steps * 4 * dp_size
    data = TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g))
    # TP ranks of one data-parallel group read the same batches
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0))

    loop = resilient_loop(cfg, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, dataloader=loader)
    with loop:
        for step in loop:
            x, y = step.batch
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            lr_scheduler.step()
            loop.log(loss=loss.item(), lr=lr)
            time.sleep(sleep_s)
    if loop.exit_code == 75:
        print(f"rank {rank}: preempted, saved step {loop.stop_step}", flush=True)
    return int(loop.exit_code)


if __name__ == "__main__":
    sys.exit(main())
