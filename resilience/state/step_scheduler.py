"""Where training is: epoch, batch within the epoch, global step; and when it ends."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StepScheduler:
    """Counters of a run. ``global_step`` counts optimizer steps completed (the first step is 1).

    ``batches_in_epoch`` counts loader batches of ``epoch`` already consumed (the data position;
    with gradient accumulation, micro-batches).
    Training ends after ``num_epochs`` epochs or ``max_steps`` steps, whichever comes first.
    """

    num_epochs: int
    max_steps: int | None = None
    epoch: int = 0
    batches_in_epoch: int = 0
    global_step: int = 0

    @property
    def done(self) -> bool:
        """True when no further step should run."""
        return self.epoch >= self.num_epochs or (self.max_steps is not None and self.global_step >= self.max_steps)

    def finish_step(self, batches: int = 1) -> None:
        """Count one completed optimizer step made of ``batches`` loader batches (micro-batches)."""
        self.global_step += 1
        self.batches_in_epoch += batches

    def at_last_batch(self, loader_length: int | None) -> bool:
        """True right after the last batch of the last epoch, for a loader of ``loader_length``
        batches (``None``, no length: it cannot tell before its iterator is exhausted)."""
        if self.epoch + 1 < self.num_epochs:
            return False
        return loader_length is not None and self.batches_in_epoch >= loader_length

    def finish_epoch(self) -> None:
        """Move to the next epoch's first batch.

        Raises:
            ValueError: the epoch ending had no batch: an empty dataloader, or a one-shot iterator
                (a generator) used up by an earlier epoch. Training would "finish" with no step and
                its final checkpoint would stop the next run from training too.
        """
        if self.batches_in_epoch == 0:
            raise ValueError(
                f"the dataloader yielded no batch in epoch {self.epoch}: an empty dataset, or a one-shot iterator (a generator) "
                "used up by an earlier epoch; pass a loader that can be iterated once per epoch (a DataLoader, a list)"
            )
        self.epoch += 1
        self.batches_in_epoch = 0

    def state_dict(self) -> dict[str, int]:
        """JSON-able counters (the limits come from the config, not the checkpoint)."""
        return {"epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch, "global_step": self.global_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the counters saved by :meth:`state_dict`."""
        self.epoch = int(state["epoch"])
        self.batches_in_epoch = int(state["batches_in_epoch"])
        self.global_step = int(state["global_step"])
