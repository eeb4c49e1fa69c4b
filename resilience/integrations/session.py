"""The shared core of trainer integrations: what ``resilient_loop()`` gives a custom loop, for a
trainer that keeps its own loop (Hugging Face's ``Trainer``, Lightning's ``Trainer``).

A :class:`TrainerSession` holds, for one training run on every rank:

* the stop side: the config's ``step_scheduler.preemption_signal`` recorded by handlers that only
  record (:class:`~resilience.stop.signals.SignalRecorder`), the ready handshake with ``resilience run``
  (a stop signal the launcher held, or a stop file, reaches the run:
  :func:`~resilience.stop.handshake.mark_ready_and_check_stop`), the job's deadline, and the
  non-blocking cross-rank agreement at step ends (:class:`~resilience.stop.agreement.StopAgreement`),
  so every rank stops after the same step;
* the save side: the trainer's own files, written by the trainer's own code into our staging
  directory, published by :class:`~resilience.checkpoint.checkpointer.Checkpointer` exactly as a
  loop's checkpoint is (fsync, digests, manifest written last, rename, ``LATEST``; ``LOWEST_VAL``,
  retention, lineage), under ``epoch_<E>_step_<S>/`` with the trainer's layout inside;
* the start: the checkpoint to resume from (``LATEST``, ``restore_from`` or ``load_path``, each
  file's digest checked first, falling back to an older one when they differ) and the
  requeue-loop guard (exit 76), then the exit code (75 after the stop's checkpoint is published
  on every rank, 0 when training ended).

How an integration uses it (every call on every rank, in the same order)::

    session = TrainerSession(config, producer="lightning.Trainer")    # collective; ConfigError here
    with session:                                   # handlers record; the rank is ready for resilience run
        resume = session.resume_point()             # a verified checkpoint directory, or None
        if session.exit_code is not None:           # 76: the restart guard refused this start
            return session.exit_code
        if session.stop_before_start():             # a stop arrived during setup: 75, nothing to save
            return ExitCode.PREEMPTED
        session.training_started(step_resumed)      # then the trainer runs (resuming from ``resume``)
        # at the end of each optimizer step (before the trainer's own logging / eval / save):
        if session.step_end(global_step):           # agreed: every rank stops after this step
            ...                                     # let the trainer finish the step, then save it:
        session.save("preemption", write, step=S, epoch=E, epoch_complete=False)  # write(staging) -> own files
        return session.finish(stopped_at=S)         # 75 (or finish() -> 0 when training ended)

``write(staging_dir)`` runs on every rank and returns the files this rank wrote (paths relative to
``staging_dir``); each file is returned by the rank that wrote it only, and is fsync'd and
digested by it (:func:`~resilience.checkpoint.parts.external_parts`). A save is synchronous:
training waits for it. Keys of the ``checkpoint`` section that act only on ``resilient_loop()``'s
own format are refused (:func:`check_external`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from resilience.announce import announce
from resilience.checkpoint import Checkpointer, SaveReason
from resilience.checkpoint.parts import external_parts
from resilience.checkpoint.policy import progress_guard
from resilience.checkpoint.storage.object_store import is_object_url
from resilience.config import CheckpointConfig, ConfigError, ResilienceConfig, config_from_dict, load_config
from resilience.distributed import DistContext, collective_timeout_s
from resilience.exit_codes import ExitCode
from resilience.failure_note import note_failure
from resilience.loop import STOP_DEADLINE, STOP_PREEMPTION
from resilience.parent_death import die_with_launcher
from resilience.progress import ProgressReporter
from resilience.slurm.job import run_id_from_env, signal_reach_warning
from resilience.state.step_scheduler import StepScheduler
from resilience.stop.agreement import StopAgreement
from resilience.stop.deadline import Deadline
from resilience.stop.handshake import mark_ready_and_check_stop
from resilience.stop.signals import SignalRecorder
from resilience.timing import RunTimer, auto_cadence

log = logging.getLogger("resilience")

Writer = Callable[[Path], Iterable[str | os.PathLike[str]]]
"""``write(staging_dir)``: writes this rank's files of a checkpoint, returns their paths."""


def resolve_config(config: ResilienceConfig | Mapping[str, Any] | str | os.PathLike[str] | None) -> ResilienceConfig:
    """``config`` as a :class:`ResilienceConfig`: one already, plain data in the YAML layout, the
    path of a YAML file, or ``None`` (the defaults). Raises ``ConfigError`` as :func:`load_config` does."""
    if isinstance(config, ResilienceConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        return load_config(config)
    return config_from_dict(config)


def check_external(config: CheckpointConfig, integration: str) -> None:
    """Refuse ``checkpoint`` keys that would do nothing when ``integration``'s trainer writes the
    files: they choose how ``resilient_loop()`` writes or loads its own format.

    Raises:
        ConfigError: naming the key, its value and what to do instead.
    """
    refused = {
        "is_async": (config.is_async, "saves are synchronous: the trainer writes its files while training waits"),
        "no_save_optim": (config.no_save_optim, "the trainer decides what its checkpoint holds"),
        "no_load_optim": (config.no_load_optim, "the trainer loads the whole checkpoint it resumes from"),
        "model_save_format": (config.model_save_format != "safetensors" and config.model_save_format, "the trainer writes its own model files"),
        "save_consolidated": (config.save_consolidated == "every" and "every", "the trainer writes its own model files"),
    }
    for key, (value, why) in refused.items():
        if value:
            raise ConfigError(f"checkpoint.{key}={value!r} has no effect with the {integration} integration ({why}); remove it from the config")
    if is_object_url(config.checkpoint_dir):
        raise ConfigError(
            f"checkpoint.checkpoint_dir={config.checkpoint_dir!r}: the {integration} integration needs a local or mounted directory "
            "(the trainer writes and reads its own files there); object storage works with resilient_loop() (docs/storage.md)"
        )


class TrainerSession:
    """Stop agreement, atomic saves of a trainer's own files, resume choice and exit code for one
    run; see the module docstring for the calls an integration makes.

    Args:
        config: see :func:`resolve_config`.
        producer: what writes the files (e.g. ``"transformers.Trainer"``), recorded as
            ``meta.producer`` in every manifest (``resilience status``/``verify`` show it).
        producer_version: its version, recorded as ``meta.producer_version``.
        global_batch_size: samples per optimizer step over all ranks (recorded), or ``None``.
        trainer_settings: ``step_scheduler`` values the trainer owns (e.g. ``gradient_accumulation_steps``),
            written into the checkpoints' ``config.yaml`` over the config's.
        checkpoint_dir: the checkpoint root, overriding ``checkpoint.checkpoint_dir``.

    Constructing it is a collective when torch.distributed is initialised (our gloo group).

    Raises:
        ConfigError: a key :func:`check_external` refuses, a checkpoint root that cannot hold
            checkpoints, a strict world-size change.
    """

    def __init__(
        self,
        config: ResilienceConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        *,
        producer: str,
        producer_version: str | None = None,
        global_batch_size: int | None = None,
        trainer_settings: Mapping[str, Any] | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
    ):
        config = resolve_config(config)
        if checkpoint_dir is not None:  # a copy: the caller's config object is left as it was
            config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, checkpoint_dir=os.fspath(checkpoint_dir)))
        check_external(config.checkpoint, producer)
        self.config = config
        self.producer = {"producer": producer, "producer_version": producer_version}
        self.run_config = config.to_dict()
        self.run_config["step_scheduler"].update(trainer_settings or {})
        self.ctx = DistContext.from_env(timeout_s=collective_timeout_s(config.checkpoint.async_timeout_s))
        self.progress = ProgressReporter.from_env()  # to resilience run's watchdog (a no-op without it)
        die_with_launcher()  # a rank of resilience run ends with its launcher, even one killed with SIGKILL
        self.progress.phase("starting")
        self.timer = RunTimer()  # step and save times, recorded in each manifest (resilience advise)
        self.counters = StepScheduler(num_epochs=1)  # names each save: epoch_<E>_step_<S>
        self.checkpointer = Checkpointer(
            config.checkpoint,
            self.ctx,
            state=None,
            scheduler=self.counters,
            timer=self.timer,
            global_batch_size=global_batch_size,
            run_config=self.run_config,
            run_id=run_id_from_env(),
        )
        self.checkpointer.verify_choice = True  # the trainer loads the files: their digests are checked first
        self.deadline = Deadline(config, self.ctx.rank, self.timer)
        self.exit_code: ExitCode | None = None
        """Set by :meth:`resume_point` (NO_PROGRESS), :meth:`stop_before_start`, :meth:`finish`, or FAILED on an exception."""
        self.resumed_from: Path | None = None
        self.resumed_meta: dict[str, Any] = {}
        """The manifest meta of :attr:`resumed_from` (empty for a fresh start)."""
        self._stack = contextlib.ExitStack()
        self._signals: SignalRecorder | None = None
        self._agreement: StopAgreement | None = None
        self._stop_file = False  # the launcher or batch script recorded a stop before this rank was ready
        self._fixed_cadence = config.step_scheduler.fixed_agreement_every_steps  # None: auto
        self._auto = self._fixed_cadence is None

    @property
    def saving(self) -> bool:
        """Whether checkpoints are written (``checkpoint.enabled`` and ``enable_save``)."""
        return self.config.checkpoint.enabled and self.config.checkpoint.enable_save

    @property
    def root(self) -> Path:
        """The checkpoint root (absolute)."""
        return self.checkpointer.root

    def __enter__(self) -> TrainerSession:
        sched = self.config.step_scheduler
        warning = signal_reach_warning()
        if warning and self.ctx.rank == 0 and sched.signals:
            log.warning(warning)
        try:
            self._signals = self._stack.enter_context(SignalRecorder(sched.signals))  # main thread only
            every = 1 if self._fixed_cadence is None else self._fixed_cadence
            timeout_s = collective_timeout_s(self.config.checkpoint.async_timeout_s)
            agreement = StopAgreement(self.ctx.group, every_steps=every, adaptive=self._auto, nodes=sched.agreement_nodes, timeout_s=timeout_s)
            self._agreement = self._stack.enter_context(agreement)
        except BaseException:
            self._stack.close()
            raise
        # After the handlers: a stop the launcher held for this rank is delivered, or found in the stop file.
        self._stop_file = mark_ready_and_check_stop(acts_on_stop=bool(sched.signals)) and bool(sched.signals)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is not None:
            self.exit_code = ExitCode.FAILED
            note_failure(exc)  # before our group goes: resilience run names the rank that failed first
        try:
            self.checkpointer.close()
        except Exception as error:  # noqa: BLE001 - the original error matters more
            if exc_type is None:
                raise
            log.warning("rank %d: closing the checkpointer failed too: %s", self.ctx.rank, error)
        finally:
            self.progress.close()  # "done": the launcher sends no stop signal to a rank whose training ended
            self._stack.close()  # the agreement drains its last round; the handlers are restored
            self.ctx.close()
            if self.exit_code == ExitCode.PREEMPTED:
                gc.freeze()  # the exit comes next, inside Slurm's warning time: skip the last collections

    def _entered_agreement(self) -> StopAgreement:
        """The stop agreement, which exists between ``__enter__`` and ``__exit__``.

        Raises:
            RuntimeError: the session is used outside its ``with`` block."""
        if self._agreement is None:
            raise RuntimeError("TrainerSession: steps and stop checks run inside `with session:`")
        return self._agreement

    # -- the start -----------------------------------------------------------------------------
    def resume_point(self) -> Path | None:
        """The checkpoint this run continues (every file's digest checked), or ``None`` for a fresh
        start; then the requeue-loop guard counts this start, and sets :attr:`exit_code` to
        ``NO_PROGRESS`` (76) when it must not train. A collective.

        Raises:
            CheckpointNotFound: ``checkpoint.restore_from`` or ``load_path`` holds no valid checkpoint.
        """
        self.progress.phase("loading")
        found = self.checkpointer.find_resume_point()
        if found is not None:
            self.resumed_meta = self.checkpointer.adopt(found)
            if self.ctx.rank == 0:
                announce(log, "resuming from %s (global step %s)", found, self.resumed_meta.get("global_step"), rank=0)
        self.resumed_from = found
        if progress_guard.must_end_for(self.config.checkpoint, self.ctx, self.root, found):
            self.exit_code = ExitCode.NO_PROGRESS
        return found

    def stop_before_start(self) -> bool:
        """True (and :attr:`exit_code` ``PREEMPTED``) when a stop reached any rank before training: every
        rank leaves without training or saving (``LATEST`` already holds this state). A blocking collective."""
        if not self._entered_agreement().agree_now(self._pending()):
            return False
        self.exit_code = ExitCode.PREEMPTED
        if self.ctx.rank == 0 and self.saving:
            progress_guard.record_clean_stop(self.root, self.resumed_from.name if self.resumed_from else None, saved_new=False)
        held = f"{self.resumed_from.name} holds this state" if self.resumed_from else "nothing trained yet"
        log.warning("rank %d: stop agreed before the first step; nothing new to save (%s), exiting for requeue", self.ctx.rank, held)
        return True

    def training_started(self, global_step: int) -> None:
        """The trainer starts stepping from ``global_step``: report it, read the job's deadline."""
        self.progress.phase("step", global_step)
        self.deadline.start()
        self.deadline.warn_lead_time(self.resumed_meta.get("timings") or {}, self.cadence)

    # -- steps ---------------------------------------------------------------------------------
    @property
    def cadence(self) -> int:
        """The agreement's cadence in steps now."""
        return self._agreement.every_steps if self._agreement is not None else 1

    def step_end(self, global_step: int) -> int:
        """Optimizer step ``global_step`` just ended on this rank: one agreement round (non-blocking;
        call on every rank after every step, in order). Returns 0 to go on, or the agreed reason
        (1 a preemption signal, 2 the job's deadline), the same on every rank at the same step:
        stop after this step, and save it."""
        self.timer.boundary()
        self.progress.step(global_step)
        deadline = STOP_DEADLINE if self.deadline.must_stop(self.cadence) else 0
        agreement = self._entered_agreement()
        propose = 0
        if self._auto and self.ctx.rank == 0 and agreement.starts_round(global_step):
            propose = auto_cadence(self.timer.step_s, max(self.config.step_scheduler.agreement_interval_s, 2 * agreement.round_s))
        return agreement.update(global_step, max(self._pending(), deadline), propose_every_steps=propose)

    def agree_now(self) -> bool:
        """A blocking agreement round: True when a stop reached any rank (after a periodic save: stop
        without saving again; in a long evaluation). Every rank must call it at the same point."""
        self.progress.heartbeat()
        return bool(self._entered_agreement().agree_now(self._pending()))

    def heartbeat(self) -> None:
        """Inside a long phase of a step (evaluation): tell ``resilience run``'s watchdog this rank works."""
        self.progress.heartbeat()

    def record_validation(self, global_step: int, metrics: dict[str, Any]) -> None:
        """Validation ``metrics`` of ``global_step``: the checkpoint of that step records them and
        ``LOWEST_VAL`` follows the lowest (see ``ResilientLoop.log_validation``).

        Raises:
            ValueError: several metrics and none named ``checkpoint.best_metric_key``.
        """
        if self.saving:
            self.checkpointer.record_validation(global_step, metrics)

    def _pending(self) -> int:
        return STOP_PREEMPTION if (self._signals or self._stop_file) else 0

    # -- saves and the end ---------------------------------------------------------------------
    def save(self, reason: SaveReason, write: Writer, *, step: int, epoch: int, epoch_complete: bool, meta: dict[str, Any] | None = None) -> Path | None:
        """Publish the checkpoint of optimizer step ``step`` (0-based ``epoch``: the one it ran in) that
        ``write`` puts into the staging directory (see the module docstring); returns its directory,
        or ``None`` when saving is off. ``epoch_complete``: the step ended its epoch. ``meta``: more
        manifest entries. A collective; returns once every rank's files are published.

        Raises:
            CheckpointSaveError: on every rank when any rank failed; ``LATEST`` is unchanged.
        """
        if not self.saving:
            return None
        self.counters.global_step, self.counters.epoch, self.counters.batches_in_epoch = step, epoch, 1  # the name: epoch_<epoch>_step_<step>
        started = self.timer.clock()
        self.progress.phase("saving")
        parts = external_parts(write, rank=self.ctx.rank, run_config=self.run_config if self.ctx.rank == 0 else None)
        path = self.checkpointer.save(reason, parts=parts, meta={**self.producer, "epoch_complete": bool(epoch_complete), **(meta or {})})
        seconds = self.timer.clock() - started
        self.timer.record_save(seconds)
        self.progress.saved(seconds)
        self.deadline.warn_lead_time(self.timer.as_dict(), self.cadence)
        return path

    @property
    def last_saved_step(self) -> int | None:
        """The step of the checkpoint saved last, or resumed from."""
        return self.checkpointer.last_saved_step

    def finish(self, *, stopped_at: int | None = None) -> ExitCode:
        """The trainer returned: ``stopped_at`` the agreed stop step whose checkpoint is published
        (exit ``PREEMPTED``, 75), or ``None`` when training ended (``DONE``, 0; the restart guard's
        count is removed). Sets and returns :attr:`exit_code`.

        Raises:
            RuntimeError: ``stopped_at`` was not saved (an integration's error: exit 75 would lose steps).
        """
        if stopped_at is None:
            if self.ctx.rank == 0 and self.saving:
                progress_guard.reset(self.root)
            self.exit_code = ExitCode.DONE
            return self.exit_code
        if self.saving and self.last_saved_step != stopped_at:
            raise RuntimeError(f"the stop at step {stopped_at} ended training, but the last checkpoint is of step {self.last_saved_step}")
        self.exit_code = ExitCode.PREEMPTED
        if self.ctx.rank == 0 and self.saving:
            progress_guard.record_clean_stop(self.root, self.resumed_from.name if self.resumed_from else None, saved_new=stopped_at != self._resumed_step)
        log.warning("rank %d: stop agreed at step %d; its checkpoint is published, exiting for requeue", self.ctx.rank, stopped_at)
        return self.exit_code

    @property
    def _resumed_step(self) -> int | None:
        return self.resumed_meta.get("global_step") if self.resumed_from is not None else None
