"""Atomic, durable, validated checkpoints: layout, publish, write, read.

Names load lazily, so the torch-free modules here (layout, manifest, pointers, durable) serve
``resilience status``/``verify`` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Checkpointer": "resilience.checkpoint.checkpointer",
    "TrainingState": "resilience.checkpoint.checkpointer",
    "Restored": "resilience.checkpoint.checkpointer",
    "CheckpointInvalid": "resilience.checkpoint.manifest",
    "CheckpointNotFound": "resilience.checkpoint.reader",
    "CheckpointSaveError": "resilience.checkpoint.writer",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'resilience.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
