"""A small deterministic training run under resilient_loop(), for fault tests (fast to start).

Usage: tiny_train.py CKPT_DIR [dotted overrides...]
Env: FAIL_PHASE / FAIL_RANK / FAIL_AT_SAVE make that rank raise OSError at that phase of that
save (phases of resilience.checkpoint.writer); FILL_AFTER_FIRST_SAVE=1 fills the checkpoint's
filesystem after the first save; RAISE_AT_STEP=N RAISE_RANK=R: rank R raises RuntimeError after backward, before the optimizer
step, of step N. SLEEP_PER_STEP_S slows steps down.
FAULTS=KIND@STEP,... FAULT_RANK=R FAULT_DIR=D: rank R, after step STEP's optimizer step, does KIND
once per D (marker D/fault_KIND; several kinds may share a step, the first not yet done fires):
hang (sleeps), kill (SIGKILL), stop (SIGSTOP), eval (EVAL_S seconds of evaluation alone, calling
loop.heartbeat(); the others wait in the next step's all-reduce), collective (an all-reduce the
other ranks never join: every rank ends up stuck in one).
DELETE_EVENTS=D: retention's background deletion touches D/delete_started_<rank> and, done with
this rank's own files, D/deleted_<rank>; each step touches D/step_<rank>_<global step>; with
DELETE_MODE=block every rank's deletion waits for D/release first; with DELETE_MODE=kill rank 0
waits for D/deleted_1 (rank 1 deleted its files) and kills itself (SIGKILL) there.
"""

import gc
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ranks  # this folder's shared rank start
from resilience import load_config, resilient_loop
from resilience.checkpoint import checkpointer, writer

ckpt_dir, overrides = sys.argv[1], sys.argv[2:]
world, rank = ranks.join()

saves = 0
original_save = checkpointer.Checkpointer.save


def counting_save(self, *args, **kwargs):
    global saves
    self.wait()  # an asynchronous save in flight belongs to the previous count
    saves += 1
    result = original_save(self, *args, **kwargs)
    if saves == 1 and rank == 0 and os.environ.get("FILL_AFTER_FIRST_SAVE"):
        # leave ~48 KiB free: the logs still fit, the next checkpoint (~90 KiB) does not
        stat = os.statvfs(ckpt_dir)
        with open(os.path.join(os.path.dirname(os.path.abspath(ckpt_dir)), "filler"), "wb") as fh:
            fh.write(b"\0" * max(0, stat.f_bavail * stat.f_frsize - 49152))
    return result


def deletion_events(phase):
    events = Path(os.environ["DELETE_EVENTS"])
    if phase == "delete":
        (events / f"delete_started_{rank}").touch()
        mode, waited_for = os.environ.get("DELETE_MODE"), None
        if mode == "block":
            waited_for = events / "release"
        elif mode == "kill" and rank == 0:
            waited_for = events / "deleted_1"
        deadline = time.monotonic() + 60
        while waited_for is not None and not waited_for.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if mode == "kill" and rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    elif phase == "deleted":
        (events / f"deleted_{rank}").touch()


def hook(phase):
    if os.environ.get("DELETE_EVENTS") and phase in ("delete", "deleted"):
        deletion_events(phase)
    if phase == os.environ.get("FAIL_PHASE") and rank == int(os.environ.get("FAIL_RANK", "0")) and saves == int(os.environ.get("FAIL_AT_SAVE", "1")):
        raise OSError(28, f"injected failure at {phase} on rank {rank}")


checkpointer.Checkpointer.save = counting_save
writer.fault_hook = hook

cfg = load_config(None, [f"checkpoint.checkpoint_dir={ckpt_dir}", "step_scheduler.num_epochs=1", "step_scheduler.preemption_signal=[USR1, TERM]", *overrides])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(40)]
raise_at = int(os.environ.get("RAISE_AT_STEP", "0"))
sleep_s = float(os.environ.get("SLEEP_PER_STEP_S", "0"))
faults: dict[int, list[str]] = {}
for kind, at in (item.split("@") for item in os.environ.get("FAULTS", "").split(",") if item):
    faults.setdefault(int(at), []).append(kind)
# every rank joins the group of the rank-conditional all-reduce; only the faulty rank uses it
side_group = dist.new_group(backend="gloo") if world > 1 and any("collective" in kinds for kinds in faults.values()) else None


def fault(step_number: int) -> None:
    if rank != int(os.environ.get("FAULT_RANK", "1")):
        return
    kind = next((kind for kind in faults.get(step_number, ()) if not (Path(os.environ["FAULT_DIR"]) / f"fault_{kind}").exists()), None)
    if kind is None:
        return
    (Path(os.environ["FAULT_DIR"]) / f"fault_{kind}").touch()
    if kind == "eval":
        ends = time.monotonic() + float(os.environ["EVAL_S"])
        while time.monotonic() < ends:
            loop.heartbeat()
            time.sleep(0.05)
    elif kind == "collective":
        dist.all_reduce(torch.ones(1), group=side_group)
    elif kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        time.sleep(3600)  # the hang: tests find this line in the launcher's stack dump


try:
    loop = resilient_loop(cfg, model=net, optimizer=optimizer, dataloader=batches)
    announced = False
    with loop:
        for step in loop:
            x, y = step.batch
            loss = torch.nn.functional.mse_loss(net(x), y)
            optimizer.zero_grad()
            loss.backward()
            if step.global_step == raise_at and rank == int(os.environ.get("RAISE_RANK", "0")):
                raise RuntimeError(f"injected exception in step {raise_at} on rank {rank}")
            optimizer.step()
            if loop.resumed_from is not None and not announced:
                announced = print(f"rank {rank}: resumed from {loop.resumed_from.name}", flush=True) or True
            fault(step.global_step)
            if os.environ.get("DELETE_EVENTS"):
                Path(os.environ["DELETE_EVENTS"], f"step_{rank}_{step.global_step}").touch()
            loop.log(loss=loss.item())
            if sleep_s:
                time.sleep(sleep_s)
    if loop.resumed_from is not None and not announced:  # resumed at the last step: no step left to run
        print(f"rank {rank}: resumed from {loop.resumed_from.name}", flush=True)
    print(f"rank {rank}: exit {int(loop.exit_code)}", flush=True)
    if os.environ.get("AFTER_LOOP_DIR"):  # work after training (an evaluation): a stop signal must not end it
        after = Path(os.environ["AFTER_LOOP_DIR"])
        (after / f"started_{rank}").touch()
        time.sleep(float(os.environ.get("AFTER_LOOP_S", "2")))
        (after / f"finished_{rank}").touch()
finally:
    # Free the DDP module, then destroy the group: either left alive at interpreter exit (after
    # an exception too) can abort the process with SIGABRT (torch 2.13 + gloo).
    if world > 1:
        del net
        gc.collect()
        dist.destroy_process_group()
sys.exit(int(loop.exit_code))
