"""The ``TrainerCallback`` that gives ``trainer.train()`` the stop agreement and our saves.

When the Trainer saves (``_maybe_log_save_evaluate``: after the step's logging and evaluation,
exactly where its own ``save_steps`` checkpoints are taken, which resume bitwise), it calls
``trainer._save_checkpoint``; :func:`~resilience.integrations.transformers.train` points that at
:meth:`ResilienceCallback.save_checkpoint`, which writes the same files through our atomic path.
So every save goes through it: the Trainer's own ``save_strategy`` saves, ours
(``ckpt_every_steps`` with ``save_strategy="no"``), the preemption save and the final one.

The hooks, in the Trainer's order (transformers 5.x ``Trainer._run_epoch``):

* ``on_step_end`` (every optimizer step, after ``global_step`` counts it): one agreement round.
  An agreed stop sets ``should_training_stop`` and ``should_save``, so the Trainer finishes the
  step (its logging and evaluation of that step), saves it, and leaves its loops.
* A save that falls on the last step of an epoch (or of training) is taken in ``on_epoch_end``
  instead, after the epoch's own logging and evaluation (``*_strategy="epoch"``): a resume from
  it starts the next epoch, and must not find that epoch's end undone.
* ``on_evaluate``: the eval metric that ``LOWEST_VAL`` follows; ``on_prediction_step``: a heartbeat
  for ``resilience run``'s watchdog during a long evaluation.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

from transformers import TrainerCallback

from resilience.checkpoint.layout import checkpoint_name
from resilience.integrations.session import TrainerSession
from resilience.integrations.transformers.files import write_trainer_checkpoint
from resilience.integrations.transformers.settings import TrainerSettings
from resilience.state.worker_signals import shield_dataloader_workers

log = logging.getLogger("resilience")


def _epoch_ended(state: Any) -> bool:
    """Whether the step just ended finished its epoch: the Trainer sets ``state.epoch`` to
    ``epoch + (step + 1) / steps_in_epoch``, a whole number exactly at an epoch's last batch."""
    return float(state.epoch).is_integer()


class ResilienceCallback(TrainerCallback):
    """Stop agreement at step ends, the timing of saves, and the save itself (see the module docstring).

    Args:
        trainer: the ``transformers.Trainer`` it is added to.
        session: the run's :class:`~resilience.integrations.session.TrainerSession` (entered).
        settings: the reconciled settings (:func:`~resilience.integrations.transformers.settings.reconcile`).
    """

    def __init__(self, trainer: Any, session: TrainerSession, settings: TrainerSettings):
        self.trainer = trainer
        self.session = session
        self.settings = settings
        self.stopped_at: int | None = None
        """The agreed stop step (not the last step of training), once agreed; the same on every rank."""
        self._save_at_epoch_end = False
        self._metric_missing_warned = False

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        """Training starts (or resumes at ``state.global_step``): progress report, deadline, and the
        loader's workers shielded from the preemption signals (they must outlive the save)."""
        self.session.training_started(state.global_step)
        shield_dataloader_workers(train_dataloader, self.session.config.step_scheduler.signals)

    def on_step_end(self, args, state, control, **kwargs):
        """One agreement round; then whether and when this step is saved."""
        step = state.global_step
        final = step >= state.max_steps
        if self.session.step_end(step) and not final and self.stopped_at is None:
            self.stopped_at = step
            control.should_training_stop = True
        every = self.settings.ckpt_every_steps
        wanted = control.should_save or self.stopped_at == step or final or bool(every and step % every == 0)
        if wanted and (final or _epoch_ended(state)):
            control.should_save, self._save_at_epoch_end = False, True  # after the epoch's own log and evaluation
        else:
            control.should_save = wanted

    def on_epoch_end(self, args, state, control, **kwargs):
        """The save deferred to the epoch's end. After a stop saved mid-epoch nothing more runs (its
        epoch did not end). A step that ends training unsaved is saved now: another callback ended
        training (early stopping: the final save), or cancelled the stop's save in the step."""
        stopped_mid_epoch = self.stopped_at is not None and not self._save_at_epoch_end
        if stopped_mid_epoch:
            control.should_evaluate = control.should_log = False
        unsaved = self.session.saving and self.session.last_saved_step != state.global_step
        control.should_save = self._save_at_epoch_end or (unsaved and control.should_training_stop) or (control.should_save and not stopped_mid_epoch)
        self._save_at_epoch_end = False

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        """Record the eval metric ``LOWEST_VAL`` follows (``settings.metric_key``) for this step's checkpoint."""
        key = self.settings.metric_key
        value = (metrics or {}).get(key)
        if value is None:
            if not self._metric_missing_warned:
                log.warning("LOWEST_VAL: the evaluation returned no %s (it has %s); set checkpoint.best_metric_key", key, sorted(metrics or {}))
                self._metric_missing_warned = True
            return
        self.session.record_validation(state.global_step, {key: value})

    def on_prediction_step(self, args, state, control, **kwargs):
        """Evaluation goes on: a heartbeat for ``resilience run``'s watchdog."""
        self.session.heartbeat()

    def save_checkpoint(self, model: Any, trial: Any = None) -> None:
        """``Trainer._save_checkpoint``'s replacement: the Trainer's checkpoint of this step,
        published atomically under the checkpoint root (a collective). After a periodic save, one
        blocking agreement round: a stop that came during it ends training without a second save."""
        state = self.trainer.state
        step = state.global_step
        if self.session.last_saved_step == step:
            return  # this step is saved already (the checkpoint resumed from, or a save an instant ago)
        ended = step >= state.max_steps or (self.trainer.control.should_training_stop and self.stopped_at is None)
        reason = "final" if ended else "preemption" if self.stopped_at == step else "periodic"
        epoch = max(0, math.ceil(state.epoch) - 1)  # the epoch the step ran in (0-based)
        final_dir = self.session.root / checkpoint_name(epoch, step)
        write = functools.partial(write_trainer_checkpoint, trainer=self.trainer, final_dir=final_dir)
        self.session.save(reason, write, step=step, epoch=epoch, epoch_complete=_epoch_ended(state), meta={"optimizer_saved": True})
        if reason == "periodic" and self.session.agree_now():
            self.stopped_at = step
            self.trainer.control.should_training_stop = True
