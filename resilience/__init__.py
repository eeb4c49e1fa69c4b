"""resilience: Slurm-aware fault tolerance and preemption handling for PyTorch training.

Public names only; importing this package installs nothing (no signal handlers, no threads).
"""

from resilience.checkpoint import (
    CheckpointInvalid,
    CheckpointNotFound,
    Checkpointer,
    CheckpointSaveError,
    TrainingState,
)
from resilience.config import (
    CheckpointConfig,
    ConfigError,
    ResilienceConfig,
    StepSchedulerConfig,
    load_config,
)
from resilience.exit_codes import ExitCode
from resilience.loop import ResilientLoop, Step, resilient_loop

__all__ = [
    "resilient_loop",
    "ResilientLoop",
    "Step",
    "ExitCode",
    "load_config",
    "ResilienceConfig",
    "StepSchedulerConfig",
    "CheckpointConfig",
    "ConfigError",
    "Checkpointer",
    "TrainingState",
    "CheckpointSaveError",
    "CheckpointNotFound",
    "CheckpointInvalid",
]
