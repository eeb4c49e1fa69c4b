"""Train an MLP on the UCI handwritten digits under ``resilient_loop()``; 1 or 2 ranks (gloo, DDP).

    python examples/digits/train.py --config examples/digits/digits.yaml checkpoint.checkpoint_dir=/tmp/ck
    resilience run --nproc-per-node 2 examples/digits/train.py --config examples/digits/digits.yaml

Deterministic on CPU: two runs with the same config produce bitwise-identical weights, and so
does a run that is preempted (SIGUSR1/SIGTERM) and resumed. Exits with ``resilience.ExitCode``.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib.util
import math
import os
import random
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from resilience import ConfigError, ExitCode, load_config, resilient_loop

warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata 0.11 on torch 2.13


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits as ``sklearn.datasets.load_digits()`` returns them: pixels
    ``(1797, 64)`` float64 in 0..16 and labels ``(1797,)`` int, read from the same file the same
    way. Importing ``sklearn.datasets`` pulls in scipy, about a second of every restart here."""
    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("the digits example needs scikit-learn for its data: pip install scikit-learn")
    with gzip.open(Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz", "rt", encoding="utf-8") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def build_data(seed: int, test_fraction: float) -> tuple[TensorDataset, TensorDataset]:
    pixels, labels = load_digits()
    x = torch.tensor(pixels, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def build_model(hidden: int, dropout: float) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.ReLU(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(hidden, 10),
    )


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(Path(__file__).with_name("digits.yaml")))
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. checkpoint.checkpoint_dir=/tmp/ck")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:  # exit 2: the batch script does not requeue a bad configuration
        print(f"configuration error: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    extra = cfg.extra

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world_size > 1 else 0
    torch.set_num_threads(1)  # 2 ranks on 2 cores; also keeps CPU kernels deterministic

    seed = int(extra["seed"])
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    train, test = build_data(seed, float(extra["data"]["test_fraction"]))
    local_batch = int(extra["data"]["global_batch_size"]) // world_size
    sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    loader = StatefulDataLoader(train, batch_size=local_batch, sampler=sampler, drop_last=True)

    model = build_model(int(extra["model"]["hidden"]), float(extra["model"]["dropout"]))
    net = DistributedDataParallel(model) if world_size > 1 else model
    opt_cfg = extra["optimizer"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(opt_cfg["lr"]), weight_decay=float(opt_cfg["weight_decay"]))
    accumulation = cfg.step_scheduler.gradient_accumulation_steps  # micro-batches per optimizer step
    total_steps = cfg.step_scheduler.max_steps or cfg.step_scheduler.num_epochs * math.ceil(len(loader) / accumulation)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(int(opt_cfg["warmup_steps"]), total_steps))

    try:
        loop = resilient_loop(cfg, model=net, optimizer=optimizer, lr_scheduler=lr_scheduler, dataloader=loader)
    except ConfigError as exc:  # e.g. checkpoint_dir is a file: every rank finds it before training
        print(f"rank {rank}: configuration error: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    with loop:
        loss_sum = 0.0
        for step in loop:
            x, y = step.batch
            net.train()
            # Accumulating micro-batches: DDP all-reduces only in the optimizer step's backward.
            sync = contextlib.nullcontext() if step.is_optimizer_step or world_size == 1 else net.no_sync()
            with sync:
                loss = F.cross_entropy(net(x), y)
                (loss / accumulation).backward()
            loss_sum += loss.item()
            if step.is_optimizer_step:
                lr = optimizer.param_groups[0]["lr"]
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                loop.log(loss=loss_sum, lr=lr)
                loss_sum = 0.0

    if loop.exit_code == ExitCode.DONE and rank == 0:
        model.eval()
        with torch.no_grad():
            x, y = test.tensors
            accuracy = (model(x).argmax(1) == y).float().mean().item()
        print(f"rank 0: done at step {loop.scheduler.global_step}, test accuracy {accuracy:.3f}", flush=True)
    elif loop.exit_code == ExitCode.PREEMPTED:
        print(f"rank {rank}: preempted, saved step {loop.stop_step}, exit {int(loop.exit_code)}", flush=True)
    # No teardown here: at exit, resilient_loop() frees DDP, then destroys the process group.
    return int(loop.exit_code)


if __name__ == "__main__":
    sys.exit(main())
