"""Gradient accumulation: an epoch's batches grouped into optimizer steps.

``step_scheduler.gradient_accumulation_steps`` = A makes each optimizer step A micro-batches
(the loader's batches). The loop yields one :class:`~resilience.loop.Step` per micro-batch and
does everything that needs a consistent state (stop agreement, checkpoints, data position,
deadlines) only after the last micro-batch of an optimizer step, so a checkpoint never holds a
half-accumulated gradient and a resume starts at the first micro-batch of the next step.

An epoch whose batch count is not a multiple of A ends with a shorter optimizer step (its last
batch is the optimizer step, as in Lightning's ``accumulate_grad_batches``).

With Accelerate, ``accelerator.accumulate(model)`` decides when the optimizer really steps
(``sync_gradients``): :func:`check_accumulation` requires the Accelerator's
``gradient_accumulation_steps`` to equal A, and a loader with a length is never drawn ahead, so
Accelerate still sees the end of its loader on the epoch's tail step, as in a loop of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from resilience.config.checks import ConfigError
from resilience.state.data_position import loader_length

_END = object()


def micro_batches(iterator: Iterator[Any], accumulation: int, left: int | None = None) -> Iterator[tuple[int, bool, Any]]:
    """``(micro_step, is_optimizer_step, batch)`` for each batch of ``iterator``.

    ``micro_step`` is the 0-based index of the batch within its optimizer step;
    ``is_optimizer_step`` is True on the last batch of each group of ``accumulation`` batches
    and on the epoch's last batch. ``left``: the batches the epoch still holds (see
    :func:`batches_left`), which tells the last one; ``None`` (no length) draws the next batch of
    the same group before handing this one out to know it (never the first batch of the next
    group, so a loader's state captured between optimizer steps holds no batch of the next).
    With ``accumulation`` 1 every batch is an optimizer step and nothing is drawn ahead.
    """
    if left is not None:
        for index, batch in enumerate(iterator):
            micro = index % accumulation
            yield micro, micro == accumulation - 1 or index >= left - 1, batch
        return
    while (batch := next(iterator, _END)) is not _END:
        for micro in range(accumulation):
            following = _END if micro == accumulation - 1 else next(iterator, _END)
            yield micro, following is _END, batch
            if following is _END:
                break
            batch = following


def batches_left(loader: Any, consumed: int) -> int | None:
    """Batches of the epoch after the ``consumed`` ones: from ``len(loader)``; ``None`` for a loader
    without a length or over an iterable dataset (whose length may not be what it yields)."""
    if isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset):
        return None
    length = loader_length(loader)
    return None if length is None else length - consumed


def check_accumulation(accumulation: int, optimizer: Any) -> None:
    """Refuse an Accelerate optimizer whose Accelerator accumulates another number of micro-batches.

    Raises:
        ConfigError: ``optimizer`` is an ``accelerate`` ``AcceleratedOptimizer`` whose
            ``gradient_state.num_steps`` differs from ``step_scheduler.gradient_accumulation_steps``:
            the loop would save and stop between micro-batches of Accelerate's optimizer step,
            losing the half-accumulated gradient, silently.
    """
    state = getattr(optimizer, "gradient_state", None) if type(optimizer).__module__.startswith("accelerate") else None
    steps = getattr(state, "num_steps", None)
    if isinstance(steps, int) and steps != accumulation:
        raise ConfigError(
            f"step_scheduler.gradient_accumulation_steps: {accumulation}, but the Accelerator accumulates {steps} micro-batches "
            f"(Accelerator(gradient_accumulation_steps={steps})): set step_scheduler.gradient_accumulation_steps to {steps}, so "
            "checkpoints and stops fall between whole optimizer steps, and keep accelerator.accumulate(model) in the body"
        )
