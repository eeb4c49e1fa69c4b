"""Hugging Face ``Trainer`` integration: ``trainer.train()`` kept, preemption-safe and resumable.

::

    from resilience.integrations.transformers import train

    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=..., eval_dataset=...)
    sys.exit(train(trainer, "resilience.yaml"))     # 0 done, 75 preempted (requeue me), 76 restart guard

:func:`train` reads the same configuration as ``resilient_loop()`` (a YAML path, plain data or a
:class:`~resilience.config.ResilienceConfig`), reconciles it with the ``TrainingArguments``
(:mod:`~.settings`: one owner per setting, conflicts refused at setup), then on every rank:

1. installs the ``step_scheduler.preemption_signal`` handlers (they only record) and tells
   ``resilience run`` the rank is ready (a signal it held is delivered now);
2. finds the checkpoint to resume from under the checkpoint root (``LATEST``, every file's digest
   checked, an older one if it is corrupt), counts the start in the restart guard (exit 76);
3. runs ``trainer.train(resume_from_checkpoint=<it>)`` with :class:`ResilienceCallback` added and
   ``trainer._save_checkpoint`` pointed at :meth:`ResilienceCallback.save_checkpoint`: every rank
   agrees at each step end whether a stop was requested anywhere, and saves the agreed step;
4. returns 75 once that checkpoint is published on every rank, 0 when training ended.

Checkpoints are the Trainer's own files (:mod:`~.files`) published atomically as
``<root>/epoch_<E>_step_<S>/`` with our ``manifest.json`` (``meta.producer``:
``transformers.Trainer``), so ``resume_from_checkpoint=`` and ``from_pretrained()`` take them,
and ``resilience status``/``verify``/``advise`` read them. Supported: one process or DDP
(``torchrun``, ``accelerate launch``, ``resilience run``); not DeepSpeed or FSDP yet.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from resilience.config import ResilienceConfig
from resilience.exit_codes import ExitCode
from resilience.integrations.session import TrainerSession, resolve_config
from resilience.integrations.transformers.callback import ResilienceCallback
from resilience.integrations.transformers.settings import reconcile
from resilience.teardown import release_at_exit

__all__ = ["PRODUCER", "ResilienceCallback", "train"]

log = logging.getLogger("resilience")

PRODUCER = "transformers.Trainer"
"""``meta.producer`` of the checkpoints this integration writes."""


def train(trainer: Any, config: ResilienceConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None, **train_kwargs: Any) -> ExitCode:
    """Run ``trainer.train()`` preemption-safe, resuming from the checkpoint root's ``LATEST``; returns
    the exit code for ``sys.exit`` (see the module docstring). Call it on every rank.

    Args:
        trainer: a ``transformers.Trainer`` (or subclass), built; its process group (if any) is up.
        config: a YAML path, plain data in the YAML layout, a :class:`ResilienceConfig`, or ``None``.
        train_kwargs: passed to ``trainer.train()`` (``trial``, ``ignore_keys_for_eval``).

    Returns:
        ``ExitCode.DONE`` (0), ``PREEMPTED`` (75: the agreed step is published on every rank, or a stop
        came before the first step) or ``NO_PROGRESS`` (76: the restart guard refused this start).

    Raises:
        ConfigError: at setup, before any training: a setting of ours and of the ``TrainingArguments``
            that disagree, or one refused (see :mod:`~.settings`).
        TypeError: ``resume_from_checkpoint`` in ``train_kwargs`` (the resume point is ours to choose:
            ``checkpoint.restore_from`` names another).
        CheckpointNotFound: ``checkpoint.restore_from``/``load_path`` holds no valid checkpoint.
        CheckpointSaveError: a save failed on any rank (raised on every rank; ``LATEST`` unchanged).
    """
    import transformers

    if "resume_from_checkpoint" in train_kwargs:
        raise TypeError(
            "train(resume_from_checkpoint=...): the checkpoint to resume from is chosen under the checkpoint root (LATEST); "
            "set checkpoint.restore_from to name another"
        )
    settings = reconcile(resolve_config(config), trainer)
    session = TrainerSession(
        settings.config,
        producer=PRODUCER,
        producer_version=transformers.__version__,
        global_batch_size=settings.global_batch_size,
        trainer_settings=settings.recorded,
    )
    callback = ResilienceCallback(trainer, session, settings)
    trainer.add_callback(callback)
    trainer._save_checkpoint = callback.save_checkpoint  # every save of the Trainer goes through ours
    try:
        with session:
            resume = session.resume_point()
            if session.exit_code is not None:  # 76: the restart guard refused this start
                return session.exit_code
            if session.stop_before_start():  # a stop arrived during setup: 75, nothing to save
                return ExitCode.PREEMPTED
            trainer.train(resume_from_checkpoint=os.fspath(resume) if resume is not None else None, **train_kwargs)
            release_at_exit(trainer.model_wrapped)  # DDP's reducer, then the default group, freed at exit in the safe order
            return session.finish(stopped_at=callback.stopped_at)
    finally:
        trainer.remove_callback(callback)
        del trainer._save_checkpoint  # the class's own again
