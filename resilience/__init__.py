"""resilience: Slurm-aware fault tolerance and preemption handling for PyTorch training.

Public names only; importing this package installs nothing (no signal handlers, no threads)
and imports torch only when a name that needs it is first used, so ``resilience run`` (the
launcher) starts in milliseconds and has its signal handlers in place before a Slurm warning
can arrive.
"""

from __future__ import annotations

from resilience.exit_codes import ExitCode
from resilience.lazy import lazy_getattr

_LAZY = {
    "resilient_loop": "resilience.loop",
    "ResilientLoop": "resilience.loop",
    "Step": "resilience.step",
    "load_config": "resilience.config",
    "ResilienceConfig": "resilience.config",
    "StepSchedulerConfig": "resilience.config",
    "CheckpointConfig": "resilience.config",
    "SlurmConfig": "resilience.config",
    "ConfigError": "resilience.config",
    "Checkpointer": "resilience.checkpoint",
    "TrainingState": "resilience.checkpoint",
    "CheckpointSaveError": "resilience.checkpoint",
    "CheckpointNotFound": "resilience.checkpoint",
    "CheckpointCorrupted": "resilience.checkpoint",
    "CheckpointInvalid": "resilience.checkpoint",
    "WorkerRNG": "resilience.state.worker_rng",
}

__all__ = ["ExitCode", *_LAZY]

__getattr__ = lazy_getattr(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return sorted(__all__)
