"""The global batch size (samples per optimizer step over the data-parallel replicas) and a change of it at resume.

Every checkpoint records the global batch it was trained with (``meta.global_batch_size``):
``step_scheduler.global_batch_size`` when given, else the loader's batch size summed over the
data-parallel replicas (:mod:`resilience.state.data_parallel`: the ranks of one replica, e.g. the
tensor-parallel ranks of a mesh, see the same batches and count once). At resume with another
value the epoch continues exactly at the next unseen sample, or the resume is refused
(:class:`BatchSizeChangeRefused`, exit 2) — samples are never skipped or repeated silently. The
counters' rule, the one Megatron/NeMo keep under a batch-size ramp: ``global_step`` counts
optimizer steps of the whole run and never goes back, so the LR scheduler's step (it counts
``optimizer.step()`` calls) stays equal to it and new checkpoint names stay above the existing
ones; only the position within the epoch is re-expressed in batches of the new size.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from resilience.config.checks import ConfigError
from resilience.config.step_scheduler import StepSchedulerConfig
from resilience.distributed import DistContext
from resilience.state.accumulation import check_accumulation
from resilience.state.data_parallel import DataParallel, data_parallel_layout
from resilience.state.data_position import epoch_setter, is_stateful, loader_length
from resilience.state.training_state import TrainingState

log = logging.getLogger("resilience")

KEY = "step_scheduler.global_batch_size"


class BatchSizeChangeRefused(ConfigError):
    """The global batch changed since the checkpoint and the epoch cannot continue exactly with it."""


def loader_batch_size(loader: Any) -> int | None:
    """Samples per batch of ``loader`` on this rank: its ``batch_size``, else its batch sampler's;
    ``None`` when it cannot be known (a list of batches, ``batch_size=None``, a custom sampler)."""
    for obj in (loader, getattr(loader, "batch_sampler", None)):
        size = getattr(obj, "batch_size", None)
        if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
            return size
    return None


def global_batch_size(configured: int | None, loader: Any, ctx: DistContext, accumulation: int = 1, replicas: Sequence[int] | None = None) -> int | None:
    """Samples per optimizer step over the data-parallel replicas: ``configured`` when given, else
    the sum of one :func:`loader_batch_size` per replica times ``accumulation``
    (``step_scheduler.gradient_accumulation_steps``), or ``None`` when any rank's cannot be known. A
    collective (every rank calls it).

    Args:
        replicas: every rank's data-parallel replica, by rank (``DataParallel.replicas``); ``None``:
            every rank its own.

    Raises:
        ConfigError: two ranks of one replica have different batch sizes, or ``configured`` differs
            from what the loaders give (the sum x ``accumulation``): the sample arithmetic of a
            resume with another batch size would then be wrong.
    """
    sizes = ctx.all_gather_object(loader_batch_size(loader))
    replicas = list(replicas) if replicas is not None else list(range(len(sizes)))
    per_replica: dict[int, int] = {}
    for rank, (replica, size) in enumerate(zip(replicas, sizes)):
        if size is not None and per_replica.setdefault(replica, size) != size:
            raise ConfigError(
                f"dataloader: rank {rank} has batch size {size} but another rank of its data-parallel replica {replica} has "
                f"{per_replica[replica]} (rank -> batch size: {dict(enumerate(sizes))}); the ranks of one replica train on the same batches"
            )
    derived = None if any(size is None for size in sizes) else sum(per_replica.values()) * accumulation
    if configured is not None and derived is not None and configured != derived:
        raise ConfigError(
            f"{KEY} (MindSpore: training.global_batch_size): {configured} does not match the loaders: batch sizes {sizes} over "
            f"{len(sizes)} rank(s) in {len(per_replica)} data-parallel replica(s) (the ranks of one replica count once) x "
            f"step_scheduler.gradient_accumulation_steps {accumulation} = {derived} samples per optimizer step. "
            f"Set {KEY} to {derived}, or null to derive it"
        )
    return configured if configured is not None else derived


def batch_layout(config: StepSchedulerConfig, state: TrainingState, ctx: DistContext, data_parallel: Any = None) -> tuple[int | None, DataParallel]:
    """This run's global batch (:func:`global_batch_size` of ``config``'s ``global_batch_size`` and
    ``gradient_accumulation_steps``) and data-parallel layout (:func:`~resilience.state.data_parallel.data_parallel_layout`
    of ``data_parallel``, what ``resilient_loop()`` was given); collectives. Raises ``ConfigError`` as those do."""
    check_accumulation(config.gradient_accumulation_steps, state.optimizer)  # Accelerate's, if any, must agree
    layout = data_parallel_layout(state.dataloader, state.model, ctx, data_parallel)
    return global_batch_size(config.global_batch_size, state.dataloader, ctx, config.gradient_accumulation_steps, layout.replicas), layout


def epoch_complete(loader: Any, batches_in_epoch: int) -> bool:
    """True when every batch of the epoch is consumed (the loader has a length and it is reached)."""
    length = loader_length(loader)
    return length is not None and batches_in_epoch >= length


def continue_with_batch_size(
    step_state: dict[str, int],
    data_position: dict[str, Any] | None,
    meta: dict[str, Any],
    new: int | None,
    *,
    loader: Any,
    checkpoint: str,
    configured: bool,
    accumulation: int = 1,
) -> tuple[dict[str, int], dict[str, Any] | None]:
    """The step counters and data position to resume with under global batch ``new``.

    Unchanged when the global batch is the same or either side is unknown (``None``: nothing to
    compare; the epoch continues by batch count, as saved). When it changed, the samples consumed
    in the epoch (``batches_in_epoch`` loader batches of ``old / A_old`` samples over the replicas) must be
    a whole number of new loader batches (``new / A_new``): the position
    becomes that number of batches. A torchdata ``StatefulDataLoader``'s own state counts samples
    and is loaded as saved; any other loader replays the epoch's sampler order (``set_epoch`` or
    the saved RNG) and skips those batches. An epoch that was complete stays complete.
    ``global_step`` and ``epoch`` are never changed.

    Args:
        step_state: the checkpoint's ``step_scheduler.json`` (epoch, batches_in_epoch, global_step).
        data_position: this rank's saved data position, or ``None``.
        meta: the checkpoint's manifest meta (``global_batch_size``, ``epoch_complete``).
        new: this run's global batch size, or ``None`` when unknown.
        loader: this run's dataloader (its length ends a complete epoch).
        checkpoint: the checkpoint's name, for messages.
        configured: ``new`` came from the configuration (else from the loader), for messages.
        accumulation: this run's ``gradient_accumulation_steps`` (the checkpoint's is in ``meta``,
            1 when absent): positions count loader batches of global batch / accumulation samples.

    Raises:
        BatchSizeChangeRefused: the consumed samples are not a whole number of new batches, or the
            loader is stateful, its state does not count samples and its order cannot be replayed.
    """
    _check_replayable(data_position, loader, checkpoint)
    old = meta.get("global_batch_size")
    if old is None or new is None:
        if old is not None and new is None:
            log.warning(
                "%s was trained with a global batch of %d samples; this run's cannot be known (its loader has "
                "no batch_size): a change would go unnoticed. Set %s to check it",
                checkpoint,
                old,
                KEY,
            )
        return step_state, data_position
    # batches_in_epoch counts loader batches (micro-batches) of global batch / accumulation samples over all
    # ranks: only a change of that size moves the position (a change of the accumulation alone does not)
    old_per_batch = int(old) // int(meta.get("gradient_accumulation_steps") or 1)
    per_batch = new // accumulation
    if old_per_batch == per_batch:
        return step_state, data_position
    samples = int(step_state["batches_in_epoch"]) * old_per_batch
    length = loader_length(loader) if meta.get("epoch_complete") else None  # known: the saved epoch was complete
    complete = length is not None
    if length is not None:
        moved = length  # the next epoch starts fresh at any batch size
    elif samples % per_batch == 0:
        moved = samples // per_batch
    else:
        source = "configured" if configured else "the loader's batch size x data-parallel replicas, as step_scheduler.global_batch_size is null"
        raise BatchSizeChangeRefused(
            f"{KEY} changed from {old} (saved in {checkpoint}) to {new} ({source}): the {samples} samples of epoch "
            f"{step_state['epoch']} consumed so far are not a whole number of loader batches of {per_batch} over the data-parallel replicas "
            f"(a global batch of {new} in {accumulation} micro-batch(es)), so resuming would "
            f"skip or repeat samples. Resume with a global batch of {old}, or with a per-rank batch x data-parallel replicas that "
            f"divides {samples}, or from a checkpoint at an epoch's end"
        )
    where = (
        f"epoch {step_state['epoch']} was complete: the next starts at its first sample"
        if complete
        else f"epoch {step_state['epoch']} continues after its {samples} consumed samples (batch {moved} of the new size)"
    )
    log.warning(
        "%s: global batch %d -> %d samples: %s; global_step %d continues (it counts optimizer steps, as the LR scheduler does)",
        checkpoint,
        old,
        new,
        where,
        step_state["global_step"],
    )
    state = {**step_state, "batches_in_epoch": moved}
    if data_position is None:
        return state, None
    if _counts_samples(data_position.get("loader")):
        # torchdata's StatefulDataLoader: its batch sampler's state counts samples, so loaded into the
        # loader of the new batch size it continues at the same sample, whatever its sampler
        return state, {**data_position, "batches_in_epoch": moved}
    if not _replayable(loader, data_position):
        raise BatchSizeChangeRefused(
            f"{KEY} changed from {old} (saved in {checkpoint}) to {new}, and the loader's own state does not count "
            "samples (no torchdata samples_yielded) while its sampler has no set_epoch: the epoch's order cannot be "
            f"replayed exactly. Resume with a global batch of {old}, from a checkpoint at an epoch's end, or use a "
            "sampler with set_epoch (DistributedSampler)"
        )
    # replay the epoch's sampler order (set_epoch, or the saved RNG) and skip `moved` batches of the new size
    return state, {**data_position, "batches_in_epoch": moved, "loader": None}


def _counts_samples(loader_state: Any) -> bool:
    """True for a torchdata ``StatefulDataLoader`` state (single process): its batch sampler's
    ``samples_yielded``, which a loader of another batch size resumes from sample for sample."""
    inner = loader_state.get("_sampler_iter_state") if isinstance(loader_state, dict) else None
    return isinstance(inner, dict) and isinstance(inner.get("samples_yielded"), int)


def _check_replayable(data_position: dict[str, Any] | None, loader: Any, checkpoint: str) -> None:
    """Refuse to replay (another data-parallel layout) a stateful loader's epoch mid-way whose order cannot be
    drawn again: its own state is not used, its sampler has no ``set_epoch``, and its epoch's start RNG was not
    saved (a loader with its own state does not need it otherwise)."""
    if data_position is None or data_position.get("loader") is not None or not data_position.get("batches_in_epoch"):
        return
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, torch.utils.data.SequentialSampler) and not _replayable(loader, data_position):
        raise BatchSizeChangeRefused(
            f"{checkpoint} was saved under another data-parallel layout, and this loader's epoch is replayed from its start, "
            f"but its sampler ({type(sampler).__name__}) has no set_epoch and the order it drew cannot be drawn again: resuming "
            "would train other samples than the ones left. Resume under the saved layout, from a checkpoint at an epoch's end, "
            "or use a sampler with set_epoch (DistributedSampler)"
        )


def _replayable(loader: Any, data_position: dict[str, Any]) -> bool:
    """The epoch's order can be drawn again: the loader has no state of its own (its epoch-start RNG
    is saved), its sampler has ``set_epoch``, or that RNG was saved anyway."""
    return not is_stateful(loader) or epoch_setter(loader) is not None or data_position.get("epoch_rng") is not None
