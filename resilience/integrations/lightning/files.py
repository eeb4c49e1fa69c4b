"""A Lightning checkpoint as our files: ``trainer.save_checkpoint`` into the staging directory, and
one small state file per rank for what Lightning does not save.

::

    checkpoint.ckpt                       trainer.save_checkpoint(): model, optimizers, LR schedulers,
                                          loops, callbacks, precision plugin (rank 0 writes it)
    rank_state/rank_<R>.safetensors       rank R: its RNG states (Python, NumPy, torch CPU and CUDA),
                                          and its train loaders' state_dict() as JSON in the header

Lightning saves no RNG state and only rank 0's loader state (:mod:`~.loaders`); the rank state
file is the library's own (:func:`~resilience.state.rng.write_rng_state`), so nothing in it is
unpickled. ``Model.load_from_checkpoint(DIR / "checkpoint.ckpt")`` and
``trainer.fit(ckpt_path=...)`` read the ``.ckpt`` as any of Lightning's own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from resilience.checkpoint.layout import RANK_STATE_DIR, rank_state_file
from resilience.state.rng import read_data_position_text, write_rng_state

RNGState = tuple[dict[str, torch.Tensor], dict[str, str]]
"""A :func:`~resilience.state.rng.capture_rng_state` snapshot."""

CKPT = "checkpoint.ckpt"
"""The ``.ckpt`` file Lightning writes, in each checkpoint directory."""


def write_lightning_checkpoint(staging: Path, trainer: Any, *, rng: RNGState, position: str) -> list[str]:
    """Write the checkpoint of ``trainer``'s current step into ``staging`` on this rank; returns the
    files this rank wrote (relative paths): rank 0 the ``.ckpt`` and its rank state file, another rank
    its rank state file. ``rng`` (:func:`~resilience.state.rng.capture_rng_state`) and ``position``
    (this rank's loader states, :func:`~.loaders.position_json`): captured right after the step.
    A collective (``trainer.save_checkpoint`` ends with a barrier)."""
    trainer.save_checkpoint(staging / CKPT, weights_only=False)  # every rank calls it; the strategy writes on rank 0
    rank = trainer.global_rank
    (staging / RANK_STATE_DIR).mkdir(exist_ok=True)
    write_rng_state(staging / rank_state_file(rank), rng, data_position=position)
    return ([CKPT] if trainer.is_global_zero else []) + [rank_state_file(rank)]


def read_rank_state(directory: Path, rank: int) -> tuple[Path, dict[str, Any]] | None:
    """This rank's state file in checkpoint ``directory`` and its loader position, or ``None`` when the
    checkpoint has none for ``rank`` (written under fewer ranks)."""
    path = directory / rank_state_file(rank)
    if not path.is_file():
        return None
    text = read_data_position_text(path)
    return path, (json.loads(text) if text else {})
