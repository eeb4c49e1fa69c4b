"""Atomic, durable, validated checkpoints: layout, publish, write, read."""

from resilience.checkpoint.checkpointer import Checkpointer, Restored, TrainingState
from resilience.checkpoint.manifest import CheckpointInvalid
from resilience.checkpoint.reader import CheckpointNotFound
from resilience.checkpoint.writer import CheckpointSaveError

__all__ = ["Checkpointer", "TrainingState", "Restored", "CheckpointInvalid", "CheckpointNotFound", "CheckpointSaveError"]
