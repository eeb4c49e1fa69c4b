""":class:`ResilienceConfig`: our sections together, plus the user's, and back to plain YAML data."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from resilience.config.checkpoint import CheckpointConfig
from resilience.config.slurm import SlurmConfig
from resilience.config.step_scheduler import StepSchedulerConfig

#: Our YAML sections by name, in the order :meth:`ResilienceConfig.to_dict` writes them.
SECTIONS: dict[str, type] = {
    "step_scheduler": StepSchedulerConfig,
    "checkpoint": CheckpointConfig,
    "slurm": SlurmConfig,
}


@dataclasses.dataclass(kw_only=True)
class ResilienceConfig:
    """The whole configuration: our sections plus the user's own sections in ``extra``."""

    step_scheduler: StepSchedulerConfig = dataclasses.field(default_factory=StepSchedulerConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    slurm: SlurmConfig = dataclasses.field(default_factory=SlurmConfig)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Top-level sections that are not ours (model, optimizer, data, ...), as plain YAML data."""

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain YAML-able data (what ``config.yaml`` in a checkpoint holds)."""
        out: dict[str, Any] = {}
        for name in SECTIONS:
            out[name] = {k: _yamlable(v) for k, v in dataclasses.asdict(getattr(self, name)).items()}
        out.update(self.extra)
        return out


def _yamlable(value: Any) -> Any:
    """``value`` as YAML data: a signal (``signal.Signals``, an int enum) by its name, a list of them item by item."""
    if isinstance(value, enum.IntEnum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_yamlable(v) for v in value]
    return value
