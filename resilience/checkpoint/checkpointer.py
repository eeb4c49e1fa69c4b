"""``Checkpointer``: what goes into a checkpoint of a training run, and how it comes back.

The public methods own the guards (enabled? distributed?); the save and resume data paths are
:mod:`resilience.checkpoint.writer` and :mod:`resilience.checkpoint.reader`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from resilience.checkpoint import model_io, optim_io
from resilience.checkpoint.layout import checkpoint_name, rank_file
from resilience.checkpoint.reader import find_resume_checkpoint
from resilience.checkpoint.writer import Part, remove_leftovers, save_checkpoint
from resilience.config import CheckpointConfig
from resilience.distributed import DistContext
from resilience.state.data_position import read_data_position, save_data_position
from resilience.state.rng import load_rng_state, save_rng_state
from resilience.state.step_scheduler import StepScheduler

STEP_SCHEDULER = "step_scheduler.json"
CONFIG = "config.yaml"
EXTRA_DIR = "extra"


@dataclasses.dataclass
class TrainingState:
    """The objects a checkpoint captures. Any may be ``None`` except ``model``.

    ``extra`` maps a name to any object with ``state_dict()``/``load_state_dict()`` whose state
    is JSON-serialisable (saved by rank 0 as ``extra/<name>.json``).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None
    dataloader: Any = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Restored:
    """What :meth:`Checkpointer.load` restored, plus what the loop applies later."""

    directory: Path
    step_scheduler: dict[str, int]
    data_position: dict[str, Any] | None
    rng_file: Path | None
    """This rank's RNG file; applied by the loop at the point the save captured it."""
    meta: dict[str, Any]


class Checkpointer:
    """Saves and restores :class:`TrainingState` under ``config.checkpoint_dir``.

    Every method is a collective over ``ctx`` (call it on every rank). A save publishes
    ``epoch_<E>_step_<S>/`` and moves ``LATEST`` only after every rank's files are durable.
    """

    def __init__(self, config: CheckpointConfig, ctx: DistContext, *, run_config: dict[str, Any] | None = None, run_id: str | None = None):
        self.config = config
        self.ctx = ctx
        self.root = Path(config.checkpoint_dir).absolute()
        self.run_config = run_config or {}
        self.run_id = run_id
        self.last_saved_step: int | None = None

    # -- save ---------------------------------------------------------------------------------
    def save(self, state: TrainingState, scheduler: StepScheduler, *, reason: str = "periodic") -> Path | None:
        """Write and publish a checkpoint of the current state; returns its directory.

        Raises:
            CheckpointSaveError: on every rank when any rank failed; ``LATEST`` is unchanged.
        """
        if not self.config.enabled:
            return None
        if self.ctx.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        # After the last batch of an epoch the scheduler already points at the next epoch;
        # the directory is named after the epoch the step ran in.
        epoch = scheduler.epoch - 1 if scheduler.batches_in_epoch == 0 and scheduler.epoch > 0 else scheduler.epoch
        name = checkpoint_name(epoch, scheduler.global_step)
        meta = {
            "epoch": epoch,
            "global_step": scheduler.global_step,
            "world_size": self.ctx.world_size,
            "reason": reason,
            "saved_at": time.time(),
            "run_id": self.run_id,
            "torch_version": torch.__version__,
        }
        path = save_checkpoint(self.ctx, self.root, name, self._parts(state, scheduler), meta)
        self.last_saved_step = scheduler.global_step
        return path

    def _parts(self, state: TrainingState, scheduler: StepScheduler) -> list[Part]:
        rank = self.ctx.rank
        parts = []
        if state.optimizer is not None:  # collective first: it must run on every rank
            parts.append(Part("optimizer", lambda d: optim_io.save_optimizer(d, state.model, state.optimizer, rank=rank, group=self.ctx.group), collective=True))
        if rank == 0:
            parts.append(Part("model", lambda d: model_io.save_model(d, state.model)))
            if state.lr_scheduler is not None:
                parts.append(Part("lr_scheduler", lambda d: optim_io.save_lr_scheduler(d, state.lr_scheduler)))
            parts.append(Part("step_scheduler", lambda d: _write_json(d, STEP_SCHEDULER, scheduler.state_dict())))
            parts.append(Part("config", lambda d: _write_text(d, CONFIG, yaml.safe_dump(self.run_config, sort_keys=False))))
            for key, obj in state.extra.items():
                parts.append(Part(f"extra.{key}", lambda d, obj=obj, key=key: _write_json(d, f"{EXTRA_DIR}/{key}.json", obj.state_dict())))
        parts.append(Part("rng", lambda d: _rng(d, rank)))
        if state.dataloader is not None:
            parts.append(Part("dataloader", lambda d: _data(d, rank, state.dataloader, scheduler.batches_in_epoch)))
        return parts

    # -- resume -------------------------------------------------------------------------------
    def find_resume_point(self) -> Path | None:
        """The directory to resume from (``restore_from`` or ``LATEST`` with fallback), or ``None``.

        Also removes staging directories left by a crashed save. Raises ``CheckpointNotFound``
        when ``restore_from`` names a missing or invalid checkpoint.
        """
        if not self.config.enabled:
            return None
        if self.ctx.rank == 0:
            remove_leftovers(self.root)
        if not self.config.resume and self.config.restore_from is None:
            return None
        return find_resume_checkpoint(self.ctx, self.root, self.config.restore_from)

    def load(self, directory: Path, state: TrainingState) -> Restored:
        """Restore model, optimizer, LR scheduler and extra state from ``directory`` in place.

        Raises:
            ValueError: the checkpoint was written with a different world size.
        """
        manifest = json.loads((directory / "manifest.json").read_text())
        meta = manifest["meta"]
        if meta["world_size"] != self.ctx.world_size:
            raise ValueError(
                f"{directory.name} was saved with world size {meta['world_size']}, this run has {self.ctx.world_size}; "
                "resuming under a different world size is not supported yet"
            )
        model_io.load_model(directory, state.model)
        if state.optimizer is not None:
            optim_io.load_optimizer(directory, state.model, state.optimizer, group=self.ctx.group)
        if state.lr_scheduler is not None:
            optim_io.load_lr_scheduler(directory, state.lr_scheduler)
        for key, obj in state.extra.items():
            obj.load_state_dict(json.loads((directory / EXTRA_DIR / f"{key}.json").read_text()))
        rank = self.ctx.rank
        data_file = directory / rank_file("dataloader", rank, ".json")
        self.last_saved_step = meta["global_step"]
        return Restored(
            directory=directory,
            step_scheduler=json.loads((directory / STEP_SCHEDULER).read_text()),
            data_position=read_data_position(data_file) if data_file.exists() else None,
            rng_file=directory / rank_file("rng", rank, ".safetensors"),
            meta=meta,
        )

    @staticmethod
    def restore_rng(restored: Restored) -> None:
        """Apply this rank's saved RNG state."""
        if restored.rng_file is not None:
            load_rng_state(restored.rng_file)


def _write_json(directory: Path, rel: str, obj: Any) -> list[str]:
    return _write_text(directory, rel, json.dumps(obj))


def _write_text(directory: Path, rel: str, text: str) -> list[str]:
    path = directory / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return [rel]


def _rng(directory: Path, rank: int) -> list[str]:
    rel = rank_file("rng", rank, ".safetensors")
    (directory / "rng").mkdir(exist_ok=True)
    save_rng_state(directory / rel)
    return [rel]


def _data(directory: Path, rank: int, loader: Any, batches_in_epoch: int) -> list[str]:
    rel = rank_file("dataloader", rank, ".json")
    (directory / "dataloader").mkdir(exist_ok=True)
    save_data_position(directory / rel, loader, batches_in_epoch)
    return [rel]
