"""Loading a checkpoint's state back into a :class:`TrainingState`, in place.

The weights, optimizer, LR scheduler and extra state are loaded now; the step counters, data
position and RNG come back as a :class:`Restored` for the loop to apply at the right moment.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
from pathlib import Path
from typing import Any

from resilience.checkpoint import layout
from resilience.checkpoint.formats import model_io, optim_io
from resilience.checkpoint.formats.extra_state import load_extra_state
from resilience.checkpoint.layout import MODEL_DIR, MODEL_SHARD_GLOB, OPTIM_DIR, STEP_SCHEDULER, is_optim_file
from resilience.checkpoint.storage.content_check import ContentCheck
from resilience.checkpoint.storage.manifest import OWNED, RANK_MANIFESTS
from resilience.checkpoint.storage.object_path import Location
from resilience.config import CheckpointConfig
from resilience.distributed import DistContext
from resilience.sharded_types import any_dtensor
from resilience.state.data_parallel import DataParallel, position_rank
from resilience.state.data_position import parse_data_position, read_data_position
from resilience.state.rng import read_data_position_text
from resilience.state.training_state import TrainingState

log = logging.getLogger("resilience.checkpoint")


@dataclasses.dataclass
class Restored:
    """What :meth:`Checkpointer.load` restored, plus what the loop applies later."""

    directory: Location
    step_scheduler: dict[str, int] | None
    """The step counters (:class:`~resilience.state.step_scheduler.StepScheduler`'s state); ``None``
    with ``weights_only``."""
    data_position: dict[str, Any] | None
    rng_file: Path | None
    """This rank's RNG file; applied by the loop at the point the save captured it."""
    meta: dict[str, Any]
    weights_only: bool = False
    """Only the model weights were loaded (``no_load_optim``): counters, data, RNG start fresh."""


def load_state(
    directory: Path,
    manifest: dict[str, Any],
    state: TrainingState,
    ctx: DistContext,
    config: CheckpointConfig,
    *,
    weights_only: bool,
    check: ContentCheck | None = None,
    data_parallel: DataParallel | None = None,
) -> Restored:
    """Load the checkpoint in ``directory`` (its parsed ``manifest``) into ``state`` (a collective over ``ctx``).

    ``check`` (from :func:`~resilience.checkpoint.reader.checking_while_loading`) digests the files of
    this rank's share that are read whole (:func:`inline_files`) as their bytes pass.

    ``weights_only``: load the model weights and nothing else. A checkpoint saved without
    optimizer state leaves the optimizer fresh (with a warning). Either way an optimizer's
    ``reload_main_params_from_model()``, where it has one, rebuilds its FP32 master copy from the
    loaded weights. Another world size than the saver's is refused unless
    ``config.world_size_change`` is ``elastic`` (or ``config.no_load_optim``); then every rank
    takes the RNG of rank ``rank % saved_world_size``. The data position is that of a saved rank of
    the data-parallel replica this rank belongs to (``data_parallel``; ``None``: every rank its own),
    when the checkpoint had as many replicas; otherwise every rank replays the epoch's order.

    Raises:
        ValueError: the checkpoint was written with a different world size.
    """
    meta = manifest["meta"]
    saved_world = int(meta["world_size"])
    resized = saved_world != ctx.world_size
    if resized and config.world_size_change != "elastic" and not config.no_load_optim:
        raise ValueError(
            f"{directory.name} was saved with world size {saved_world}, this run has {ctx.world_size}: "
            "the data position and RNG streams are per rank. Resume with the same world size, or set "
            "checkpoint.world_size_change=elastic to re-derive them (see its documentation)"
        )
    balanced = ctx if balanced_loading(config, ctx) else None
    model_io.load_model(directory, state.model, group=ctx.group, check=check, balanced=balanced)
    if weights_only:
        _reload_main_params(state.optimizer)
        return Restored(directory=directory, step_scheduler=None, data_position=None, rng_file=None, meta=meta, weights_only=True)
    if state.optimizer is not None and not meta.get("optimizer_saved", True):
        log.warning("%s holds no optimizer state (saved with no_save_optim or without an optimizer): the optimizer starts fresh", directory.name)
        _reload_main_params(state.optimizer)
    elif state.optimizer is not None:
        optim_io.load_optimizer(directory, state.model, state.optimizer, group=ctx.group, check=check, balanced=balanced)
    if state.lr_scheduler is not None:
        optim_io.load_lr_scheduler(directory, state.lr_scheduler)
    for key, obj in state.extra.items():
        obj.load_state_dict(load_extra_state(directory, key))
    rank = ctx.rank
    step_state = json.loads((directory / STEP_SCHEDULER).read_text())
    if resized:
        log.warning("rank %d: resuming %s saved with world size %d under world size %d (elastic)", rank, directory.name, saved_world, ctx.world_size)
    layout = data_parallel or DataParallel(tuple(range(ctx.world_size)))
    source = position_rank(meta.get("data_parallel_replicas"), saved_world, layout, rank)
    if source is None:  # another number of replicas: the same global batches consumed; the new ranks replay the epoch's order
        if not resized:
            log.warning("rank %d: %s was saved under another data-parallel layout: the epoch's order is replayed", rank, directory.name)
        # the order is replayed from the epoch's start: keep what that start drew from (a saved rank's
        # epoch_rng / generators; ranks seed alike), or a shuffle without set_epoch would draw anew
        peer = saved_data_position(directory, manifest, rank % saved_world)
        start = {k: v for k, v in (peer or {}).items() if k.startswith("epoch_")}
        data_position: dict[str, Any] | None = {**start, "batches_in_epoch": step_state["batches_in_epoch"], "loader": None}
    else:  # a rank of the same replica (the ranks of a replica hold the same position)
        data_position = saved_data_position(directory, manifest, source)
    return Restored(
        directory=directory,
        step_scheduler=step_state,
        data_position=data_position,
        rng_file=directory / saved_rng_file(manifest, rank % saved_world),
        meta=meta,
    )


def saved_rng_file(manifest: dict[str, Any], rank: int) -> str:
    """The file holding saved rank ``rank``'s RNG states, relative to the checkpoint: its rank state
    file, or in a checkpoint written before those (per its ``manifest``), its ``rng/`` file."""
    new = layout.rank_state_file(rank)
    old = layout.rng_rank_file(rank)
    return old if RANK_MANIFESTS not in manifest and new not in manifest["files"] and old in manifest["files"] else new


def saved_data_position(directory: Path, manifest: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """Saved rank ``rank``'s data position in the checkpoint ``directory`` (its parsed ``manifest``
    says which layout it has): from its rank state file's header, or in a checkpoint written before
    those, its ``dataloader/`` file; None when the save had no loader."""
    files = manifest["files"]
    if RANK_MANIFESTS in manifest or layout.rank_state_file(rank) in files:  # format 2: every rank has one, in its rank manifest
        text = read_data_position_text(directory / layout.rank_state_file(rank))
        return None if text is None else parse_data_position(text)
    old = layout.dataloader_rank_file(rank)
    return read_data_position(directory / old) if old in files else None


def balanced_loading(config: CheckpointConfig, ctx: DistContext) -> bool:
    """Whether replicated state is loaded balanced (``checkpoint.load_balanced`` and more than one
    rank): each byte read by one rank, broadcast to the others (:mod:`~resilience.checkpoint.formats.balanced_load`)."""
    return bool(config.load_balanced) and ctx.distributed


def inline_files(manifest: dict[str, Any], state: TrainingState, *, weights_only: bool, world_size: int | None = None) -> list[str]:
    """The files :func:`load_state` is expected to read whole, in order, and so to digest as it
    reads them: a replicated model's weight shards and the optimizer's own files (not DCP's,
    which DCP reads); at the saver's ``world_size``, also this rank's own pieces of a sharded model
    and optimizer (its ``OWNED`` files, read whole at the saver's layout). A guess from the names:
    what it misses is digested after the load."""
    files = manifest["files"]
    model_sharded = any_dtensor(state.model.parameters())
    optim = state.optimizer is not None and not weights_only and manifest["meta"].get("optimizer_saved", True)
    inline = [rel for rel in files if (not model_sharded and fnmatch.fnmatch(rel, f"{MODEL_DIR}/{MODEL_SHARD_GLOB}")) or (optim and is_optim_file(rel))]
    if world_size is not None and int(manifest["meta"]["world_size"]) == world_size:
        dirs = (MODEL_DIR, OPTIM_DIR) if optim else (MODEL_DIR,)
        inline += [rel for rel in manifest.get(OWNED, {}) if any(fnmatch.fnmatch(rel, f"{d}/{MODEL_SHARD_GLOB}") for d in dirs)]
    return inline


def _reload_main_params(optimizer: Any) -> None:
    """MindSpore's hook: an optimizer with an FP32 master copy rebuilds it from the model."""
    reload = getattr(optimizer, "reload_main_params_from_model", None)
    if callable(reload):
        reload()
