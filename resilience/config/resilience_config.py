""":class:`ResilienceConfig`: our sections together, plus the user's, and back to plain YAML data."""

from __future__ import annotations

import dataclasses
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
            section = dataclasses.asdict(getattr(self, name))
            if name == "step_scheduler" and isinstance(section["preemption_signal"], (list, tuple)):
                section["preemption_signal"] = [_yamlable(s) for s in section["preemption_signal"]]
            else:
                section = {k: _yamlable(v) for k, v in section.items()}
            out[name] = section
        out.update(self.extra)
        return out


def _yamlable(value: Any) -> Any:
    if hasattr(value, "name") and isinstance(value, int):  # signal.Signals
        return value.name
    return value
