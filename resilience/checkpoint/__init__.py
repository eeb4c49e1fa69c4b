"""Atomic, durable, validated checkpoints: layout, publish, write, read.

Names load lazily, so the torch-free modules here (layout, manifest, pointers, durable) serve
``resilience status``/``verify`` without importing torch.
"""

from __future__ import annotations

from resilience.lazy import lazy_getattr

_LAZY = {
    "Checkpointer": "resilience.checkpoint.checkpointer",
    "SaveReason": "resilience.checkpoint.checkpointer",
    "TrainingState": "resilience.state.training_state",
    "Restored": "resilience.checkpoint.loading",
    "CheckpointInvalid": "resilience.checkpoint.storage.manifest",
    "CheckpointNotFound": "resilience.checkpoint.reader",
    "CheckpointCorrupted": "resilience.checkpoint.reader",
    "CheckpointSaveError": "resilience.checkpoint.writer",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY, globals())
