"""The Lightning ``Callback`` that gives ``trainer.fit()`` the stop agreement, our saves and an exact resume.

The hooks, in Lightning's order (2.x ``_TrainingEpochLoop``):

* ``on_train_start`` (after ``setup_data()``, before the first batch): the train loaders are
  checked (:func:`~.loaders.check_train_loaders`: a ``ConfigError`` before any step), their
  iterator is created again where the checkpoint left it, workers shielded from the stop signals
  (:func:`~.loaders.restart_train_iterator`), and this rank's RNG states are restored.
* ``on_train_batch_end``: at the end of each optimizer step (``trainer.global_step`` moved: with
  ``accumulate_grad_batches`` not every batch) one agreement round, then the step is saved when a
  stop is agreed or ``ckpt_every_steps`` falls on it, where Lightning's own
  ``ModelCheckpoint(every_n_train_steps)`` saves: its loops resume such a checkpoint at the next
  batch (a validation due at the saved step is not run again). An agreed stop sets
  ``trainer.should_stop`` (and lifts ``min_epochs``/``min_steps``, which would ignore it): Lightning
  ends the step (a validation due at it) and the epoch's hooks, then ``fit()`` returns.
* ``on_train_epoch_end``: the save of a step that ended its epoch, deferred to here (where
  ``ModelCheckpoint`` saves at an epoch's end): Lightning resumes a checkpoint taken at the last
  batch's end with its epoch counters one short and without the next epoch's start hooks, one
  taken here at the next epoch.
* ``on_train_end``: the final save when training ended without a stop (the last step, or another
  callback's ``should_stop``).

Validation while fitting runs with the training RNG isolated (:mod:`~.validation`).
The LightningModule's own ``on_train_batch_end`` runs after the callbacks', so after the save:
state it changes there (an EMA update) is saved one step late, as with ``ModelCheckpoint``.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

from resilience.integrations.lightning.files import read_rank_state, write_lightning_checkpoint
from resilience.integrations.lightning.loaders import check_train_loaders, position_json, restart_train_iterator, train_loaders
from resilience.integrations.lightning.samplers import SamplerDraws
from resilience.integrations.lightning.settings import LightningSettings
from resilience.integrations.session import TrainerSession
from resilience.state.rng import capture_rng_state, load_rng_state

log = logging.getLogger("resilience")


def _epoch_ended(trainer: Any) -> bool:
    """Whether the last training batch was its epoch's last."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def _ends_training(trainer: Any) -> bool:
    """Whether the optimizer step that just ended is the last of training (``max_steps``, or the last
    batch of the last epoch): a stop agreed there is not a stop, the final save follows."""
    if trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps:
        return True
    return _epoch_ended(trainer) and trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs


class ResilienceCallback(Callback):
    """Stop agreement at step ends, the saves, and the exact resume (see the module docstring).

    Args:
        session: the run's :class:`~resilience.integrations.session.TrainerSession` (entered).
        settings: the reconciled settings (:func:`~resilience.integrations.lightning.settings.reconcile`).
    """

    def __init__(self, session: TrainerSession, settings: LightningSettings):
        self.session = session
        self.settings = settings
        self.stopped_at: int | None = None
        """The agreed stop step (not the last step of training), once agreed; the same on every rank."""
        self.ddp_model: Any = None
        """The strategy's wrapped model while training (DDP's, freed at exit in the safe order)."""
        self._own: tuple[Path, dict[str, Any]] | None = None  # this rank's state file and loader position
        self._last_step: int | None = None
        self._draws: list[SamplerDraws] = []  # per train loader: the generators its epoch's order was drawn from
        self._batch_epoch = 0  # the epoch of the last training batch (current_epoch counts an ended one at on_train_end)
        self._at_epoch_end: str | None = None  # the reason of a save deferred to the epoch's end

    def resume_from(self, directory: Path | None) -> None:
        """The checkpoint ``fit`` resumes (``None``: a fresh start); call before ``trainer.fit``. Under
        another world size than it was saved with, this rank's RNG and loader state are not restored
        (a warning): the data order of a DistributedSampler changes with the number of ranks anyway."""
        self._own = None
        if directory is None:
            return
        saved_world = self.session.resumed_meta.get("world_size")
        if saved_world is not None and saved_world != self.session.ctx.world_size:
            if self.session.ctx.rank == 0:
                log.warning("resuming a checkpoint of %s ranks on %s: RNG and data position are not restored exactly", saved_world, self.session.ctx.world_size)
            return
        self._own = read_rank_state(directory, self.session.ctx.rank)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        """Lightning's loader state in the ``.ckpt`` is rank 0's: dropped when this rank has its own (loaded in ``on_train_start``)."""
        if self._own is not None:
            checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).pop("combined_loader", None)

    def on_train_start(self, trainer, pl_module):
        """Loaders checked, the epoch's iterator where the checkpoint left it, RNG restored (see the module docstring)."""
        check_train_loaders(trainer)
        position = self._own[1] if self._own is not None else None
        rng = self._own[0] if self._own is not None else None
        self._draws = [SamplerDraws(loader) for loader in train_loaders(trainer)]

        def restore_rng() -> None:
            if rng is not None:
                load_rng_state(rng)

        restart_train_iterator(trainer, position, self.session.config.step_scheduler.signals, self._draws, restore_rng)
        self._last_step = trainer.global_step
        self.ddp_model = trainer.strategy.model
        self.session.training_started(trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        """RNG captured; at an optimizer step's end one agreement round, then the save and the stop it calls for."""
        self._batch_epoch = trainer.current_epoch
        step = trainer.global_step
        if step == self._last_step:
            return  # a batch whose gradients are accumulated: no optimizer step ended
        self._last_step = step
        final = _ends_training(trainer)
        if self.session.step_end(step) and not final and self.stopped_at is None:
            self.stopped_at = step
        every = self.settings.ckpt_every_steps
        reason = "preemption" if self.stopped_at == step else "periodic" if every and step % every == 0 and not final else None
        if reason and _epoch_ended(trainer):
            self._at_epoch_end = reason  # after the epoch's end: Lightning resumes such a checkpoint at the next epoch
        elif reason:
            self._save_and_agree(trainer, reason)
        if self.stopped_at == step:
            self._stop(trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        """The save of an epoch's last step, deferred to here (before the LightningModule's own
        ``on_train_epoch_end`` and the callbacks that monitor a metric, as ``ModelCheckpoint``'s)."""
        reason, self._at_epoch_end = self._at_epoch_end, None
        if reason:
            self._save_and_agree(trainer, reason)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        """Evaluation goes on: a heartbeat for ``resilience run``'s watchdog."""
        self.session.heartbeat()

    def on_train_end(self, trainer, pl_module):
        """Training ended without an agreed stop: the final save (unless this step is saved already)."""
        if self.stopped_at is None and self.session.saving and self.session.last_saved_step != trainer.global_step:
            self._save(trainer, "final")
        for draws in self._draws:
            draws.close()

    def _save_and_agree(self, trainer: Any, reason: str) -> None:
        """Save the step; after a periodic save one blocking agreement round: a stop that came during it ends training without a second save."""
        self._save(trainer, reason)
        if reason == "periodic" and self.session.agree_now():
            self.stopped_at = trainer.global_step
            self._stop(trainer)

    @staticmethod
    def _stop(trainer: Any) -> None:
        trainer.should_stop = True
        trainer.fit_loop.min_epochs, trainer.fit_loop.epoch_loop.min_steps = 0, None  # else Lightning would go on

    def _save(self, trainer: Any, reason: str) -> None:
        epoch, complete = self._batch_epoch, _epoch_ended(trainer)
        position = position_json(trainer, epoch=epoch, epoch_complete=complete, draws=self._draws)
        write = functools.partial(write_lightning_checkpoint, trainer=trainer, rng=capture_rng_state(), position=position)
        self.session.save(reason, write, step=trainer.global_step, epoch=epoch, epoch_complete=complete, meta={"optimizer_saved": True})
