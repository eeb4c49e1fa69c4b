"""The ``step_scheduler`` section: when to step, stop and save."""

from __future__ import annotations

import dataclasses
from typing import Any

from resilience.config.checks import ConfigError, check_bool, check_int
from resilience.stop.signals import DEFAULT_PREEMPTION_SIGNAL, parse_preemption_signal


@dataclasses.dataclass(kw_only=True)
class StepSchedulerConfig:
    """When to step, stop and save. YAML section ``step_scheduler`` (NeMo AutoModel names)."""

    num_epochs: int = 1
    """Epochs to train (default 1). Training ends at ``num_epochs`` or ``max_steps``, whichever first."""
    max_steps: int | None = None
    """Optimizer steps to train in total, or null for no step limit (default null)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (default 1). The loop yields one :class:`~resilience.loop.Step`
    per micro-batch; ``Step.is_optimizer_step`` marks the last one of each optimizer step (the body
    steps the optimizer then). ``global_step`` and every ``*_every_steps`` count optimizer steps,
    and checkpoints, stops and the data position fall only between optimizer steps. An epoch whose
    batch count is not a multiple ends with a shorter optimizer step (Lightning's rule)."""
    ckpt_every_steps: int | None = None
    """Save every N global steps (default null: save only at the end and on preemption)."""
    preemption_signal: Any = DEFAULT_PREEMPTION_SIGNAL
    """Signal(s) that request a stop-and-save: a name, a number, a list, or null (default SIGTERM)."""
    agreement_every_steps: int | str = "auto"
    """Cadence, in steps, of the non-blocking cross-rank stop agreement: an int >= 1, or ``auto`` (the default).
    A signal stops every rank within 2 x this many steps; larger values make the per-step cost
    (about one small gloo all-reduce, ~0.2-0.3 ms) smaller. ``auto`` starts at 1 and follows
    rank 0's measured step time so that a round runs about every ``agreement_interval_s``:
    for short steps, a per-step cost under 1 % and a stop within about twice that interval."""
    agreement_interval_s: float = 0.5
    """With ``agreement_every_steps: auto``, the target time between agreement rounds, in seconds.
    Default 0.5: a stop within 1 s of the signal (2k - 1 steps of a k-step interval), and the
    agreement's cost under 1 % of a 3 ms step on 2 busy cores by ``make bench``'s direct figure
    (+0.7 % [+0.6, +0.9]; 0.25 s read +0.9 % [+0.7, +1.1], 0.1 s 1.1-1.7 %)."""
    agreement_nodes: str = "auto"
    """How a stop-agreement round combines the ranks: ``auto`` (default) runs it on node-local groups
    plus a group of node leaders when the launcher's environment (``GROUP_RANK``, ``SLURM_NODEID``)
    puts the ranks on 2+ nodes with 2+ ranks on a node (about ``3(L-1) + 2(N/L-1)`` sequential hops
    instead of gloo's ring of ``2(N-1)``), else one all-reduce; ``flat``: always one all-reduce."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all ranks (MindSpore ``training.global_batch_size``); default null:
    the loader's batch size summed over the ranks (null when it cannot be read). Recorded in each
    checkpoint; resuming with a different value continues the epoch at the next unseen sample, or is
    refused (exit 2) when the samples consumed are not a whole number of new batches. ``global_step``
    keeps counting optimizer steps either way (see :mod:`resilience.state.batch_size`)."""
    val_every_steps: int | None = None
    """Validate every N global steps: sets ``Step.is_val_step`` for the training loop (default null)."""
    wall_time_s: float | None = None
    """This run's wall time in seconds from its start, for deadline stopping outside Slurm (default
    null: inside a Slurm job the end time comes from ``scontrol show job``)."""
    deadline_stop: bool = True
    """Stop and save by ourselves when the time left before the job's end no longer covers the
    steps a stop may still take plus one save, times ``deadline_safety`` (default true)."""
    deadline_safety: float = 1.5
    """Safety factor on (steps until an agreed stop + one save) for deadline stopping and the
    lead-time warning (default 1.5)."""

    @property
    def fixed_agreement_every_steps(self) -> int | None:
        """The cadence ``agreement_every_steps`` fixes, in steps, or ``None`` for ``auto`` (validated: an int >= 1 otherwise)."""
        return None if self.agreement_every_steps == "auto" else int(self.agreement_every_steps)

    def __post_init__(self) -> None:
        if self.wall_time_s is not None and (isinstance(self.wall_time_s, bool) or not isinstance(self.wall_time_s, (int, float)) or self.wall_time_s <= 0):
            raise ConfigError(f"step_scheduler.wall_time_s: expected seconds > 0 or null, got {self.wall_time_s!r}")
        check_bool("step_scheduler.deadline_stop", self.deadline_stop)
        if isinstance(self.deadline_safety, bool) or not isinstance(self.deadline_safety, (int, float)) or self.deadline_safety < 1:
            raise ConfigError(f"step_scheduler.deadline_safety: expected a number >= 1, got {self.deadline_safety!r}")
        check_int("step_scheduler.global_batch_size", self.global_batch_size, minimum=1, allow_none=True)
        check_int("step_scheduler.val_every_steps", self.val_every_steps, minimum=1, allow_none=True)
        check_int("step_scheduler.num_epochs", self.num_epochs, minimum=1)
        check_int("step_scheduler.max_steps", self.max_steps, minimum=1, allow_none=True)
        check_int("step_scheduler.gradient_accumulation_steps", self.gradient_accumulation_steps, minimum=1)
        check_int("step_scheduler.ckpt_every_steps", self.ckpt_every_steps, minimum=1, allow_none=True)
        if self.agreement_every_steps != "auto":
            try:
                check_int("step_scheduler.agreement_every_steps", self.agreement_every_steps, minimum=1)
            except ConfigError as exc:
                raise ConfigError(f"{exc}; accepted: an integer >= 1 or auto") from None
        if isinstance(self.agreement_interval_s, bool) or not isinstance(self.agreement_interval_s, (int, float)) or self.agreement_interval_s <= 0:
            raise ConfigError(f"step_scheduler.agreement_interval_s: expected seconds > 0, got {self.agreement_interval_s!r}")
        if self.agreement_nodes not in ("auto", "flat"):
            raise ConfigError(f"step_scheduler.agreement_nodes: {self.agreement_nodes!r}; accepted: auto, flat")
        # Parsed now so a bad spec fails at config time, before any training; re-raised as
        # ConfigError so callers need to catch one type for every bad value.
        try:
            self.signals = parse_preemption_signal(self.preemption_signal, key="step_scheduler.preemption_signal")
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from exc
