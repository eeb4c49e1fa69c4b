"""The load side of :class:`~resilience.checkpoint.checkpointer.Checkpointer`, top to bottom.

:meth:`Resuming.restore` is the whole resume: remove a crashed save's leftovers, choose the
checkpoint (rank 0, :mod:`~.reader` and :mod:`~.resume_choice`; the manifest parsed once), load it
into the registered state while its bytes are digested (:func:`~.reader.checking_while_loading`,
:func:`~.loading.load_state`), fall back to an older one when it turns out corrupt, and re-express
the step counters and data position for this run's batch size. The one :class:`Restored` it
returns is applied by the loop: the counters at once, the RNG and data position when the epoch's
iterator exists (creating it draws from the global RNG, as it did before the save).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from resilience.checkpoint import object_load
from resilience.checkpoint.layout import LATEST, MANIFEST, parse_checkpoint_name
from resilience.checkpoint.loading import Restored, balanced_loading, inline_files, load_state
from resilience.checkpoint.policy.lineage import descends_from, meta_of, parent_ref
from resilience.checkpoint.policy.lowest_val import LowestVal
from resilience.checkpoint.reader import CheckpointCorrupted, CheckpointNotFound, checking_while_loading, find_resume_point
from resilience.checkpoint.resume_choice import remove_leftovers
from resilience.checkpoint.storage.manifest import read_manifest
from resilience.checkpoint.storage.object_path import Location, is_object
from resilience.checkpoint.storage.pointers import PointerError, read_pointer
from resilience.config import CheckpointConfig
from resilience.distributed import DistContext
from resilience.state.batch_size import continue_with_batch_size
from resilience.state.data_parallel import DataParallel
from resilience.state.rng import load_rng_state
from resilience.state.training_state import TrainingState

log = logging.getLogger("resilience.checkpoint")


class Resuming:
    """Resume methods of :class:`~resilience.checkpoint.checkpointer.Checkpointer` (a base class
    only to keep the save side and the load side in modules of their own; it uses the
    checkpointer's ``config``, ``ctx``, ``root``, ``state``, ``lowest_val`` and bookkeeping)."""

    config: CheckpointConfig
    ctx: DistContext
    root: Location
    state: TrainingState | None
    lowest_val: LowestVal
    resume_source: str | None
    run_id: str | None
    run_config: dict[str, Any]
    global_batch_size: int | None
    data_parallel: DataParallel | None
    _chosen_manifest: tuple[Location | None, dict[str, Any] | None]
    parent: dict[str, Any] | None
    local: Path | None
    verify_choice: bool = False
    """Digest every file of the checkpoint chosen to resume from before it is returned (a
    fallback to an older one when they differ); False: sizes only, the bytes being checked while
    :meth:`load` reads them. True for a trainer integration, whose trainer loads the files itself
    (:meth:`adopt`, :mod:`resilience.integrations.session`)."""

    def missing_source(self) -> str | None:
        """Why ``restore_from`` or ``load_path`` cannot be loaded because it names no existing path,
        or ``None``; the loop raises it as a ``ConfigError`` at ``resilient_loop()``, before any
        training (exit 2), not at the first step. ``load_path`` counts only while
        ``checkpoint_dir`` has no ``LATEST`` of its own (a requeued run never reads it again). A path
        that exists but holds no valid checkpoint is found by :meth:`restore` (``CheckpointNotFound``)."""
        cfg = self.config
        if cfg.restore_from is not None:
            given = Path(cfg.restore_from)
            path: Location = given
            if is_object(self.root) and not given.is_absolute():
                path = self.root / cfg.restore_from  # a name under the bucket's prefix
            if not path.exists() and (is_object(path) or path.is_absolute() or not (self.root / path).exists()):
                return (
                    f"checkpoint.restore_from={cfg.restore_from!r}: no such checkpoint directory; accepted: an existing "
                    f"checkpoint directory, absolute or a name under checkpoint.checkpoint_dir ({str(self.root)!r})"
                )
        has_latest = (self.root / LATEST).is_file() if is_object(self.root) else os.path.lexists(self.root / LATEST)
        if cfg.load_path is not None and not Path(cfg.load_path).exists() and not has_latest:
            return f"checkpoint.load_path={cfg.load_path!r}: no such directory; accepted: a checkpoint directory or a root holding LATEST"
        return None

    def restore(self) -> Restored | None:
        """Find the checkpoint to resume from and load it into the registered state (:meth:`find_resume_point`
        then :meth:`load`); ``None`` for a fresh start. A collective.

        A checkpoint whose bytes turn out corrupt while loading is marked bad and the newest older
        valid one is loaded instead (it overwrites everything the bad one had loaded).

        Raises:
            ValueError: no state is registered (``state=None``: a trainer integration loads its own
                files, after :meth:`find_resume_point` and :meth:`adopt`).
            CheckpointNotFound: ``restore_from`` or ``load_path`` names a missing, incomplete or
                corrupt checkpoint.
            CheckpointCorrupted: every checkpoint tried was corrupt; the model and optimizer were
                partly overwritten, so the run must not go on: started again, it trains from scratch.
            BatchSizeChangeRefused: the run's global batch differs from the checkpoint's and the
                epoch cannot continue at the next unseen sample (see :mod:`resilience.state.batch_size`).
        """
        state = self.state
        if state is None:
            raise ValueError(
                "Checkpointer.restore(): no state registered (state=None) to load into; "
                "find_resume_point() and adopt() serve a trainer that loads its own files"
            )
        corrupt: CheckpointCorrupted | None = None
        while (directory := self.find_resume_point()) is not None:
            try:
                restored = self.load(directory, state)
            except CheckpointCorrupted as exc:
                if self.resume_source in ("restore_from", "load_path"):
                    raise CheckpointNotFound(f"checkpoint.{self.resume_source}: {exc}") from exc
                if self.ctx.rank == 0:
                    log.warning("skipping invalid checkpoint: %s (marked bad)", exc)
                corrupt = exc
                continue
            if not restored.weights_only:
                self._continue_with_batch_size(restored, state)
            return restored
        if corrupt is not None:
            raise CheckpointCorrupted(
                f"{corrupt}; no older valid checkpoint to fall back to, and the model and optimizer were partly "
                "overwritten while loading it: run again to start from scratch (the corrupt checkpoint is marked bad)"
            )
        return None

    def find_resume_point(self) -> Location | None:
        """The directory to resume from (``restore_from`` or ``LATEST`` with fallback), or ``None``.

        Checks manifests and file sizes; the bytes are checked while :meth:`load` reads them.
        Also removes staging directories left by a crashed save. Raises ``CheckpointNotFound``
        when ``restore_from`` names a missing or invalid checkpoint.
        """
        if not self.config.enabled:
            return None
        if self.ctx.rank == 0:
            remove_leftovers(self.root)
        self.resume_source = None
        if self.config.restore_from is not None and not self._continues_restore_from():
            (found, manifest), source = find_resume_point(self.ctx, self.root, self.config.restore_from, checksums=self.verify_choice), "restore_from"
        else:
            found, manifest = find_resume_point(self.ctx, self.root, None, checksums=self.verify_choice) if self.config.resume else (None, None)
            source = "latest"
            # MindSpore's load_path: only while checkpoint_dir has nothing of its own, so a
            # requeued run continues from its own LATEST instead of loading load_path again.
            if found is None and self.config.load_path is not None:
                (found, manifest), source = self._find_load_path(), "load_path"
        self.resume_source = source if found is not None else None
        self._chosen_manifest = (found, manifest)  # parsed once, by the choice; load() reuses it
        return found

    def _continues_restore_from(self) -> bool:
        """Whether ``LATEST`` is this run's own continuation of ``restore_from``: saved under this
        run's id (the environment's: a requeued Slurm job keeps its job id) with ``restore_from`` in
        its lineage. Then the same command line started again (a requeue, an in-job restart)
        resumes from ``LATEST`` rather than going back to ``restore_from`` at every start and
        setting its own progress aside; a run of another id still starts from ``restore_from``.
        Decided on rank 0 (a collective)."""
        verdict = None
        if self.ctx.rank == 0 and self.run_id is not None and self.config.restore_from is not None:
            path = Path(self.config.restore_from)
            target = path if path.is_absolute() or (path.exists() and not is_object(self.root)) else self.root / self.config.restore_from
            try:
                latest = read_pointer(self.root, LATEST)
            except PointerError:
                latest = None
            if latest is not None and latest.is_dir() and meta_of(latest).get("run_id") == self.run_id and descends_from(self.root, latest, target):
                verdict = latest.name
                log.info(
                    "checkpoint.restore_from=%s: LATEST (%s) continues it in this run (id %s, e.g. a requeued job): resuming from LATEST",
                    self.config.restore_from,
                    latest.name,
                    self.run_id,
                )
        return self.ctx.broadcast_object(verdict) is not None

    def _find_load_path(self) -> tuple[Location | None, dict[str, Any] | None]:
        """``load_path`` as a checkpoint directory, or as a root whose ``LATEST`` (with fallback) is followed."""
        assert self.config.load_path is not None, "called only with a load_path"
        path = Path(self.config.load_path).absolute()
        if (path / MANIFEST).exists() or parse_checkpoint_name(path.name):
            return find_resume_point(self.ctx, self.root, str(path), key="checkpoint.load_path", checksums=self.verify_choice)
        found = find_resume_point(self.ctx, path, None, checksums=self.verify_choice)
        if found[0] is None:
            raise CheckpointNotFound(
                f"checkpoint.load_path={self.config.load_path!r}: no valid checkpoint there (neither a checkpoint "
                "directory nor a root holding LATEST or epoch_<E>_step_<S> checkpoints)"
            )
        return found

    def load(self, directory: Location, state: TrainingState) -> Restored:
        """Restore model, optimizer, LR scheduler and extra state from ``directory`` in place.

        With ``no_load_optim`` and a checkpoint named by ``load_path`` or ``restore_from``, only the
        weights are loaded (MindSpore Transformers); a resume from this run's own ``LATEST`` is
        always complete. A checkpoint saved with ``no_save_optim`` resumes with a fresh optimizer
        (and a warning). Either way an optimizer's ``reload_main_params_from_model()``, where it
        has one, rebuilds its FP32 master copy from the loaded weights.

        Every byte is checked against the manifest while it is read (:func:`~.reader.checking_while_loading`).

        Raises:
            ValueError: the checkpoint was written with a different world size.
            CheckpointCorrupted: its bytes differ from the manifest (it is marked bad; what was
                loaded must not be used: :meth:`restore` falls back to an older checkpoint).
        """
        chosen, manifest = self._chosen_manifest
        if chosen != directory or manifest is None:  # a directory not from find_resume_point
            manifest = read_manifest(directory)
        weights_only = self.config.no_load_optim and self.resume_source in ("load_path", "restore_from")
        inline = inline_files(manifest, state, weights_only=weights_only, world_size=self.ctx.world_size)
        balanced = balanced_loading(self.config, self.ctx)
        checkpoint, fetched = directory, None
        if is_object(directory):  # each rank downloads what it reads whole; the rest is read by ranges
            assert self.local is not None, "a root on object storage has its local directory"
            optimizer = state.optimizer is not None and not weights_only and manifest["meta"].get("optimizer_saved", True)
            fetched = object_load.fetch(
                self.ctx, directory, manifest, self.local, inline=inline, balanced=balanced, optimizer=optimizer, data_parallel=self.data_parallel
            )
            files = fetched.directory
        else:
            files = directory
        restored = None
        try:
            with checking_while_loading(self.ctx, files, manifest, inline=inline, balanced=balanced, checkpoint=checkpoint) as check:
                restored = load_state(files, manifest, state, self.ctx, self.config, weights_only=weights_only, check=check, data_parallel=self.data_parallel)
        finally:
            if fetched is not None:
                fetched.close(keep=restored.rng_file if restored is not None else None)
        restored.directory = checkpoint  # the checkpoint itself (the RNG file may be a local copy)
        if not weights_only:
            self._continue_from(checkpoint, restored.meta)
        return restored

    def adopt(self, directory: Location) -> dict[str, Any]:
        """Continue from ``directory``, the choice of :meth:`find_resume_point`, whose files the
        caller's own trainer loads (a trainer integration): what :meth:`load` records besides the
        state (``LOWEST_VAL`` reloaded, the step last saved, the lineage parent, the run id).
        Returns its manifest's meta. Rank 0 reads the manifest again only for a directory that
        did not come from :meth:`find_resume_point`.

        Raises:
            CheckpointInvalid: ``directory`` has no readable manifest.
        """
        chosen, manifest = self._chosen_manifest
        if chosen != directory or manifest is None:
            manifest = read_manifest(directory)
        meta = manifest.get("meta") or {}
        self._continue_from(directory, meta)
        return meta

    def _continue_from(self, directory: Location, meta: dict[str, Any]) -> None:
        """Record that the next save continues ``directory`` (its manifest ``meta``)."""
        if self.ctx.rank == 0 and self.resume_source != "load_path":
            self.lowest_val.reload()  # the best so far survives the restart
        self.last_saved_step, self.last_saved_reason = meta["global_step"], meta.get("reason")
        self.parent = parent_ref(directory, meta, self.root)
        if self.resume_source != "load_path":
            self._resumed_run_id = meta.get("run_id")

    @staticmethod
    def restore_rng(restored: Restored) -> None:
        """Apply this rank's saved RNG state."""
        if restored.rng_file is not None:
            load_rng_state(restored.rng_file)

    def _continue_with_batch_size(self, restored: Restored, state: TrainingState) -> None:
        """Re-express ``restored``'s step counters and data position for this run's global batch
        (unchanged when it is the saved one); ``state``: what it was loaded into."""
        if restored.step_scheduler is None:
            raise ValueError(f"{restored.directory}: a weights-only restore has no step counters to continue")
        steps = self.run_config.get("step_scheduler", {})
        restored.step_scheduler, restored.data_position = continue_with_batch_size(
            restored.step_scheduler,
            restored.data_position,
            restored.meta,
            self.global_batch_size,
            loader=state.dataloader,
            checkpoint=restored.directory.name,
            configured=steps.get("global_batch_size") is not None,
            accumulation=int(steps.get("gradient_accumulation_steps") or 1),
        )
