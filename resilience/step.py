"""The step handed to the user's loop body by :class:`~resilience.loop.ResilientLoop`."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Step:
    """One training step handed to the user's loop body.

    ``global_step`` is the 1-based number of this optimizer step over the whole run;
    ``epoch`` is 0-based; ``batch_index`` is the 0-based index of ``batch`` within the epoch.
    """

    global_step: int
    epoch: int
    batch_index: int
    batch: Any
    is_val_step: bool = False
    """True when ``step_scheduler.val_every_steps`` divides ``global_step`` (NeMo AutoModel's name):
    validate in this step's body and ``log_validation`` the result (on every micro-batch of that
    optimizer step: validate where ``is_optimizer_step`` is also True)."""
    micro_step: int = 0
    """0-based index of ``batch`` within its optimizer step (``step_scheduler.gradient_accumulation_steps``)."""
    is_optimizer_step: bool = True
    """True on the last micro-batch of an optimizer step: call ``optimizer.step()`` (and the LR
    scheduler's) in this body; on the others only accumulate gradients (under DDP, inside
    ``model.no_sync()``). Always True without gradient accumulation."""
