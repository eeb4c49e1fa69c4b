"""A Lightning script made preemption-safe with ``resilience.integrations.lightning.fit``.

    resilience run -n 2 examples/lightning/train.py                                # 2 CPU ranks (gloo, DDP)
    resilience run -n 2 examples/lightning/train.py checkpoint.checkpoint_dir=/tmp/pl training.max_epochs=5
    python examples/lightning/train.py                                             # one process

An MLP with dropout learns sklearn's digits from a shuffling ``StatefulDataLoader``. ``kill -USR1``
to any rank (or to ``resilience run``) stops every rank after the same optimizer step, saves it
(``trainer.save_checkpoint``'s ``.ckpt`` and each rank's RNG and loader state, published atomically
under ``checkpoint.checkpoint_dir``) and exits 75; the same command then resumes from ``LATEST``,
mid-epoch, and ends as an uninterrupted run would, bitwise. ``trainer.fit()`` is Lightning's own.

Arguments: an optional YAML file (default: ``lightning.yaml`` beside this script), then dotted
overrides (``section.key=value``). Exits with ``resilience.ExitCode``.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from resilience import ConfigError, ExitCode, load_config
from resilience.integrations.lightning import fit

HERE = Path(__file__).resolve().parent


class Digits(Dataset):
    """``count`` of sklearn's 8x8 digit images from index ``first`` on: (64 floats in [0, 1], label)."""

    def __init__(self, first: int, count: int):
        from sklearn.datasets import load_digits

        digits = load_digits()
        self.x = torch.tensor(digits.data[first : first + count], dtype=torch.float32) / 16
        self.y = torch.tensor(digits.target[first : first + count])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class DigitsMLP(L.LightningModule):
    """64 -> hidden -> 10 with dropout; AdamW and a learning rate that decays every optimizer step."""

    def __init__(self, hidden: int, dropout: float, lr: float):
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(hidden, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        decay = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.95)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


def build(cfg, callbacks=()):
    """The model, the loaders and the ``Trainer`` from the config's ``model``, ``data`` and ``training`` sections."""
    from lightning.pytorch.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    model_cfg, data, training = cfg.extra["model"], cfg.extra["data"], dict(cfg.extra["training"])
    L.seed_everything(int(data["seed"]), verbose=False)  # the initial weights, and the DistributedSampler's seed
    model = DigitsMLP(int(model_cfg["hidden"]), float(model_cfg["dropout"]), float(model_cfg["lr"]))
    train_data = Digits(0, int(data["train_samples"]))
    val_data = Digits(int(data["train_samples"]), int(data["val_samples"]))
    workers = int(data.get("num_workers", 0))
    train = StatefulDataLoader(train_data, batch_size=int(data["batch_size"]), shuffle=True, num_workers=workers)  # Lightning's DDP shards it
    val = StatefulDataLoader(val_data, batch_size=64)
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    launched = {"strategy": DDPStrategy(process_group_backend="gloo"), "devices": ranks} if ranks > 1 else {"devices": 1}
    if "LOCAL_RANK" in os.environ:  # ranks started by a launcher (resilience run): inside sbatch, not Slurm's task ids
        launched["plugins"] = [LightningEnvironment()]
    trainer = L.Trainer(accelerator="cpu", default_root_dir=cfg.checkpoint.checkpoint_dir, callbacks=list(callbacks), **launched, **training)
    return trainer, model, train, val


def main(argv: list[str], callbacks=()) -> int:
    torch.set_num_threads(1)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("resilience").setLevel(logging.INFO)  # which checkpoint a start resumes from
    path = argv[0] if argv and not argv[0].count("=") else HERE / "lightning.yaml"
    overrides = argv[1:] if argv and not argv[0].count("=") else argv
    try:
        cfg = load_config(path, overrides)
        trainer, model, train, val = build(cfg, callbacks)
        code = fit(trainer, model, cfg, train_dataloaders=train, val_dataloaders=val)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    print(f"rank {trainer.global_rank}: exit {int(code)}", flush=True)
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
