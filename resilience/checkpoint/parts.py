"""What goes into a checkpoint: the :class:`Part` list of one save.

Every value is captured when the list is built; the parts only write it (in the background for
an asynchronous save), so training may change the live objects as soon as the list exists. A
part is data: a plain function of this module or a format module, and the captured values it is
called with.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from resilience.checkpoint.formats import hf_export, model_io, optim_io, pieces
from resilience.checkpoint.formats.bundle_shards import write_bundle_share
from resilience.checkpoint.formats.extra_state import save_extra_state
from resilience.checkpoint.formats.plan_cache import LayoutCache
from resilience.checkpoint.formats.state_dicts import get_model_state_dict, get_state_dict
from resilience.checkpoint.layout import COMMON, CONFIG, LOSSES, LR_SCHEDULER, MODEL_DIR, RANK_STATE_DIR, STEP_SCHEDULER, TRASH_PREFIX, rank_state_file
from resilience.checkpoint.policy.lowest_val import json_safe
from resilience.checkpoint.staging import StagingBuffers
from resilience.checkpoint.storage.durable import FileRecord
from resilience.config import CheckpointConfig
from resilience.distributed import DistContext
from resilience.state.data_position import data_position_json, loader_length
from resilience.state.rng import capture_rng_state, write_rng_state
from resilience.state.step_scheduler import StepScheduler
from resilience.state.training_state import TrainingState

By = Literal["each rank", "rank 0", "all ranks"]  # who writes a part (see Part)


@dataclasses.dataclass(frozen=True)
class Part:
    """One piece of a checkpoint on this rank, as data: ``write(staging_dir, *args, **kwargs)``, a
    plain function, with the values it writes (captured when the part was made) in ``args`` and
    ``kwargs``. It returns the files it wrote, each a path relative to the staging directory
    (fsync'd and digested afterwards by reading it back) or a :class:`FileRecord` of a file
    already fsync'd and digested while it was written.

    ``by`` says who writes it: ``"each rank"`` (its own files: model shard, rank state: RNG
    and data position), ``"rank 0"`` (the run's records, built on rank 0 only) or ``"all ranks"`` (one
    collective write, DCP: every rank runs it, in the same order, after its own parts).
    ``after_peers`` parts run once every rank's other parts are durable, for a part that reads
    files other ranks wrote (the Hugging Face bundle of a sharded model, streamed from every
    rank's shards); every rank must have the same number of them (they end with one more
    all-gather).

    ``own``: the files are this rank's own, read back (at the same world size) by this rank only:
    rank state, a sharded model's and optimizer's shards, DCP's per-rank files. They go into a
    rank manifest (:func:`~resilience.checkpoint.storage.manifest.write_rank_manifest`), not into
    ``manifest.json``, which then stays O(tensors) at any number of ranks. Files that other ranks
    plan their reads with (a replicated model's and optimizer's files, read 1/N by each rank) and
    the run's records are not ``own``.
    """

    name: str
    write: Callable[..., Sequence[str | FileRecord]]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    by: By = "each rank"
    after_peers: bool = False
    own: bool = False
    peers_read: tuple[str, ...] = ()
    """The directories of the checkpoint whose files an ``after_peers`` part reads; on object
    storage each rank fetches the peers' files there into its own staging first."""

    @property
    def collective(self) -> bool:
        """Whether every rank must run this part together (``by == "all ranks"``)."""
        return self.by == "all ranks"


def checkpoint_parts(
    state: TrainingState,
    scheduler: StepScheduler,
    *,
    reason: str,
    config: CheckpointConfig,
    ctx: DistContext,
    group: Any,
    root: Path,
    buffers: StagingBuffers | None,
    run_config: dict[str, Any],
    global_batch_size: int | None,
    training_rows: list[dict[str, Any]],
    validation: dict[int, dict[str, Any]],
    layout_cache: LayoutCache | None = None,
    optim_cache: LayoutCache | None = None,
) -> list[Part]:
    """The pieces of this checkpoint on this rank, every value captured now (the parts only write).

    ``group`` is the one the collective parts use (the background writer's for an asynchronous
    save). With ``buffers`` (a snapshot) the model and optimizer tensors are copied into them, so
    the parts can run in the background while training changes the live tensors. Rank 0 adds
    the run's records: ``config.yaml``, counters, ``common.json`` and ``losses.json`` (from
    ``training_rows`` and ``validation``). ``layout_cache`` and ``optim_cache`` (the
    checkpointer's) reuse the model's and a sharded optimizer's plans while the layout is unchanged.
    ``root``: a local directory, where a PEFT model's adapters are written ahead of the save (the
    checkpoint root; on object storage its local directory, never the store).
    """
    rank = ctx.rank
    parts = []
    model_state = None
    if state.optimizer is not None and not config.no_save_optim:  # collective first: it must run on every rank
        # Both state dicts in one call: torch's helpers map every parameter to its name once, not
        # twice (for an asynchronous save this runs while training waits).
        model_state, optim_state = get_state_dict(state.model, state.optimizer)
        tensors, skeleton = optim_io.capture_optimizer(
            state.model,
            state.optimizer,
            world_size=ctx.world_size,
            gather=ctx.all_gather_object,
            same=ctx.same_everywhere,
            state=optim_state,
            rank=rank,
            cache=optim_cache,
        )
        by: By = "all ranks" if optim_io.uses_dcp((tensors, skeleton)) else "each rank"  # DCP's save is a collective
        own = not optim_io.is_replicated((tensors, skeleton))  # a replicated state's files are read 1/N by every rank
        if buffers is not None:
            tensors = buffers.copy_in(tensors, prefix="optim.")
        kwargs = {"rank": rank, "world_size": ctx.world_size, "group": group}
        parts.append(Part("optimizer", optim_io.save_optimizer, ((tensors, skeleton),), kwargs, by=by, own=own))
    # every rank writes its shard
    parts += _model_parts(state, reason, _SaveSite(config, ctx, group, root, buffers), model_state, layout_cache)
    if rank == 0:
        if state.lr_scheduler is not None:
            parts.append(_json_part("lr_scheduler", LR_SCHEDULER, optim_io.lr_scheduler_json(state.lr_scheduler)))
        parts.append(_json_part("step_scheduler", STEP_SCHEDULER, json.dumps(scheduler.state_dict())))
        parts.append(_json_part("config", CONFIG, yaml.safe_dump(run_config, sort_keys=False)))
        for key, obj in state.extra.items():
            extra = copy.deepcopy(obj.state_dict())
            parts.append(Part(f"extra.{key}", save_extra_state, (key, extra), by="rank 0"))
        parts.append(_json_part("common", COMMON, json.dumps(_common(state, scheduler, global_batch_size))))
        parts.append(_json_part("losses", LOSSES, json.dumps(_losses(scheduler.global_step, training_rows, validation))))
    rng = capture_rng_state()
    position = None if state.dataloader is None else data_position_json(state.dataloader, scheduler.batches_in_epoch)
    parts.append(Part(RANK_STATE_DIR, _write_rank_state, (rank, rng, position), own=True))  # one file per rank: N, not 2N
    if buffers is not None:
        buffers.synchronize()
    return parts


def external_parts(write: Callable[[Path], Iterable[str | os.PathLike[str]]], *, rank: int, run_config: dict[str, Any] | None) -> list[Part]:
    """The parts of a save whose files a trainer's own code writes (a trainer integration,
    :mod:`resilience.integrations.session`): one collective part, run on every rank in the main
    thread, that calls ``write(staging_dir)`` and takes the files it returns as this rank's
    (paths relative to ``staging_dir``, or absolute ones inside it; each is fsync'd and digested
    after ``write`` returns, as files written by a library that hides its bytes). Every file must
    be returned by exactly one rank: the one that wrote it. With ``run_config`` (rank 0) the
    part then writes ``config.yaml``, the run's configuration, which ``resilience advise`` reads."""
    text = yaml.safe_dump(run_config, sort_keys=False) if run_config is not None else None
    return [Part("external", _write_external, (write, text), by="all ranks")]


def _write_external(directory: Path, write: Callable[[Path], Iterable[str | os.PathLike[str]]], config_text: str | None) -> list[str]:
    """Run the trainer's ``write`` into ``directory``; its files (relative paths), then ``config.yaml``.

    Raises:
        ValueError: ``write`` returned a path outside ``directory``, or ``config.yaml`` (ours).
    """
    written = []
    for path in write(directory):
        rel = os.path.relpath(path, directory) if os.path.isabs(path) else os.fspath(path)
        if rel.startswith(os.pardir) or rel == CONFIG:
            raise ValueError(f"the trainer's checkpoint writer returned {os.fspath(path)!r}: not a file of its own inside {directory}")
        written.append(rel)
    if config_text is not None:
        written += _write_text(directory, CONFIG, config_text)
    return written


def epoch_of(scheduler: StepScheduler) -> int:
    """The epoch the last step ran in: after an epoch's last batch the scheduler already points
    at the next epoch, but the checkpoint is named after the epoch the step ran in."""
    return scheduler.epoch - 1 if scheduler.batches_in_epoch == 0 and scheduler.epoch > 0 else scheduler.epoch


@dataclasses.dataclass(frozen=True)
class _SaveSite:
    """What every part of one save is written with: :func:`checkpoint_parts`' arguments of the same names."""

    config: CheckpointConfig
    ctx: DistContext
    group: Any
    root: Path
    buffers: StagingBuffers | None


def _model_parts(state: TrainingState, reason: str, site: _SaveSite, tensors: dict[str, Any] | None, layout_cache: LayoutCache | None) -> list[Part]:
    """The model's part; with a Hugging Face bundle of a sharded (DTensor) model, also the part that
    streams it from every rank's shards once they are all written (no rank holds the full model).
    ``tensors``: ``get_model_state_dict(state.model)`` when the caller has it already."""
    config, ctx, group, root, buffers = site.config, site.ctx, site.group, site.root, site.buffers
    fmt, when = config.model_save_format, config.save_consolidated
    consolidated = when == "every" or (when == "final" and reason == "final")
    if hf_export.is_peft_model(state.model):
        # Adapters are written now, on rank 0, even for an asynchronous save (small, and peft
        # reads the live weights); the background part only moves them into the checkpoint.
        held = root / f"{TRASH_PREFIX}adapter_{uuid.uuid4().hex[:8]}"  # cleaned up at start if left
        written = model_io.save_model(held, state.model, rank=ctx.rank, tokenizer=state.tokenizer) if ctx.rank == 0 else []
        return [Part("model", _move_in, (held, written), by="rank 0")]  # the other ranks move in nothing
    tensors = get_model_state_dict(state.model) if tensors is None else tensors
    bundle = []
    if consolidated and fmt == "safetensors" and pieces.is_sharded(tensors):
        consolidated = False  # the model part writes the shards only; this part the bundle, after them
        bundle = [
            Part(
                "consolidated",
                write_bundle_share,
                (),
                {"rank": ctx.rank, "world_size": ctx.world_size},
                by="each rank",
                after_peers=True,
                peers_read=(MODEL_DIR,),
            )
        ]
    # Tied keys are found on the live tensors (a snapshot's separate copies no longer share) and
    # are neither copied nor written: the tensor is stored once, the tie recorded.
    aliases = model_io.tied_aliases(state.model, tensors) if fmt == "safetensors" else {}
    tensors = {key: t for key, t in tensors.items() if key not in aliases}
    # Who writes which piece of a sharded model is settled now, on this thread and group (a
    # collective), so the part itself (possibly in the background) only writes; a replicated
    # model's plan needs no peer, and is made by the part, off the time training waits.
    sharded = fmt == "safetensors" and pieces.is_sharded(tensors)
    cache = layout_cache if layout_cache is not None else LayoutCache(enabled=False)
    plan = cache.plan(tensors, rank=ctx.rank, world_size=ctx.world_size, gather=ctx.all_gather_object, aliases=aliases) if sharded else None
    if buffers is not None:
        tensors = buffers.copy_in(tensors, prefix="model.")
    model = Part(
        "model",
        model_io.save_model,
        (state.model,),
        {
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "group": group,
            "save_format": fmt,
            "consolidated": consolidated,
            "tokenizer": state.tokenizer,
            "state_dict": tensors,
            "aliases": aliases,
            "plan": plan,
            "layout_cache": layout_cache,
        },
        by="all ranks" if fmt == "torch_save" else "each rank",
        own=sharded or fmt == "torch_save",  # each rank's shards (DCP's per-rank files); a replicated model's are read 1/N by every rank
    )
    return [model, *bundle]


def _common(state: TrainingState, scheduler: StepScheduler, global_batch_size: int | None) -> dict[str, Any]:
    """MindSpore's ``common.json``: ``epoch_num`` is the 1-based epoch of the step, ``step_num``
    the step's 1-based index within it; ``loss_scale`` comes from a registered ``GradScaler``."""
    epoch = epoch_of(scheduler)
    step_num: int | None = scheduler.batches_in_epoch  # None (null) at an epoch end of a loader without a length: not counted
    if epoch != scheduler.epoch:  # the step ended its epoch: it was the epoch's last batch
        step_num = loader_length(state.dataloader)
    loss_scale = 1.0
    for obj in state.extra.values():
        if callable(getattr(obj, "get_scale", None)):
            loss_scale = float(obj.get_scale())
    return {
        "epoch_num": epoch + 1,
        "step_num": step_num,
        "global_step": scheduler.global_step,
        "loss_scale": loss_scale,
        "global_batch_size": global_batch_size,
        "ckpt_status": None,
    }


def _losses(step: int, training_rows: list[dict[str, Any]], validation: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """``losses.json``: NeMo's ``train_loss`` (the last ``loss`` logged at this step) and
    ``val_loss`` (or every validation metric when there are several), plus ``training``:
    every row logged since the previous checkpoint of this process (all rows are in
    ``training.jsonl``)."""
    rows = [row for row in training_rows if row.get("global_step", 0) <= step]
    losses = [row["loss"] for row in rows if row.get("global_step") == step and "loss" in row]
    doc: dict[str, Any] = {"global_step": step, "train_loss": losses[-1] if losses else None}
    metrics = validation.get(step)
    if metrics:
        if len(metrics) == 1:
            doc["val_loss"] = next(iter(metrics.values()))
        else:
            doc.update(metrics)
    doc["training"] = rows
    return json_safe(doc)


def _json_part(name: str, rel: str, text: str, by: By = "rank 0") -> Part:
    """A part writing ``text`` (captured already) to ``rel``."""
    return Part(name, _write_text, (rel, text), by=by)


def _write_text(directory: Path, rel: str, text: str) -> list[str]:
    path = directory / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return [rel]


def _write_rank_state(directory: Path, rank: int, captured: Any, position: str | None) -> list[str]:
    """``rank_state/rank_<R>.safetensors``: this rank's RNG states and data position (JSON text)."""
    rel = rank_state_file(rank)
    (directory / RANK_STATE_DIR).mkdir(exist_ok=True)
    write_rng_state(directory / rel, captured, data_position=position)
    return [rel]


def _move_in(directory: Path, held: Path, written: list[str]) -> list[str]:
    """Move files written ahead of the save (``held/<rel>``) into the staging directory."""
    for rel in written:
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(held / rel, directory / rel)
    shutil.rmtree(held, ignore_errors=True)
    return written
