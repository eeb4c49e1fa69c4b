"""``TrainingState``: the objects of a training run that a checkpoint captures and restores."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass
class TrainingState:
    """The objects a checkpoint captures. Any may be ``None`` except ``model``.

    ``extra`` maps a name to any object with ``state_dict()``/``load_state_dict()`` whose state
    holds tensors, numbers, strings and containers of these (saved by rank 0 as
    ``extra/<name>.json`` plus ``extra/<name>.safetensors`` for its tensors).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None
    dataloader: Any = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    tokenizer: Any = None
    """A Hugging Face tokenizer (anything with ``save_pretrained``): its files go next to the model."""
