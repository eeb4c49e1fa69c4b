"""A Hugging Face Accelerate loop made preemption-safe: the prepared objects go into ``resilient_loop()``.

    resilience run -n 2 examples/accelerate/train.py                               # 2 CPU ranks (gloo)
    resilience run -n 2 examples/accelerate/train.py checkpoint.checkpoint_dir=/tmp/acc accelerate.use_stateful_dataloader=false
    python examples/accelerate/train.py                                            # one process

An MLP with dropout learns sklearn's digits; ``accelerator.prepare()`` shards the shuffled loader
over the ranks and wraps the model in DDP; ``with accelerator.accumulate(model):`` accumulates 2
batches per optimizer step. ``kill -USR1`` to any rank (or to ``resilience run``) stops every rank
after the same step, saves it atomically under ``checkpoint.checkpoint_dir`` and exits 75; the
same command then resumes from ``LATEST`` and ends as an uninterrupted run would, bitwise (rank 0
prints the final weights' digest to compare). ``accelerate launch`` works too, with torchrun's
30 s grace time (docs/integrations.md#launchers).

Arguments: an optional YAML file (default: ``accelerate.yaml`` beside this script), then dotted
overrides (``section.key=value``). Exits with ``resilience.ExitCode``.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

from resilience import ConfigError, ExitCode, load_config, resilient_loop

HERE = Path(__file__).resolve().parent


def digits(count: int) -> TensorDataset:
    """The first ``count`` of sklearn's 8x8 digit images: (64 floats in [0, 1], label)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return TensorDataset(torch.tensor(data.data[:count], dtype=torch.float32) / 16, torch.tensor(data.target[:count]))


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over the parameters' bytes in name order: equal digests, bitwise-equal weights."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode() + p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    path = argv[0] if argv and "=" not in argv[0] else HERE / "accelerate.yaml"
    try:
        cfg = load_config(path, argv[1:] if argv and "=" not in argv[0] else argv)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    model_cfg, data = cfg.extra["model"], cfg.extra["data"]
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=cfg.step_scheduler.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=bool(cfg.extra["accelerate"]["use_stateful_dataloader"])),
    )
    torch.manual_seed(int(data["seed"]))  # the initial weights and the loader's shuffle
    hidden, dropout = int(model_cfg["hidden"]), float(model_cfg["dropout"])
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(hidden, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(model_cfg["lr"]))
    loader = DataLoader(digits(int(data["train_samples"])), batch_size=int(data["batch_size"]), shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    try:
        loop = resilient_loop(cfg, model=model, optimizer=optimizer, dataloader=loader)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    with loop:
        for step in loop:  # resumes from LATEST first
            x, y = step.batch
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            loop.log(loss=loss.item())
    code = int(loop.exit_code)
    if accelerator.is_main_process:
        print(f"rank 0: exit {code}, weights {weights_digest(accelerator.unwrap_model(model))}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
