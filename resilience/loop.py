"""``resilient_loop()``: resume -> steps -> periodic / preemption save -> exit code.

::

    loop = resilient_loop(cfg, model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader)
    with loop:
        for step in loop:                       # resumes from LATEST first
            loss = train_step(step.batch)
            loop.log(loss=loss.item())
    sys.exit(loop.exit_code)                    # 0 done, 75 preempted (requeue me), 1 failed

At each step boundary the ranks agree (non-blocking, see :mod:`resilience.stop.agreement`) whether a
preemption signal reached any of them; when they do, every rank saves the same step and the
loop ends with ``ExitCode.PREEMPTED``.
"""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from resilience.announce import announce
from resilience.checkpoint import Checkpointer, SaveReason, TrainingState
from resilience.checkpoint.formats.optim_io import ParamGroupsChanged
from resilience.checkpoint.layout import TRAINING_LOG, VALIDATION_LOG
from resilience.checkpoint.loading import Restored
from resilience.checkpoint.policy import progress_guard
from resilience.checkpoint.policy.lowest_val import append_jsonl
from resilience.config import ResilienceConfig, config_from_dict
from resilience.distributed import DistContext, collective_timeout_s
from resilience.exit_codes import ExitCode
from resilience.failure_note import note_failure
from resilience.metrics_log import training_row, truncate_logs
from resilience.parent_death import die_with_launcher
from resilience.progress import ProgressReporter
from resilience.slurm.job import run_id_from_env, signal_reach_warning
from resilience.state.accumulation import batches_left, micro_batches
from resilience.state.batch_size import BatchSizeChangeRefused, batch_layout
from resilience.state.data_position import epoch_iterator, loader_length, set_epoch
from resilience.state.step_scheduler import StepScheduler
from resilience.state.worker_signals import shield_dataloader_workers
from resilience.step import Step
from resilience.stop.agreement import StopAgreement
from resilience.stop.deadline import Deadline
from resilience.stop.handshake import mark_ready_and_check_stop
from resilience.stop.signals import SignalRecorder
from resilience.teardown import release_at_exit
from resilience.timing import RunTimer, auto_cadence

log = logging.getLogger("resilience")

STOP_PREEMPTION = 1  # reason codes carried by the agreement collective (combined with MAX)
STOP_DEADLINE = 2


class ResilientLoop:
    """Iterable over :class:`Step` that resumes, saves and stops; see :func:`resilient_loop`."""

    def __init__(self, config: ResilienceConfig, state: TrainingState, *, ctx: DistContext | None = None, data_parallel: tuple[int, int] | None = None):
        self.config = config
        self.state = state
        self.ctx = ctx if ctx is not None else DistContext.from_env(timeout_s=collective_timeout_s(config.checkpoint.async_timeout_s))
        self.progress = ProgressReporter.from_env()  # to resilience run's watchdog (a no-op without it)
        die_with_launcher()  # a rank of resilience run ends with its launcher, even one killed with SIGKILL
        self.progress.phase("starting")
        self.scheduler = StepScheduler(config.step_scheduler.num_epochs, config.step_scheduler.max_steps)
        self.timer = RunTimer()  # moving averages of step and save time (seconds), recorded in each checkpoint
        global_batch, layout = batch_layout(config.step_scheduler, state, self.ctx, data_parallel)  # tensor-parallel ranks share batches
        self.checkpointer = Checkpointer(
            config.checkpoint,
            self.ctx,
            state=state,
            scheduler=self.scheduler,
            timer=self.timer,
            global_batch_size=global_batch,
            data_parallel=layout,
            run_config=config.to_dict(),
            run_id=run_id_from_env(),
        )
        self.exit_code: ExitCode | None = None
        """Set at the end: DONE, PREEMPTED (the stop step's checkpoint published), FAILED, NO_PROGRESS, or CONFIG_ERROR (exit 2)."""
        self.resumed_from: Path | None = None
        self.stop_step: int | None = None
        """The agreed stop step when preempted (every rank has the same)."""
        self._generator: Generator[Step, None, None] | None = None
        self._in_step = False  # the user's body of a step is running (its step is global_step + 1)
        self._agreement: StopAgreement | None = None
        self._pending: Any = lambda: 0  # this rank's stop flag (signals recorded or a stop file)
        self._stop_agreed_in_step = False  # should_stop() agreed a stop inside a step's body
        self._deadline = Deadline(config, self.ctx.rank, self.timer)
        self._fixed_cadence = config.step_scheduler.fixed_agreement_every_steps  # None: auto
        self._auto_cadence = self._fixed_cadence is None
        self._ended_by: BaseException | None = None  # the exception that ended the steps, if any
        # Slurm signals every process of a step: the loader's workers must outlive the save.
        shield_dataloader_workers(state.dataloader, config.step_scheduler.signals)

    # -- public --------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Step]:
        if self._generator is not None:
            raise RuntimeError("a ResilientLoop can be iterated once")
        self._generator = self._run()
        return self._generator

    def __enter__(self) -> ResilientLoop:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is not None:
            self.exit_code = ExitCode.FAILED
            note_failure(exc)  # before close() leaves our group: resilience run names the rank that failed first
        self.close()

    def close(self) -> None:
        """End the loop early: restores signal handlers and drains the agreement (no save). Left
        before its end (``break``, an exception), it exits ``FAILED`` (1); stop early with ``max_steps``."""
        step, pending = self._current_step(), sys.exc_info()[1]  # close() in a finally: what is ending the program
        if self._generator is not None:
            self._generator.close()
        self.progress.close()  # never iterated: the watchdog must not wait for its first step
        if self.exit_code is None:
            self.exit_code = ExitCode.FAILED
            how = "interrupted by Ctrl-C" if KeyboardInterrupt in (type(self._ended_by), type(pending)) else "left"
            log.warning("resilient_loop: %s at step %d before it ended (break, an exception, never iterated): exit 1 (FAILED), no save since", how, step)

    def log(self, **metrics: Any) -> None:
        """Record metrics of the current step (rank 0 appends them to ``training.jsonl``; the rows
        since the previous checkpoint also go into the next checkpoint's ``losses.json``), as
        :func:`~resilience.metrics_log.training_row` takes them (a loss tensor as its ``item()``).

        Raises:
            TypeError: a value JSON cannot hold, naming its key."""
        if self.ctx.rank != 0 or not self.config.checkpoint.enabled or not self.config.checkpoint.enable_save:
            return
        row = training_row(self._current_step(), self.scheduler.epoch, metrics)
        append_jsonl(self.checkpointer.log_root / TRAINING_LOG, row)
        self.checkpointer.training_rows.append(row)

    def log_validation(self, **metrics: Any) -> None:
        """Record validation metrics of the current step (NeMo AutoModel's ``LOWEST_VAL``).

        Rank 0 appends them to ``validation.jsonl`` at the checkpoint root, and the checkpoint of
        this step (periodic, preemption or final) records them in its manifest; once it is
        published, ``LOWEST_VAL`` moves to it when its metric is the lowest so far. With one
        metric that one decides; with several, the one named ``checkpoint.best_metric_key``.
        NaN/Inf never become the best. Call it inside a step's body (``step.is_val_step`` says when),
        on rank 0 at least: other ranks' calls are ignored. Values may be floats or one-element tensors.

        Raises:
            ValueError: no metric, or several and none named ``checkpoint.best_metric_key``.
        """
        if self.ctx.rank != 0 or not self.config.checkpoint.enabled or not self.config.checkpoint.enable_save:
            return
        step = self._current_step()
        self.checkpointer.record_validation(step, metrics)
        append_jsonl(self.checkpointer.log_root / VALIDATION_LOG, {"global_step": step, "epoch": self.scheduler.epoch, **metrics})

    def _current_step(self) -> int:
        """The global step metrics belong to: the running step inside a body, else the last done."""
        return self.scheduler.global_step + 1 if self._in_step else self.scheduler.global_step

    # -- the data path -------------------------------------------------------------------------
    def _run(self) -> Generator[Step, None, None]:
        sched_cfg = self.config.step_scheduler
        scheduler = self.scheduler
        warning = signal_reach_warning()
        if warning and self.ctx.rank == 0 and sched_cfg.signals:
            log.warning(warning)
        try:
            every, nodes, timeout_s = self._cadence(), sched_cfg.agreement_nodes, collective_timeout_s(self.config.checkpoint.async_timeout_s)
            with (
                SignalRecorder(sched_cfg.signals) as signals,
                StopAgreement(self.ctx.group, every_steps=every, adaptive=self._auto_cadence, nodes=nodes, timeout_s=timeout_s) as agreement,
            ):
                # A stop the launcher or batch script recorded before this rank could receive it.
                stop_before_start = mark_ready_and_check_stop(acts_on_stop=bool(sched_cfg.signals)) and bool(sched_cfg.signals)
                self._pending = lambda: STOP_PREEMPTION if (signals or stop_before_start) else 0
                self._agreement = agreement
                try:
                    self.progress.phase("loading")
                    try:
                        restored = self._resume()
                    except (BatchSizeChangeRefused, ParamGroupsChanged) as exc:  # before any step: exit 2, nothing requeued
                        log.error("rank %d: %s", self.ctx.rank, exc)
                        self.exit_code = ExitCode.CONFIG_ERROR
                        return
                    if progress_guard.must_end_for(self.config.checkpoint, self.ctx, self.checkpointer.root, self.resumed_from):
                        self.exit_code = ExitCode.NO_PROGRESS
                        return
                    self.progress.phase("step", scheduler.global_step)
                    self._deadline.start()
                    self._deadline.warn_lead_time(restored.meta.get("timings", {}) if restored else {}, self._cadence())
                    # A signal during model building or resume loading: stop before the first step.
                    # Nothing new to save: LATEST (if any) already holds this state.
                    if agreement.agree_now(self._pending()):
                        self._stop(scheduler.global_step, "before the first step", save=False)
                        return
                    yield from self._steps(restored, agreement)
                finally:
                    if self.exit_code is None:  # an exception: let a save in flight finish, quietly
                        self._ended_by = sys.exc_info()[1]
                        try:
                            self.checkpointer.close()
                        except Exception as exc:  # noqa: BLE001 - the original error matters more
                            log.warning("rank %d: the save in flight failed too: %s", self.ctx.rank, exc)
                    else:
                        self.checkpointer.close()
                    # "done" before the handlers go: the launcher sends no stop signal to a rank
                    # whose loop is over (it would kill the program's work after training)
                    self.progress.close()
        finally:
            self.progress.close()
            self.ctx.close()  # our gloo group (the agreement drained its last collective on exit)
            if self.exit_code == ExitCode.PREEMPTED:
                # The process exits next, inside Slurm's warning time: the interpreter's last
                # garbage collections walk every object torch made (0.4-2 s here, bench/ddp.py's
                # teardown figure); frozen objects are skipped. Memory is freed by the exit.
                gc.freeze()

    def _steps(self, restored: Restored | None, agreement: StopAgreement) -> Generator[Step, None, None]:
        sched_cfg = self.config.step_scheduler
        scheduler = self.scheduler
        loader = self.state.dataloader
        position = restored.data_position if restored else None
        while not scheduler.done:
            set_epoch(loader, scheduler.epoch)
            iterator = epoch_iterator(loader, position)
            if restored is not None:
                # The save captured the RNG after this epoch's iterator was created (creating it
                # draws from the global RNG), so restore it only now.
                Checkpointer.restore_rng(restored)
                restored = None
            position = None
            # One Step per micro-batch; all below runs once per optimizer step, between them.
            left = batches_left(loader, scheduler.batches_in_epoch)  # from the length: Accelerate must see its loader end
            for micro, is_optimizer_step, batch in micro_batches(iterator, sched_cfg.gradient_accumulation_steps, left):
                number = scheduler.global_step + 1
                is_val_step = sched_cfg.val_every_steps is not None and number % sched_cfg.val_every_steps == 0
                self._in_step = True
                yield Step(number, scheduler.epoch, scheduler.batches_in_epoch + micro, batch, is_val_step, micro, is_optimizer_step)
                if not is_optimizer_step:
                    continue
                self._in_step = False
                scheduler.finish_step(micro + 1)
                self.timer.boundary()
                self.progress.step(scheduler.global_step)
                proposal = self._proposed_cadence(agreement.round_s) if agreement.starts_round(scheduler.global_step) else 0
                stop = agreement.update(scheduler.global_step, max(self._pending(), self._deadline_flag()), propose_every_steps=proposal)
                if scheduler.done:
                    break  # a stop during the final step: finish normally
                # The last batch of the last epoch is the final step too (the scheduler counts the
                # epoch as finished only once its iterator is exhausted): a stop there finishes normally.
                final = scheduler.at_last_batch(loader_length(loader))
                if (stop or self._stop_agreed_in_step) and not final:
                    self._stop(scheduler.global_step, "for the job's deadline" if stop == STOP_DEADLINE else "agreed", save=True)
                    return
                every = sched_cfg.ckpt_every_steps
                if every and scheduler.global_step % every == 0:
                    self._save("final" if final else "periodic")  # the run's last checkpoint is "final" whatever else it is
                    # A signal during that save: it is this step's checkpoint; stop without a second one.
                    if agreement.agree_now(self._pending()) and not final:
                        self._stop(scheduler.global_step, "during a save", save=False)
                        return
            else:
                scheduler.finish_epoch()
        self.progress.phase("saving")
        agreement.drain()
        if self.checkpointer.needs_final_save(scheduler.global_step):
            self._save("final")
        self.checkpointer.wait()  # the end of training publishes before it reports DONE
        if self.ctx.rank == 0 and self.config.checkpoint.enabled and self.config.checkpoint.enable_save:
            progress_guard.reset(self.checkpointer.root)
        self.exit_code = ExitCode.DONE

    def _deadline_flag(self) -> int:
        """STOP_DEADLINE on rank 0 once the time left no longer covers a stop (see resilience.stop.deadline)."""
        return STOP_DEADLINE if self._deadline.must_stop(self._cadence()) else 0

    def _cadence(self) -> int:
        """The agreement's cadence in steps now (``auto``: what it has adapted to so far)."""
        if self._agreement is not None:
            return self._agreement.every_steps
        return 1 if self._fixed_cadence is None else self._fixed_cadence

    def _proposed_cadence(self, round_s: float) -> int:
        """``auto`` on rank 0: the steps of ``agreement_interval_s`` (or of 2 rounds of ``round_s``, measured, if longer);
        0: no proposal (not auto, rank 0, a step time)."""
        interval_s = max(self.config.step_scheduler.agreement_interval_s, 2 * round_s)  # so no update waits for a round
        return auto_cadence(self.timer.step_s, interval_s) if self._auto_cadence and self.ctx.rank == 0 else 0

    def _stop(self, step: int, when: str, *, save: bool) -> None:
        """Every rank stops at ``step``: save it (unless already saved), publish, exit PREEMPTED."""
        if save and self.checkpointer.last_saved_step != step:
            self._save("preemption")
        self.progress.phase("saving")
        self.checkpointer.wait()  # an asynchronous save must be published before we exit
        self.stop_step = step
        self.exit_code = ExitCode.PREEMPTED
        saved_now = when != "before the first step"  # a later stop saved its step, or had just saved it
        if self.ctx.rank == 0 and self.config.checkpoint.enabled and self.config.checkpoint.enable_save:
            progress_guard.record_clean_stop(self.checkpointer.root, self.resumed_from.name if self.resumed_from else None, saved_new=saved_now)
        fresh = saved_now and self.checkpointer.last_saved_step == step  # not the step resumed from
        held = f"nothing new to save ({self.resumed_from.name} holds this state)" if self.resumed_from else "no checkpoint yet (nothing trained)"
        saved = "checkpoint published" if fresh else held
        log.warning("rank %d: stop %s at step %d (agreement every %d step(s)); %s, exiting for requeue", self.ctx.rank, when, step, self._cadence(), saved)

    def heartbeat(self) -> None:
        """Tell ``resilience run``'s watchdog this rank works in a long step body (eval): peers waiting on it are not hung (no collective)."""
        self.progress.heartbeat()

    def should_stop(self) -> bool:
        """A collective check for long phases inside a step's body (evaluation): True when a stop
        was requested on any rank. Call it on every rank at the same points; when it returns
        True, abandon the phase and return from the body: the loop then saves the step (its
        training part is complete) and ends with PREEMPTED, without waiting for the next
        agreement round; in the final step of training it finishes normally (DONE) instead.
        Costs one blocking all-reduce per call."""
        self.progress.heartbeat()
        if self._agreement is None:
            return False
        if not self._stop_agreed_in_step and self._agreement.agree_now(self._pending()):
            self._stop_agreed_in_step = True
        return self._stop_agreed_in_step

    def _resume(self) -> Restored | None:
        restored = self.checkpointer.restore()
        if restored is None:
            if self.config.checkpoint.enabled and self.config.checkpoint.enable_save:
                self._truncate_logs(0)  # rows of a run that died before its first checkpoint: redone now
            return None
        directory = self.resumed_from = restored.directory
        if restored.weights_only:  # no_load_optim: weights from load_path/restore_from, all else fresh
            self._truncate_logs(0)
            announce(log, "loaded the weights of %s (no_load_optim); training starts at step 0", directory, rank=self.ctx.rank)
            return None
        self.scheduler.load_state_dict(restored.step_scheduler)
        self._truncate_logs(self.scheduler.global_step)
        announce(log, "resumed from %s (global step %d, epoch %d)", directory, self.scheduler.global_step, self.scheduler.epoch, rank=self.ctx.rank)
        return restored

    def _truncate_logs(self, global_step: int) -> None:
        if self.ctx.rank == 0:
            truncate_logs(self.checkpointer.log_root, global_step)

    def _save(self, reason: SaveReason) -> None:
        started = self.timer.clock()
        self.progress.phase("saving")
        self.checkpointer.save(reason)
        seconds = self.timer.clock() - started
        self.timer.record_save(seconds)
        self.progress.saved(seconds)
        self._deadline.warn_lead_time(self.timer.as_dict(), self._cadence())


def resilient_loop(
    config: ResilienceConfig | dict | None = None,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    dataloader: Any,
    extra_state: dict[str, Any] | None = None,
    tokenizer: Any = None,
    data_parallel: tuple[int, int] | None = None,
) -> ResilientLoop:
    """Wrap a training loop with preemption handling, checkpointing and exact resume.

    Args:
        config: a :class:`ResilienceConfig`, plain data in the YAML layout, or ``None`` (defaults).
        model: the module being trained (plain, DDP, or sharded: FSDP2, tensor parallel, 2-D
            meshes); saved as safetensors, each rank writing its own shards.
        optimizer: optional; saved as safetensors when every rank holds its full state (plain, DDP), else via DCP.
        lr_scheduler: anything with ``state_dict()``/``load_state_dict()`` (optional); saved as tagged JSON.
        dataloader: iterable of batches; a ``StatefulDataLoader`` or any loader whose sampler
            has ``set_epoch`` (``DistributedSampler``) resumes mid-epoch exactly.
        extra_state: name -> object with ``state_dict()``/``load_state_dict()`` (NeMo's "Save
            Additional States"); its state may hold tensors, NumPy arrays, numbers, strings and containers.
        tokenizer: a Hugging Face tokenizer; its files are saved with the model (optional).
        data_parallel: ``(dp_rank, dp_size)`` when ranks share batches (tensor parallel) and the loader has no ``DistributedSampler``.

    Returns a :class:`ResilientLoop`; iterate it for :class:`Step` objects, then exit with
    ``loop.exit_code``. Constructing it is a collective when torch.distributed is initialised.
    At interpreter exit, a DDP ``model``'s reducer is freed and then the default process group
    destroyed (see :mod:`resilience.teardown`): scripts need no teardown lines of their own.

    Raises:
        TypeError / ValueError: an object that cannot be checkpointed (see :class:`TrainingState`).
        ConfigError: invalid configuration or ``data_parallel`` (before any training), including a
            ``checkpoint.restore_from`` or ``checkpoint.load_path`` that names no existing path
            (``load_path`` only while ``checkpoint_dir`` has no ``LATEST``).
        CheckpointNotFound: ``checkpoint.restore_from`` or ``load_path`` exists but holds no valid checkpoint (at iteration start).
        CheckpointCorrupted: every checkpoint to resume from was corrupt and one was partly loaded
            (at iteration start); run again to start from scratch.
        CheckpointSaveError: a save failed on any rank (raised on every rank).
    """
    if not isinstance(config, ResilienceConfig):
        config = config_from_dict(config)
    state = TrainingState(
        model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, dataloader=dataloader, extra=dict(extra_state or {}), tokenizer=tokenizer
    )
    release_at_exit(model)  # DDP's reducer, then the default group, freed at exit in the safe order
    return ResilientLoop(config, state, data_parallel=data_parallel)
