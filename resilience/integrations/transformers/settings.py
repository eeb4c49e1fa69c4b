"""The Hugging Face ``Trainer``'s own settings against our configuration: one owner per setting.

Keys the ``Trainer`` already owns are read from its ``TrainingArguments``; the same setting in our
config is accepted only when it agrees (or is left at its default), else a ``ConfigError`` names
both, at setup, before any training:

=======================================  ============================================================
ours                                     the ``Trainer``'s
=======================================  ============================================================
``checkpoint.checkpoint_dir``            ``output_dir`` (the checkpoint root when ours is not set)
``checkpoint.max_recent_checkpoints``    ``save_total_limit`` (our retention applies it)
``step_scheduler.ckpt_every_steps``      ``save_strategy="steps"`` + ``save_steps`` (with ``save_strategy="no"``, ours drives the saves)
``step_scheduler.num_epochs``            ``num_train_epochs``
``step_scheduler.max_steps``             ``max_steps``
``step_scheduler.gradient_accumulation_steps``   ``gradient_accumulation_steps``
``step_scheduler.val_every_steps``       ``eval_steps`` (with ``eval_strategy="steps"``)
``step_scheduler.global_batch_size``     ``per_device_train_batch_size`` x ranks x accumulation
``checkpoint.best_metric_key``           ``metric_for_best_model`` (``LOWEST_VAL``: lower is better)
=======================================  ============================================================

Settings that would make a checkpoint unusable or race with ours are refused:
``enable_jit_checkpoint`` (the Trainer's own SIGTERM save), ``save_strategy="best"`` (the Trainer
would cancel a stop's save whose evaluation is no new best), ``save_only_model`` (no optimizer or
RNG state: no exact resume), ``save_on_each_node`` (every node writing the same files), DeepSpeed
and FSDP (their checkpoints are per rank files this integration does not list yet).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

from resilience.config import CheckpointConfig, ConfigError, ResilienceConfig
from resilience.integrations.trainer_owned import is_set, refuse_disagreements

if TYPE_CHECKING:
    from transformers import Trainer

log = logging.getLogger("resilience")

_TRAINER_DEFAULT_OUTPUT_DIR = "trainer_output"
"""``TrainingArguments.output_dir`` when none is given (transformers 5)."""


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """What the integration takes from the ``Trainer`` and our config, reconciled.

    ``config``: ours, with the checkpoint root and retention the ``Trainer`` set;
    ``ckpt_every_steps``: the periodic save the callback drives itself (only with
    ``save_strategy="no"``; otherwise the ``Trainer`` decides when, through our save);
    ``metric_key``: the eval metric ``LOWEST_VAL`` follows (``eval_loss`` by default);
    ``global_batch_size``: samples per optimizer step over every rank;
    ``recorded``: ``step_scheduler`` values written into each checkpoint's ``config.yaml``.
    """

    config: ResilienceConfig
    ckpt_every_steps: int | None
    metric_key: str
    global_batch_size: int
    recorded: dict[str, Any]


def _refuse_unsupported(trainer: Any) -> None:
    args = trainer.args
    if getattr(args, "enable_jit_checkpoint", False):
        raise ConfigError(
            "TrainingArguments.enable_jit_checkpoint=True: the Trainer's own SIGTERM handler would save a second, non-atomic checkpoint "
            "seconds later; set it to False: step_scheduler.preemption_signal (SIGTERM by default) stops and saves every rank at one step"
        )
    if args.save_strategy == "best":
        raise ConfigError(
            "TrainingArguments.save_strategy='best': the Trainer would skip any save whose evaluation is no new best, a stop's "
            "save included; use 'steps', 'epoch' or 'no' (LOWEST_VAL names the checkpoint with the lowest eval metric, and retention keeps it)"
        )
    if args.save_only_model:
        raise ConfigError("TrainingArguments.save_only_model=True: a checkpoint without optimizer, scheduler and RNG state cannot resume exactly; set False")
    if args.save_on_each_node and args.world_size > 1:
        raise ConfigError(
            "TrainingArguments.save_on_each_node=True: every node would write the same files into one checkpoint; "
            "set it to False and put checkpoint.checkpoint_dir on storage every node sees"
        )
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        raise ConfigError("a Trainer with DeepSpeed or FSDP: its per-rank checkpoint files are not supported by this integration yet; use DDP")
    if args.ignore_data_skip:
        log.warning("TrainingArguments.ignore_data_skip=True: a resume starts its epoch from the first batch again, not exactly where it stopped")
    if type(trainer)._save_checkpoint is not _trainer_class()._save_checkpoint:
        log.warning(
            "%s overrides Trainer._save_checkpoint: the integration saves what Trainer._save_checkpoint saves, through its own "
            "atomic path; files only the override writes are not in its checkpoints",
            type(trainer).__name__,
        )
    if args.push_to_hub:
        log.warning("TrainingArguments.push_to_hub=True: checkpoints are not pushed while training (call trainer.push_to_hub() after it)")


def _trainer_class() -> type[Trainer]:
    from transformers import Trainer

    return Trainer


def _root(ck: CheckpointConfig, output_dir: str) -> str:
    """The checkpoint root: ``checkpoint.checkpoint_dir`` when set, else ``output_dir``."""
    if not is_set(ck.checkpoint_dir, CheckpointConfig().checkpoint_dir):
        return output_dir
    if output_dir != _TRAINER_DEFAULT_OUTPUT_DIR and os.path.abspath(ck.checkpoint_dir) != os.path.abspath(output_dir):
        raise ConfigError(
            f"checkpoint.checkpoint_dir={ck.checkpoint_dir!r} and TrainingArguments.output_dir={output_dir!r} disagree: the "
            "Trainer's checkpoints are ours, in one root; set one of them (or both to the same path)"
        )
    return ck.checkpoint_dir


def _retention(ck: CheckpointConfig, limit: int | None) -> int | None:
    """``max_recent_checkpoints``: ours, or the ``Trainer``'s ``save_total_limit``."""
    if limit is None:
        return ck.max_recent_checkpoints
    if ck.save_max is not None or is_set(ck.max_recent_checkpoints, limit):
        theirs = f"checkpoint.save_max={ck.save_max}" if ck.save_max is not None else f"checkpoint.max_recent_checkpoints={ck.max_recent_checkpoints}"
        raise ConfigError(f"{theirs} and TrainingArguments.save_total_limit={limit} disagree: both set the checkpoints kept; set one of them")
    return limit


def _save_cadence(every: int | None, args: Any) -> int | None:
    """The periodic save the callback drives: ``ckpt_every_steps`` with ``save_strategy="no"``; None
    when the ``Trainer``'s ``save_strategy`` decides (it agrees with ours, or ours is unset)."""
    if every is None or args.save_strategy == "no":
        return every
    if args.save_strategy == "steps" and args.save_steps == every:
        return None
    raise ConfigError(
        f"step_scheduler.ckpt_every_steps={every} and TrainingArguments.save_strategy={str(args.save_strategy)!r} "
        f"(save_steps={args.save_steps}) disagree: both set when to save; set save_strategy='no' to let ours decide, or remove ours"
    )


def _metric_key(ck: CheckpointConfig, args: Any) -> str:
    key = ck.best_metric_key if ck.best_metric_key != CheckpointConfig().best_metric_key else (args.metric_for_best_model or "loss")
    key = key if key.startswith("eval_") else f"eval_{key}"
    theirs = args.metric_for_best_model
    if theirs and args.greater_is_better and key == (theirs if theirs.startswith("eval_") else f"eval_{theirs}"):
        raise ConfigError(
            f"TrainingArguments.metric_for_best_model={theirs!r} with greater_is_better=True: LOWEST_VAL keeps the checkpoint with the "
            "lowest value; set checkpoint.best_metric_key to a metric where lower is better (e.g. loss)"
        )
    return key


def reconcile(config: ResilienceConfig, trainer: Any) -> TrainerSettings:
    """Our ``config`` against ``trainer.args`` (see the module docstring); a new config, ``config`` untouched.

    Raises:
        ConfigError: a setting both set and disagreeing, or one refused (see the module docstring).
    """
    _refuse_unsupported(trainer)
    args = trainer.args
    ck, sched = config.checkpoint, config.step_scheduler
    accumulation = int(args.gradient_accumulation_steps)
    global_batch = int(args.per_device_train_batch_size) * int(args.world_size) * accumulation
    eval_every = (args.eval_steps or args.logging_steps) if args.eval_strategy == "steps" else None
    owned = {
        "num_epochs": ("num_train_epochs", args.num_train_epochs),
        "max_steps": ("max_steps", args.max_steps if args.max_steps > 0 else None),
        "gradient_accumulation_steps": ("gradient_accumulation_steps", accumulation),
        "val_every_steps": ("eval_steps", eval_every),
        "global_batch_size": ("per_device_train_batch_size x ranks x gradient_accumulation_steps", global_batch),
    }
    refuse_disagreements(sched, owned)
    every = _save_cadence(sched.ckpt_every_steps, args)
    checkpoint = dataclasses.replace(ck, checkpoint_dir=_root(ck, args.output_dir), max_recent_checkpoints=_retention(ck, args.save_total_limit))
    epochs = float(args.num_train_epochs)
    recorded = {
        "num_epochs": int(epochs) if epochs.is_integer() else epochs,
        "max_steps": owned["max_steps"][1],
        "gradient_accumulation_steps": accumulation,
        "val_every_steps": eval_every,
        "global_batch_size": global_batch,
    }
    return TrainerSettings(dataclasses.replace(config, checkpoint=checkpoint), every, _metric_key(ck, args), global_batch, recorded)
