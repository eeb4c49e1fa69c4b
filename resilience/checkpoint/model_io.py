"""Model weights as safetensors under ``model/``.

A replicated model (plain or DDP) is written once, by rank 0, as a single shard; keys are the
plain module FQNs (no ``module.`` prefix), via ``torch.distributed.checkpoint.state_dict``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from resilience.checkpoint.layout import model_shard_name

MODEL_DIR = "model"


def model_file() -> str:
    """Relative path of the single shard of a replicated model."""
    return f"{MODEL_DIR}/{model_shard_name(1, 1)}"


def save_model(staging: Path, model: torch.nn.Module) -> list[str]:
    """Write the model's weights; returns the relative paths written (the caller fsyncs)."""
    state = get_model_state_dict(model)
    tensors = {}
    seen: dict[tuple[int, int], str] = {}
    for key, value in state.items():
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        # safetensors refuses aliased storage (tied weights): store a copy of the second alias.
        alias = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if alias in seen or not tensor.is_contiguous():
            tensor = tensor.contiguous().clone()
        seen[alias] = key
        tensors[key] = tensor
    rel = model_file()
    (staging / MODEL_DIR).mkdir(exist_ok=True)
    save_file(tensors, str(staging / rel), metadata={"format": "pt"})
    return [rel]


def load_model(directory: Path, model: torch.nn.Module) -> None:
    """Load the weights into ``model`` in place (strict: missing or unexpected keys raise)."""
    state = load_file(str(directory / model_file()))
    set_model_state_dict(model, state)
