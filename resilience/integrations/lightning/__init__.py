"""Lightning ``Trainer`` integration: ``trainer.fit()`` kept, preemption-safe and resumable.

::

    from resilience.integrations.lightning import fit

    trainer = lightning.Trainer(strategy="ddp", devices=2, max_epochs=3, ...)
    sys.exit(fit(trainer, model, "resilience.yaml", train_dataloaders=loader))   # 0 done, 75 preempted, 76 restart guard

:func:`fit` reads the same configuration as ``resilient_loop()``, reconciles it with the ``Trainer``
(:mod:`~.settings`: one owner per setting, conflicts refused at setup), then on every rank:

1. turns Lightning's own signal handling off for the run (its SIGTERM handler and ``SLURMEnvironment``
   auto-requeue: :func:`~.settings.lightning_signals_off`), installs the
   ``step_scheduler.preemption_signal`` handlers (they only record) and tells ``resilience run`` the
   rank is ready;
2. finds the checkpoint to resume from under the checkpoint root (``LATEST``, every file's digest
   checked, an older one if it is corrupt), counts the start in the restart guard (exit 76);
3. runs ``trainer.fit(model, ckpt_path=<its checkpoint.ckpt>)`` with :class:`ResilienceCallback`
   added: train loaders checked before the first step, each rank's loader state and RNG restored,
   an agreement round at every optimizer step's end, the agreed step saved;
4. returns 75 once that checkpoint is published on every rank, 0 when training ended.

Checkpoints are ``trainer.save_checkpoint``'s ``.ckpt`` plus one state file per rank (:mod:`~.files`),
published atomically as ``<root>/epoch_<E>_step_<S>/`` with our ``manifest.json`` (``meta.producer``:
``lightning.Trainer``). Supported: one device, or DDP with ranks started by ``resilience run``,
``torchrun`` or ``srun``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from resilience.config import ResilienceConfig
from resilience.exit_codes import ExitCode
from resilience.integrations.lightning.callback import ResilienceCallback
from resilience.integrations.lightning.files import CKPT
from resilience.integrations.lightning.settings import lightning_signals_off, reconcile
from resilience.integrations.lightning.validation import validation_rng_isolated
from resilience.integrations.session import TrainerSession, resolve_config
from resilience.teardown import release_at_exit

__all__ = ["CKPT", "PRODUCER", "ResilienceCallback", "fit"]

log = logging.getLogger("resilience")

PRODUCER = "lightning.Trainer"
"""``meta.producer`` of the checkpoints this integration writes."""


def fit(trainer: Any, model: Any, config: ResilienceConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None, **fit_kwargs: Any) -> ExitCode:
    """Run ``trainer.fit(model, ...)`` preemption-safe, resuming from the checkpoint root's ``LATEST``;
    returns the exit code for ``sys.exit`` (see the module docstring). Call it on every rank.

    Args:
        trainer: a ``lightning.pytorch.Trainer``, built (its process group need not be up yet).
        model: the ``LightningModule``.
        config: a YAML path, plain data in the YAML layout, a :class:`ResilienceConfig`, or ``None``.
        fit_kwargs: passed to ``trainer.fit`` (``train_dataloaders``, ``val_dataloaders``,
            ``datamodule``, ``weights_only``).

    Returns:
        ``ExitCode.DONE`` (0), ``PREEMPTED`` (75: the agreed step is published on every rank, or a stop
        came before the first step) or ``NO_PROGRESS`` (76: the restart guard refused this start).

    Raises:
        ConfigError: a setting of ours and of the ``Trainer`` that disagree, or one refused
            (:mod:`~.settings`), at setup; a train loader that cannot resume mid-epoch
            (:func:`~.loaders.check_train_loaders`), before the first step.
        TypeError: ``ckpt_path`` in ``fit_kwargs`` (the resume point is ours to choose:
            ``checkpoint.restore_from`` names another).
        CheckpointNotFound: ``checkpoint.restore_from``/``load_path`` holds no valid checkpoint.
        CheckpointSaveError: a save failed on any rank (raised on every rank; ``LATEST`` unchanged).
    """
    import lightning

    if "ckpt_path" in fit_kwargs:
        raise TypeError("fit(ckpt_path=...): the resume point is chosen under the checkpoint root (LATEST); set checkpoint.restore_from to name another")
    settings = reconcile(resolve_config(config), trainer)
    if trainer.world_size > 1:
        trainer.strategy.setup_environment()  # Lightning's own process group, up now: the session's group is made from it
    session = TrainerSession(settings.config, producer=PRODUCER, producer_version=lightning.__version__, trainer_settings=settings.recorded)
    callback = ResilienceCallback(session, settings)
    with (
        lightning_signals_off(trainer, rank=session.ctx.rank),
        _callbacks_for_run(trainer, callback, settings.default_checkpoint),
        validation_rng_isolated(trainer),
        session,
    ):
        resume = session.resume_point()
        if session.exit_code is not None:  # 76: the restart guard refused this start
            return session.exit_code
        if session.stop_before_start():  # a stop arrived during setup: 75, nothing to save
            return ExitCode.PREEMPTED
        callback.resume_from(resume)
        trainer.fit(model, ckpt_path=os.fspath(resume / CKPT) if resume is not None else None, **fit_kwargs)
        release_at_exit(callback.ddp_model)  # DDP's reducer, then the default group, freed at exit in the safe order
        return session.finish(stopped_at=callback.stopped_at)


@contextlib.contextmanager
def _callbacks_for_run(trainer: Any, callback: ResilienceCallback, default_checkpoint: Any) -> Iterator[None]:
    """``callback`` in ``trainer.callbacks`` and the Trainer's default ``ModelCheckpoint`` out of it, for the run."""
    trainer.callbacks = [cb for cb in trainer.callbacks if cb is not default_checkpoint] + [callback]
    if default_checkpoint is not None and trainer.global_rank == 0:
        log.info("the Trainer's default ModelCheckpoint is off for this run: the integration's checkpoints replace it")
    try:
        yield
    finally:
        trainer.callbacks = [cb for cb in trainer.callbacks if cb is not callback] + ([default_checkpoint] if default_checkpoint is not None else [])
