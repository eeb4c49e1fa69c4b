"""``Checkpointer``: saves a training run's checkpoints and resumes from them.

The public methods own the guards and delegate: what a save holds is :mod:`~.parts`, writing and
publishing it :mod:`~.writer`, then ``LOWEST_VAL`` and retention here; choosing and verifying the
checkpoint to resume from is :mod:`~.reader`, loading it :mod:`~.loading`.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import torch

from resilience.announce import announce
from resilience.checkpoint import object_save
from resilience.checkpoint.async_writer import AsyncWriter
from resilience.checkpoint.formats.plan_cache import LayoutCache
from resilience.checkpoint.layout import LATEST, checkpoint_name
from resilience.checkpoint.loading import Restored
from resilience.checkpoint.object_save import Sink, local_root
from resilience.checkpoint.parts import Part, checkpoint_parts, epoch_of
from resilience.checkpoint.policy.lowest_val import LowestVal, json_safe, select_metric
from resilience.checkpoint.policy.pruning import Pruning
from resilience.checkpoint.policy.root_dir import root_problem
from resilience.checkpoint.policy.savable import check_savable
from resilience.checkpoint.policy.world_size import world_size_problem
from resilience.checkpoint.resume import Resuming
from resilience.checkpoint.staging import StagingBuffers
from resilience.checkpoint.storage.direct_file import direct_io_enabled
from resilience.checkpoint.storage.object_path import Location, ObjectPath, is_object, root_location
from resilience.checkpoint.storage.object_store import StoreUnavailable
from resilience.checkpoint.writer import describe_failure, phase, publish, raise_publish_verdict, save_failures, write_checkpoint
from resilience.config import CheckpointConfig, ConfigError
from resilience.distributed import DistContext
from resilience.state.batch_size import epoch_complete
from resilience.state.data_parallel import DataParallel
from resilience.state.step_scheduler import StepScheduler
from resilience.state.training_state import TrainingState
from resilience.stop.interrupt import HeldInterrupt
from resilience.timing import RunTimer

__all__ = ["Checkpointer", "Restored", "SaveReason", "TrainingState"]

log = logging.getLogger("resilience.checkpoint")

SaveReason = Literal["periodic", "preemption", "final"]
"""Why a checkpoint is saved; recorded as ``meta.reason`` in its manifest."""


class Checkpointer(Resuming):
    """Saves and restores :class:`TrainingState` under ``config.checkpoint_dir``.

    Every method is a collective over ``ctx`` (call it on every rank). A save publishes
    ``epoch_<E>_step_<S>/`` and moves ``LATEST`` only after every rank's files are durable.

    What it saves is registered once, here: ``state`` (the objects), ``scheduler`` (whose
    counters name each checkpoint), ``timer`` (its step and save times are recorded in each
    manifest), ``global_batch_size`` (samples per optimizer step over the data-parallel replicas;
    ``None`` when unknown), ``data_parallel`` (which ranks share a replica, recorded too: a resume
    under another layout maps each rank's data position by it; ``None``: every rank its own) and
    ``run_id`` (the environment's: ``RESILIENCE_RUN_ID`` or the Slurm job's; see :meth:`_run_id`).
    A save is then just ``save(reason)``.

    A trainer that writes its own checkpoint files (a trainer integration,
    :mod:`resilience.integrations.session`) registers no objects (``state=None``) and hands each
    save its files as ``save(reason, parts=..., meta=...)``: the same staging, fsync, digests,
    manifest, ``LATEST``, ``LOWEST_VAL``, retention and lineage, around files written by its code.

    With ``config.is_async`` a save takes a snapshot (model and optimizer tensors copied into
    reused host buffers; RNG, data position, counters captured) and returns; a background thread
    writes, fsyncs and publishes it, with its collectives on a gloo group of its own (creating
    it makes the constructor a collective). At most one save is in flight: the next save,
    :meth:`wait` and :meth:`close` wait for it (at most ``config.async_timeout_s`` seconds) and
    raise its failure, on every rank alike.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        ctx: DistContext,
        *,
        state: TrainingState | None,
        scheduler: StepScheduler,
        timer: RunTimer | None = None,
        global_batch_size: int | None = None,
        data_parallel: DataParallel | None = None,
        run_config: dict[str, Any] | None = None,
        run_id: str | None = None,
    ):
        self.config = config
        self.ctx = ctx
        self.state = state
        self.scheduler = scheduler
        self.timer = timer
        self.global_batch_size = global_batch_size
        self.data_parallel = data_parallel
        try:
            self.root = root_location(config.checkpoint_dir)
        except StoreUnavailable as exc:  # the same configuration on every rank: every rank raises it
            raise ConfigError(f"checkpoint.checkpoint_dir={config.checkpoint_dir!r}: {exc}") from None
        self.local = local_root(config.local_dir, self.root) if is_object(self.root) else None
        """On object storage: the local directory of each rank's staging and downloads (``checkpoint.local_dir``)."""
        try:
            direct_io_enabled()  # a bad RESILIENCE_DIRECT_IO: refused here, not at the first save
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.run_config = run_config or {}
        self.run_id = run_id
        """This run's id (``save_max`` tells this run's checkpoints by it); see :meth:`_run_id`."""
        self._resumed_run_id: str | None = None
        self.last_saved_step: int | None = None
        self.last_saved_reason: str | None = None
        """Why the checkpoint of ``last_saved_step`` was saved (``periodic``, ``final``, ``preemption``)."""
        self.lowest_val = LowestVal(self.root)
        self.resume_source: str | None = None
        """Where :meth:`find_resume_point`'s answer came from: ``latest``, ``restore_from``, ``load_path``."""
        self.training_rows: list[dict[str, Any]] = []
        """Rank 0: rows logged since the last save (they go into its ``losses.json``)."""
        self.validation: dict[int, dict[str, Any]] = {}
        """Rank 0: validation metrics by global step, waiting for that step's checkpoint."""
        self.parent: dict[str, Any] | None = None
        self._chosen_manifest: tuple[Location | None, dict[str, Any] | None] = (None, None)
        """The checkpoint the next save continues (``{"name", "checkpoint_id"}``): the one resumed
        from, then the previous save; ``None`` at step 0 (see :mod:`resilience.checkpoint.policy.lineage`)."""
        self._async: AsyncWriter | None = None
        self._async_ctx: DistContext = ctx
        """The asynchronous save's group: a gloo group of its own across ranks (else ``ctx``)."""
        self._buffers = StagingBuffers()
        self._pruning = Pruning(config, self.root)
        self._layout_cache = LayoutCache(enabled=config.save_global_layout_cache)
        """The model's save plan and index, reused while its layout is unchanged (plan_cache.py)."""
        self._optim_cache = LayoutCache(enabled=config.save_global_layout_cache)
        """The same for a sharded optimizer state's pieces (optim_shards.py)."""
        self._check_root()
        if state is not None:
            check_savable(config, state.model, ctx)  # a model the format cannot save: refused before training
        if config.is_async and config.enabled and config.enable_save:
            self._async = AsyncWriter()
            self._async_ctx = DistContext.from_env(timeout_s=config.async_timeout_s) if ctx.distributed else ctx

    def _check_root(self) -> None:
        """Refuse a ``checkpoint_dir`` that cannot hold checkpoints, before any training and on
        every rank alike: rank 0 looks (creating the directory, as the first save would, and a
        probe file in it when saving), then broadcasts what it found, so no rank goes on to wait
        in a collective for a peer that raised. (A URL never gets here: the configuration refuses it.)

        The same broadcast carries the strict world-size check (:mod:`resilience.checkpoint.policy.world_size`)
        and a ``restore_from``/``load_path`` that names no existing path (:meth:`missing_source`).

        Raises:
            ConfigError: naming ``checkpoint.checkpoint_dir``: it (or a parent) is not a directory,
                or, when saving, it cannot be created or written; naming
                ``checkpoint.world_size_change``: the checkpoint to resume was saved under another
                world size and the setting is ``strict``; naming ``checkpoint.restore_from`` or
                ``checkpoint.load_path``: it names no existing path.
        """
        if not self.config.enabled:
            return
        if is_object(self.root):
            self._check_store(self.root)
        problem = resized = None
        if self.ctx.rank == 0:
            problem = None if is_object(self.root) else root_problem(self.root, saving=self.config.enable_save)
            resized = None if problem else (self.missing_source() or world_size_problem(self.config, self.root, self.ctx.world_size))
        if self.ctx.distributed:
            problem, resized = self.ctx.broadcast_object((problem, resized))
        if problem:
            raise ConfigError(
                f"checkpoint.checkpoint_dir={self.config.checkpoint_dir!r}: {problem}; accepted: a directory "
                "(existing, or one that can be created) that every rank's process can write"
            )
        if resized:
            raise ConfigError(resized)

    def _check_store(self, root: ObjectPath) -> None:
        """Object storage: the store is usable (credentials, bucket or profile; rank 0 also writes
        and deletes a probe when saving), checked on every rank; a ``ConfigError`` on every rank
        naming ``checkpoint.checkpoint_dir`` and what was tried, else ``None``."""
        try:
            problem = root.store.problem(saving=self.config.enable_save and self.ctx.rank == 0)
        except Exception as exc:  # noqa: BLE001 - a client that cannot even ask is a configuration problem
            problem = f"{type(exc).__name__}: {exc}"
        self.ctx.gather_or_raise(problem, fail=lambda detail: ConfigError(f"checkpoint.checkpoint_dir={self.config.checkpoint_dir!r}: {detail}"))

    @property
    def log_root(self) -> Path:
        """Where rank 0's ``training.jsonl``/``validation.jsonl`` go: the checkpoint root, or on object
        storage the local directory (an object cannot be appended to)."""
        if self.local is not None:
            return self.local
        assert isinstance(self.root, Path), "a root on object storage has its local directory"
        return self.root

    def record_validation(self, global_step: int, metrics: dict[str, Any]) -> tuple[str, float | None]:
        """Remember ``metrics`` for the checkpoint of ``global_step``; returns the deciding metric.

        Raises:
            ValueError: several metrics and none named ``checkpoint.best_metric_key``.
        """
        chosen = select_metric(metrics, self.config.best_metric_key)
        self.validation[global_step] = dict(metrics)
        return chosen

    # -- save ---------------------------------------------------------------------------------
    def save(self, reason: SaveReason = "periodic", *, parts: list[Part] | None = None, meta: dict[str, Any] | None = None) -> Location | None:
        """Checkpoint the registered state at the registered scheduler's step; returns the directory
        it is (or, async, will be) published as.

        ``parts``: this save's pieces instead of the registered state's, for a caller whose own code
        writes its files (:func:`~resilience.checkpoint.parts.external_parts`; synchronous saves
        only). ``meta``: entries added to the manifest's ``meta`` (they replace computed ones of the
        same key, e.g. ``epoch_complete``).

        Synchronous: returns once it is published. Asynchronous: waits for the save in flight,
        takes a snapshot and returns; training may then change every object at once.

        A first SIGINT (Ctrl-C) meanwhile is held until the save returns (:class:`HeldInterrupt`).

        Raises:
            CheckpointSaveError: on every rank when any rank failed (for an asynchronous save: at
                the next ``save``, ``wait`` or ``close``); ``LATEST`` is unchanged.
            AsyncSaveTimeout: the previous asynchronous save did not finish in time.
            ValueError: ``parts`` with ``checkpoint.is_async``, or neither ``parts`` nor a registered state.
            KeyboardInterrupt: a SIGINT arrived during the save: after it returned, or at once for a second one.
        """
        if not self.config.enabled or not self.config.enable_save:
            return None
        if parts is not None and self._async is not None:
            raise ValueError("Checkpointer.save(parts=...): the caller's files are written while it waits; checkpoint.is_async cannot snapshot them")
        if parts is None and self.state is None:
            raise ValueError("Checkpointer.save(): no state registered (state=None); pass this save's parts")
        with HeldInterrupt():
            return self._save(reason, parts, meta or {})

    def _save(self, reason: SaveReason, parts: list[Part] | None, extra_meta: dict[str, Any]) -> Location:
        self.wait()  # at most one save in flight; raises its failure here, on every rank
        if self.ctx.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        state, scheduler = self.state, self.scheduler
        epoch = epoch_of(scheduler)
        step = scheduler.global_step
        name = checkpoint_name(epoch, step)
        meta = {
            "epoch": epoch,
            "global_step": step,
            "world_size": self.ctx.world_size,
            "reason": reason,
            "saved_at": time.time(),
            "run_id": self._run_id(),
            "torch_version": torch.__version__,
            "global_batch_size": self.global_batch_size,
            "data_parallel_replicas": list(self.data_parallel.replicas) if self.data_parallel else None,  # by rank
            # batches_in_epoch counts micro-batches: a resume under another batch size needs both
            "gradient_accumulation_steps": int(self.run_config.get("step_scheduler", {}).get("gradient_accumulation_steps") or 1),
            "epoch_complete": state is not None and epoch_complete(state.dataloader, scheduler.batches_in_epoch),
            "optimizer_saved": state is not None and state.optimizer is not None and not self.config.no_save_optim,
            "is_async": self._async is not None,
            "timings": self.timer.as_dict() if self.timer is not None else {},
            "checkpoint_id": uuid.uuid4().hex,
            "parent": self.parent,
            **extra_meta,
        }
        self.parent = {"name": name, "checkpoint_id": meta["checkpoint_id"]}
        value = None
        if step in self.validation:
            key, value = select_metric(self.validation[step], self.config.best_metric_key)
            meta["val_metrics"] = json_safe(self.validation[step])
            meta["val_metric"] = {"key": key, "value": value}
        if parts is None:
            parts = self._parts(reason, snapshot=self._async is not None)
        self.last_saved_step, self.last_saved_reason = step, reason
        self.training_rows = [row for row in self.training_rows if row.get("global_step", 0) > step]
        self.validation = {s: m for s, m in self.validation.items() if s > step}
        if self._async is None:
            return self._write(self.ctx, name, parts, meta, value)
        self._async.submit(functools.partial(self._write, self._async_ctx, name, parts, meta, value), description=name)
        return self.root / name

    def _write(self, ctx: DistContext, name: str, parts: list[Part], meta: dict[str, Any], value: float | None) -> Location:
        """Write, publish, then move the other pointers and apply retention; a collective over
        ``ctx`` (the background writer's group for an asynchronous save, run in its thread).
        Returns the published directory; raises ``CheckpointSaveError`` on every rank when any
        step failed anywhere (``LATEST`` is then unchanged, unless only the steps after it failed)."""
        started = time.monotonic()
        # object storage: each rank stages locally, under rank 0's checkpoint id (the files' prefix)
        sink = None
        if is_object(self.root):
            assert self.local is not None, "a root on object storage has its local directory"
            sink = Sink.for_save(self.root, self.local, name, ctx.broadcast_object(meta["checkpoint_id"]), ctx.rank)
        try:
            written = write_checkpoint(ctx, self.root, name, parts, sink)  # every rank's files durable (and uploaded), or raise
            error, victims = None, []
            if ctx.rank == 0:
                try:
                    if isinstance(self.root, Path):
                        publish(self.root, name, written, meta)  # manifest, rename, LATEST
                    else:
                        assert sink is not None
                        self._pruning.replaced(name, object_save.publish(self.root, name, written, meta, sink))  # manifest, LATEST
                except save_failures() as exc:  # noqa: BLE001 - any failure must reach every rank
                    error = describe_failure(exc)
                else:
                    try:
                        victims = self._after_publish(self.root / name, value)  # LOWEST_VAL, retention's choice
                    except save_failures() as exc:  # noqa: BLE001 - any failure must reach every rank
                        error = f"after publishing (the checkpoint itself is published): {describe_failure(exc)}"
            victims = raise_publish_verdict(ctx, name, error, victims)
        finally:
            if sink is not None:
                sink.discard()
        if ctx.rank == 0:  # the one-line report of the checkpoint (on stderr without logging set up)
            took, nbytes = time.monotonic() - started, sum(rec.size for rec in written.mine)
            wrote = f"rank 0 wrote {_size(nbytes)} at {_size(nbytes / max(took, 1e-9))}/s"
            announce(log, "saved %s (%s) in %.2f s; %s; %s -> %s", name, meta.get("reason"), took, wrote, LATEST, name, rank=0)
        self._pruning.remember(name, [rec.path for rec in written.mine])
        self._pruning.delete(ctx, victims)  # in the background
        return self.root / name

    def _run_id(self) -> str:
        """This run's id, decided once, at its first save: the one given at construction (the
        environment's), else that of the checkpoint resumed from (one id across restarts; not
        one loaded through ``load_path``: another run's), else a fresh one."""
        if self.run_id is None:
            self.run_id = self._resumed_run_id or uuid.uuid4().hex
        return self.run_id

    def wait(self) -> Location | None:
        """Wait for the asynchronous save in flight (if any) to be published; returns its directory.

        Raises its ``CheckpointSaveError`` (on every rank), or ``AsyncSaveTimeout`` after
        ``checkpoint.async_timeout_s`` seconds; ``KeyboardInterrupt`` as :meth:`save` does.
        """
        if self._async is None:
            return None
        with HeldInterrupt():
            return self._async.wait(self.config.async_timeout_s)

    def needs_final_save(self, step: int) -> bool:
        """Whether the end of training at ``step`` must still save: ``step`` is unsaved, or it was
        saved for another reason while ``save_consolidated: final`` wants the run's last checkpoint
        to hold the Hugging Face bundle (a periodic save on the last step of a loader without a
        length, which could not know it was the last; or a resume from such a checkpoint). The
        re-save replaces that checkpoint, same name, as a save of the same step does."""
        if self.last_saved_step != step:
            return True
        return self.config.save_consolidated == "final" and self.last_saved_reason != "final"

    @property
    def save_in_flight(self) -> bool:
        """True while an asynchronous save has not been collected by :meth:`wait`."""
        return self._async is not None and self._async.in_flight

    def close(self) -> None:
        """Wait for the save in flight (see :meth:`wait`), then for retention's background deletion
        (at most :data:`~resilience.checkpoint.policy.pruning.DELETE_WAIT_S` seconds: an exit, 75 after a preemption, never hangs on a
        slow delete; what is left is removed by a later save or start), release the staging buffers and the
        background writer's process group. A SIGINT is not held here: the exit path after a first
        Ctrl-C that interrupted training lets the save in flight publish, and a second one aborts."""
        try:
            if self._async is not None:
                self._async.wait(self.config.async_timeout_s)
        finally:
            self._pruning.finish(self.ctx)
            self._buffers.forget()
            if self._async_ctx is not self.ctx and not self.save_in_flight:
                self._async_ctx.close()

    def _after_publish(self, final: Location, value: float | None) -> list[str]:
        """Rank 0, once ``LATEST`` names ``final``: move ``LOWEST_VAL``, then retention's victims
        renamed aside; returns their names (deleted after the save's last collective, see :meth:`_delete`)."""
        phase("after_publish")
        self.lowest_val.consider(final, value)
        return self._pruning.set_aside(final, self.run_id)

    def _parts(self, reason: SaveReason, *, snapshot: bool = False) -> list[Part]:
        """The pieces of this checkpoint (:func:`checkpoint_parts`); with ``snapshot`` its tensors
        are copied into the staging buffers, for a save written in the background."""
        assert self.state is not None  # save() refuses a save with neither state nor parts
        return checkpoint_parts(
            self.state,
            self.scheduler,
            reason=reason,
            config=self.config,
            ctx=self.ctx,
            group=self.ctx.group if self._async is None else self._async_ctx.group,
            root=self.log_root,  # a PEFT model's adapters are written ahead into it: a local directory, also on object storage
            buffers=self._buffers if snapshot else None,
            run_config=self.run_config,
            global_batch_size=self.global_batch_size,
            training_rows=self.training_rows,
            validation=self.validation,
            layout_cache=self._layout_cache,
            optim_cache=self._optim_cache,
        )


def _size(nbytes: float) -> str:
    """``nbytes`` for a person: ``812 B``, ``3.4 MB``, ``1.20 GB`` (decimal units, as disks are sold)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"
