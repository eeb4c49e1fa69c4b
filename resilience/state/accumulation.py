"""Gradient accumulation: an epoch's batches grouped into optimizer steps.

``step_scheduler.gradient_accumulation_steps`` = A makes each optimizer step A micro-batches
(the loader's batches). The loop yields one :class:`~resilience.loop.Step` per micro-batch and
does everything that needs a consistent state (stop agreement, checkpoints, data position,
deadlines) only after the last micro-batch of an optimizer step, so a checkpoint never holds a
half-accumulated gradient and a resume starts at the first micro-batch of the next step.

An epoch whose batch count is not a multiple of A ends with a shorter optimizer step (its last
batch is the optimizer step, as in Lightning's ``accumulate_grad_batches``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

_END = object()


def micro_batches(iterator: Iterator[Any], accumulation: int) -> Iterator[tuple[int, bool, Any]]:
    """``(micro_step, is_optimizer_step, batch)`` for each batch of ``iterator``.

    ``micro_step`` is the 0-based index of the batch within its optimizer step;
    ``is_optimizer_step`` is True on the last batch of each group of ``accumulation`` batches
    and on the epoch's last batch. To know that a batch is the epoch's last, the next batch of
    the same group is drawn before this one is handed out; the first batch of the next group
    never is, so a loader's state captured between optimizer steps holds no batch of the next.
    With ``accumulation`` 1 every batch is an optimizer step and nothing is drawn ahead.
    """
    while (batch := next(iterator, _END)) is not _END:
        for micro in range(accumulation):
            following = _END if micro == accumulation - 1 else next(iterator, _END)
            yield micro, following is _END, batch
            if following is _END:
                break
            batch = following
