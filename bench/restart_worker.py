"""One rank of a restart of the digits example, timed phase by phase (:mod:`bench.restart`).

``--prepare``: train the example to ``step_scheduler.max_steps`` under ``resilient_loop()`` (its
final save is the checkpoint the restarts resume). Otherwise: a restart, which resumes that
checkpoint, runs the first step's body and leaves with ``os._exit(0)`` (nothing saved, so every
trial resumes the same checkpoint), having written ``time.monotonic()`` at each mark:

* ``python``: the first line of this file ran (the interpreter is up);
* ``torch``: ``import torch`` done;
* ``user_imports``: the example's other imports (``torch.distributed``, DDP, torchdata, numpy, yaml);
* ``resilience``: ``from resilience import load_config, resilient_loop`` done (ours);
* ``config``: the example's YAML read and checked (``load_config``, ours);
* ``rendezvous``: ``dist.init_process_group("gloo")`` returned (the example's, torch's);
* ``user_build``: the example's data, model, DDP, optimizer and LR schedule built;
* ``loop_built``: ``resilient_loop(...)`` returned (ours: config, our gloo group, checkpointer);
* ``resumed``: the loop yielded its first step (ours: the agreement's set-up, the choice of the
  checkpoint, its load, the data position, the first batch);
* ``first_step``: that step's body done (forward, backward with DDP's all-reduce, AdamW).

Beside each mark, the modules first imported in the phase that ended there which are known to be
heavy (``HEAVY``), and their count. The launcher's clock and this one are the same
(``CLOCK_MONOTONIC``: one clock for every process of the machine).
"""

import time

MARKS = {"python": time.monotonic()}

import sys  # noqa: E402

_seen = set(sys.modules)
NEW: dict[str, list[str]] = {}
HEAVY = ("torch.distributed.tensor", "torch.distributed.checkpoint", "torch.distributed.fsdp", "sympy", "torch._dynamo", "torch.export", "scipy")


def mark(name: str) -> None:
    """Record ``name`` now, and the heavy modules imported since the previous mark."""
    MARKS[name] = time.monotonic()
    new = set(sys.modules) - _seen
    _seen.update(new)
    NEW[name] = sorted(m for m in new if m in HEAVY)
    NEW[name + "_count"] = len(new)  # type: ignore[assignment]


import torch  # noqa: E402

mark("torch")

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import yaml  # noqa: E402, F401  (the example reads its YAML; counted with the user's imports)
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

mark("user_imports")

from resilience import load_config, resilient_loop  # noqa: E402

mark("resilience")

warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "digits"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one rank of a timed restart of the digits example")
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=4, help="steps of the preparing run (the checkpoint resumed)")
    parser.add_argument("--prepare", action="store_true", help="train --steps steps and save (no timing)")
    parser.add_argument("--out-dir", help="where each rank writes its marks, rank<R>.json (a restart)")
    args = parser.parse_args(argv)
    cfg = load_config(
        str(EXAMPLE / "digits.yaml"),
        [f"checkpoint.checkpoint_dir={args.ckpt_dir}", f"step_scheduler.max_steps={args.steps + (0 if args.prepare else 1)}"],
    )
    mark("config")
    dist.init_process_group("gloo")
    mark("rendezvous")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # as the example: 2 ranks on 2 cores
    from bench.common import example_module  # the example module (its resilience imports are done already)

    train = example_module("digits")
    extra = cfg.extra
    seed = int(extra["seed"])
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    data, _ = train.build_data(seed, float(extra["data"]["test_fraction"]))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    loader = StatefulDataLoader(data, batch_size=int(extra["data"]["global_batch_size"]) // world, sampler=sampler, drop_last=True)
    model = train.build_model(int(extra["model"]["hidden"]), float(extra["model"]["dropout"]))
    net = DistributedDataParallel(model)
    opt = extra["optimizer"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(opt["lr"]), weight_decay=float(opt["weight_decay"]))
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, train.warmup_cosine(int(opt["warmup_steps"]), 10**6))
    mark("user_build")
    loop = resilient_loop(cfg, model=net, optimizer=optimizer, lr_scheduler=lr_scheduler, dataloader=loader)
    mark("loop_built")
    with loop:
        for step in loop:
            if not args.prepare and "resumed" not in MARKS:
                mark("resumed")
            x, y = step.batch
            net.train()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()
            if args.prepare:
                continue
            mark("first_step")
            doc = {"rank": rank, "pid": os.getpid(), "marks": MARKS, "new_modules": NEW, "resumed_from": str(loop.resumed_from), "step": step.global_step}
            (Path(args.out_dir) / f"rank{rank}.json").write_text(json.dumps(doc))
            sys.stdout.flush()
            os._exit(0)  # nothing saved: the next trial resumes the same checkpoint
    return int(loop.exit_code)


if __name__ == "__main__":
    sys.exit(main())
