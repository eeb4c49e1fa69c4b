"""Configuration: ``kw_only`` dataclasses, YAML loading, dotted overrides, validation.

Section and key names follow NeMo AutoModel's YAML (``step_scheduler:``, ``checkpoint:``) so a
recipe written for it reads the same here. Sections this module does not know are the user's
(model, optimizer, data, ...) and are returned untouched in :attr:`ResilienceConfig.extra`;
a top-level name that is *close* to one of ours (``checkpont``) is an error, not a user section.

One module per section (:mod:`~resilience.config.step_scheduler`,
:mod:`~resilience.config.checkpoint`, :mod:`~resilience.config.slurm`), the whole
:class:`ResilienceConfig` in :mod:`~resilience.config.resilience_config`, reading YAML into it in
:mod:`~resilience.config.loading`, and :class:`ConfigError` with the checks every section uses in
:mod:`~resilience.config.checks`.
"""

from __future__ import annotations

from resilience.config.checkpoint import CheckpointConfig
from resilience.config.checks import ConfigError
from resilience.config.loading import apply_overrides, config_from_dict, load_config
from resilience.config.resilience_config import ResilienceConfig
from resilience.config.slurm import LAUNCHERS, REQUEUE_MODES, SlurmConfig
from resilience.config.step_scheduler import StepSchedulerConfig

__all__ = [
    "LAUNCHERS",
    "REQUEUE_MODES",
    "CheckpointConfig",
    "ConfigError",
    "ResilienceConfig",
    "SlurmConfig",
    "StepSchedulerConfig",
    "apply_overrides",
    "config_from_dict",
    "load_config",
]
