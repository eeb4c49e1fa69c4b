"""A bench rank for the watchdog's detection latency: a small DDP model under ``resilient_loop``
that injects faults into itself, each once across in-job restarts.

    python -m bench.watchdog_worker CKPT_DIR FAULT_DIR    # under resilience run -n 2

``BENCH_FAULTS=hang@8,kill@17,stop@26`` (``kind@step``) on rank ``BENCH_FAULT_RANK`` (default 1):
after that step's optimizer step the rank writes ``time.monotonic()`` (one clock for every process
of the machine) to ``FAULT_DIR/<kind>`` and then sleeps forever (``hang``), SIGKILLs itself
(``kill``) or SIGSTOPs itself (``stop``); a fault whose file exists is not injected again.
A checkpoint every 5 steps, 40 steps of a few milliseconds.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from resilience import load_config, resilient_loop


def fault(kind: str | None, directory: Path) -> None:
    """Inject ``kind`` once (see the module docstring)."""
    if kind is None or (directory / kind).exists():
        return
    (directory / kind).write_text(f"{time.monotonic()!r}\n")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        time.sleep(3600)


def main() -> int:
    ckpt, directory = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    faults = {int(at): kind for kind, at in (item.split("@") for item in os.environ.get("BENCH_FAULTS", "").split(",") if item)}
    mine = rank == int(os.environ.get("BENCH_FAULT_RANK", "1"))
    config = load_config(None, [f"checkpoint.checkpoint_dir={ckpt}", "step_scheduler.num_epochs=1", "step_scheduler.ckpt_every_steps=5"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    net = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(40)]
    loop = resilient_loop(config, model=net, optimizer=optimizer, dataloader=batches)
    try:
        with loop:
            for step in loop:
                x, y = step.batch
                loss = torch.nn.functional.mse_loss(net(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                fault(faults.get(step.global_step) if mine else None, directory)
    finally:
        del net
        dist.destroy_process_group()
    return int(loop.exit_code)


if __name__ == "__main__":
    sys.exit(main())
