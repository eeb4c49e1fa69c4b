"""A small deterministic 2-rank training under resilient_loop() that can pause at named phases.

Usage: phase_train.py CKPT_DIR EVENTS_DIR [dotted overrides...]

Each rank appends one line per event to ``EVENTS_DIR/rank_<R>.events`` (``start``,
``pause TAG``, ``save_begin STEP REASON``, ``save_end STEP``, ``load_begin``,
``eval_abandoned STEP``, ``eval_done STEP``, ``exit CODE``), written with one unbuffered
``write`` each so a test can read them while the rank runs.

Env ``PAUSE_AT``: comma-separated tags. At a tag's point every rank records ``pause TAG`` and
waits until the file ``EVENTS_DIR/release_TAG`` exists (at most 60 s, then it raises), so a
test can send a signal while every rank is known to be in that phase, then release them:

==================  ========================================================================
``build``           before the model is built: the loop's signal handlers are not installed
``load``            inside ``Checkpointer.load`` (resume loading; handlers installed)
``step:N``          in step N's body, before the forward pass
``eval:N``          in the evaluation of step N (its training part done), after the first
                    ``loop.should_stop()`` check of the evaluation loop
``save:K``          in the K-th save of this process, at its first "parts" phase (every rank;
                    an asynchronous save: in its background write)
``save:preemption`` in the preemption save, at its first "parts" phase
==================  ========================================================================

Training: 2 epochs of 10 steps per rank (160 samples, DistributedSampler shuffle, batch 8), an
MLP with dropout under DistributedDataParallel, AdamW and StepLR; ``preemption_signal: [USR1,
TERM]``, a save every 4 steps, evaluation every ``step_scheduler.val_every_steps`` steps (default
5, 4 batches, no grad).
Env ``RAISE_AT_STEP=N`` ``RAISE_RANK=R``: rank R raises ``RuntimeError`` in step N after backward,
before the optimizer step. Any exception is printed and the rank exits 1; a ``KeyboardInterrupt``
(SIGINT) exits 130, as a shell reports a death by SIGINT.
"""

import gc
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ranks  # this folder's shared rank start
from resilience import load_config, resilient_loop
from resilience.checkpoint import checkpointer, writer

ckpt_dir, events_dir, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
world, rank = ranks.join()
os.makedirs(events_dir, exist_ok=True)
_events = os.open(os.path.join(events_dir, f"rank_{rank}.events"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
PAUSES = {tag.strip() for tag in os.environ.get("PAUSE_AT", "").split(",") if tag.strip()}


def event(*words) -> None:
    os.write(_events, (" ".join(str(w) for w in words) + "\n").encode())


def pause(tag: str) -> None:
    if tag not in PAUSES:
        return
    event("pause", tag)
    release = os.path.join(events_dir, f"release_{tag}")
    deadline = time.monotonic() + 60
    while not os.path.exists(release):
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: pause {tag} was never released")
        time.sleep(0.005)
    event("released", tag)


saves = 0
started = {}  # global step -> (number, reason) of the save started there
save_number, save_reason = 0, None  # the save being written, which may run in the background
paused_this_save = False
original_save = checkpointer.Checkpointer.save
original_write = checkpointer.Checkpointer._write
original_load = checkpointer.Checkpointer.load


def recording_save(self, reason="periodic"):
    global saves
    saves += 1
    started[self.scheduler.global_step] = (saves, reason)
    event("save_begin", self.scheduler.global_step, reason)
    result = original_save(self, reason)
    event("save_end", self.scheduler.global_step)
    return result


def recording_write(self, ctx, name, parts, meta, value):
    # An asynchronous save is written after save() returned, maybe once the next one has begun:
    # the pause follows the save being written, not the last one started.
    global save_number, save_reason, paused_this_save
    (save_number, save_reason), paused_this_save = started[meta["global_step"]], False
    return original_write(self, ctx, name, parts, meta, value)


def recording_load(self, directory, state):
    event("load_begin", directory.name)
    pause("load")
    return original_load(self, directory, state)


def hook(phase: str) -> None:
    global paused_this_save
    if phase == "parts" and not paused_this_save:
        paused_this_save = True
        pause(f"save:{save_number}")
        if save_reason == "preemption":
            pause("save:preemption")


checkpointer.Checkpointer.save = recording_save
checkpointer.Checkpointer._write = recording_write
checkpointer.Checkpointer.load = recording_load
writer.fault_hook = hook


def train() -> int:
    event("start")
    cfg = load_config(
        None,
        [
            f"checkpoint.checkpoint_dir={ckpt_dir}",
            "step_scheduler.num_epochs=2",
            "step_scheduler.ckpt_every_steps=4",
            "step_scheduler.val_every_steps=5",
            "step_scheduler.preemption_signal=[USR1, TERM]",
            # A cadence of 1, not auto: these tests place a signal at one phase of one step and check
            # where the stop lands (auto would let a stop on these ~ms steps run several steps on).
            "step_scheduler.agreement_every_steps=1",
            *overrides,
        ],
    )
    torch.manual_seed(0)
    pause("build")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    g = torch.Generator().manual_seed(1234)
    dataset = TensorDataset(torch.randn(160, 8, generator=g), torch.randn(160, 1, generator=g))
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    val_x = torch.randn(4, 8, 8, generator=g)
    raise_at, raise_rank = int(os.environ.get("RAISE_AT_STEP", "0")), int(os.environ.get("RAISE_RANK", "0"))

    loop = resilient_loop(cfg, model=net, optimizer=optimizer, lr_scheduler=lr_scheduler, dataloader=loader)
    with loop:
        for step in loop:
            pause(f"step:{step.global_step}")
            x, y = step.batch
            loss = torch.nn.functional.mse_loss(net(x), y)
            optimizer.zero_grad()
            loss.backward()
            if step.global_step == raise_at and rank == raise_rank:
                raise RuntimeError(f"injected exception in step {raise_at} on rank {rank}")
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            lr_scheduler.step()
            loop.log(loss=loss.item(), lr=lr)
            if step.is_val_step:
                abandoned, total = False, 0.0
                model.eval()
                with torch.no_grad():
                    for i, batch in enumerate(val_x):
                        if loop.should_stop():  # collective: every rank calls it at the same points
                            abandoned = True
                            break
                        if i == 0:
                            pause(f"eval:{step.global_step}")
                        total += model(batch).pow(2).mean().item()
                model.train()
                if abandoned:
                    event("eval_abandoned", step.global_step)
                else:
                    event("eval_done", step.global_step)
                    loop.log_validation(val_loss=total)
    return int(loop.exit_code)


try:
    code = train()
except KeyboardInterrupt:
    traceback.print_exc()
    code = 130
except BaseException:  # noqa: BLE001 - printed like an uncaught exception, exit 1
    traceback.print_exc()
    code = 1
# Everything train() made is freed before the process group is destroyed (torch 2.13 + gloo: a
# DistributedDataParallel module alive at interpreter exit aborts it now and then, rc -6).
gc.collect()
event("exit", code)
if world > 1:
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a peer that died first; the exit code says what happened
        pass
sys.exit(code)
