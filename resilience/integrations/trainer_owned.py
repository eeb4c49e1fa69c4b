"""The ``step_scheduler`` keys a trainer owns: set in our config too, they must agree with the trainer's."""

from __future__ import annotations

import math
from typing import Any

from resilience.config import ConfigError, StepSchedulerConfig


def is_set(value: Any, default: Any) -> bool:
    """Whether a config value was set by the user: not ``None`` and not the field's default."""
    return value is not None and value != default


def refuse_disagreements(sched: StepSchedulerConfig, owned: dict[str, tuple[str, Any]]) -> None:
    """Check each ``step_scheduler`` key in ``owned`` (``{key: (the trainer's name for it, its value or None)}``):
    one the user set (:func:`is_set`) must equal the trainer's value (numbers compared with ``math.isclose``:
    ``TrainingArguments.num_train_epochs`` is a float).

    Raises:
        ConfigError: the first key that disagrees, naming both settings; the trainer owns it.
    """
    defaults = StepSchedulerConfig()
    for key, (name, theirs) in owned.items():
        ours = getattr(sched, key)
        if is_set(ours, getattr(defaults, key)) and not (theirs is not None and math.isclose(float(ours), float(theirs))):
            raise ConfigError(f"step_scheduler.{key}={ours} and the Trainer's {name}={theirs} disagree: the Trainer owns it; remove step_scheduler.{key}")
