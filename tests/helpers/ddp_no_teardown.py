"""A 2-rank DDP training script with NO teardown lines (no del, gc.collect, destroy_process_group).

Usage: ddp_no_teardown.py CKPT_DIR MODE   (MODE: done, preempt: rank 0 sends itself SIGTERM at
step 3, raise: rank 0 raises at step 3). An atexit hook registered before resilient_loop() (so
it runs after the library's) prints whether the default group and the DDP reducer are still alive.
"""

import atexit
import os
import signal
import sys

import torch
import torch.distributed as dist

from resilience import load_config, resilient_loop

ckpt_dir, mode = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
cfg = load_config(None, [f"checkpoint.checkpoint_dir={ckpt_dir}", "step_scheduler.max_steps=8", "step_scheduler.agreement_every_steps=1"])
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
net = torch.nn.parallel.DistributedDataParallel(model)  # a module global: alive until finalisation
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
batches = [torch.randn(8, 16) for _ in range(10)]
atexit.register(lambda: print(f"rank {rank}: at exit group_alive={dist.is_initialized()} reducer_alive={hasattr(net, 'reducer')}", flush=True))
loop = resilient_loop(cfg, model=net, optimizer=optimizer, dataloader=batches)
with loop:
    for step in loop:
        net(step.batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step.global_step == 3 and rank == 0:
            if mode == "preempt":
                os.kill(os.getpid(), signal.SIGTERM)
            elif mode == "raise":
                raise RuntimeError("injected")
sys.exit(int(loop.exit_code))
