"""A tiny training whose model, optimizer and loader come from Hugging Face Accelerate's ``prepare()``.

Usage: accelerate_train.py CKPT_DIR EVENTS_DIR [dotted overrides...]

Env:
  STATEFUL       ``1``: ``DataLoaderConfiguration(use_stateful_dataloader=True)`` (the prepared
                 loader wraps torchdata's ``StatefulDataLoader``); else a plain prepared ``DataLoader``
                 (its ``state_dict()`` raises ``AttributeError``: the replay path)
  PAUSE_AT_STEP  N: in step N's body every rank creates ``EVENTS_DIR/paused_<rank>`` and waits until
                 ``EVENTS_DIR/release`` exists (at most 60 s), so a test can signal while every rank runs

Training: ``Accelerator(cpu=True)`` on the ranks ``resilience run`` / ``launch`` started (gloo),
2 epochs of 6 steps per rank (48 samples, ``DataLoader(shuffle=True)`` sharded by Accelerate, batch
4), an MLP with dropout (the global torch RNG in every step), AdamW; ``preemption_signal: [USR1, TERM]``,
agreement every step. Each rank prints ``rank R: exit CODE, resumed from NAME`` and exits with the loop's code.
"""

import logging
import os
import sys

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

import ranks  # this folder's shared rank helpers
from resilience import resilient_loop


def main() -> int:
    ckpt_dir, events, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    os.makedirs(events, exist_ok=True)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # the loader's resume mode
    cfg = ranks.preemptible_config(ckpt_dir, overrides)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=os.environ.get("STATEFUL") == "1"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.25), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1234)
    loader = DataLoader(TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g)), batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    pause_at = int(os.environ.get("PAUSE_AT_STEP", "0"))
    rank = accelerator.process_index

    loop = resilient_loop(cfg, model=model, optimizer=optimizer, dataloader=loader)
    with loop:
        for step in loop:
            if step.global_step == pause_at:
                ranks.pause_for_release(events, rank)
            loss = torch.nn.functional.mse_loss(model(step.batch[0]), step.batch[1])
            accelerator.backward(loss)  # Accelerate's way; DDP all-reduces the gradients
            optimizer.step()
            optimizer.zero_grad()
            loop.log(loss=loss.item(), lr=optimizer.param_groups[0]["lr"])
    code = int(loop.exit_code)
    resumed = loop.resumed_from.name if loop.resumed_from else None
    print(f"rank {rank}: exit {code}, resumed from {resumed}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
