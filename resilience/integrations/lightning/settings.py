"""Lightning's ``Trainer`` against our configuration: one owner per setting, and what is refused.

Checked at setup, before any training (a ``ConfigError`` names both sides):

=============================================  =====================================================
ours                                           the ``Trainer``'s
=============================================  =====================================================
``step_scheduler.num_epochs``                  ``max_epochs``
``step_scheduler.max_steps``                   ``max_steps``
``step_scheduler.gradient_accumulation_steps`` ``accumulate_grad_batches``
``step_scheduler.val_every_steps``             ``val_check_interval`` (Lightning's; ours is refused)
``step_scheduler.global_batch_size``           the train loader's batch size (Lightning's; ours is refused)
``step_scheduler.ckpt_every_steps``            ours: periodic saves (``ModelCheckpoint`` is refused)
``checkpoint.checkpoint_dir``                  ours (``default_root_dir`` keeps the logs)
=============================================  =====================================================

Refused: a ``ModelCheckpoint`` (or another ``Checkpoint`` callback) the user configured: its saves
are not atomic (a kill mid-write leaves a torn ``.ckpt`` that ``ckpt_path="last"`` would take),
this integration does not resume from them, and they run again after a stop's save (Lightning
calls the epoch-end hooks when it stops mid-epoch), spending Slurm's warning time. The Trainer's
default one (``enable_checkpointing=True`` without a ``ModelCheckpoint``) is taken out for the run.
Refused too: strategies other than one device and DDP (FSDP, DeepSpeed: per-rank checkpoint files),
several ranks that Lightning would start itself (its launcher forks the ranks in the script's first
process; start them with ``resilience run``, ``torchrun`` or ``srun``), a ``SLURMEnvironment`` whose
``SLURM_PROCID`` is not this process's ``RANK`` (ranks started by a launcher inside an ``sbatch``
script), and ``checkpoint.best_metric_key`` (``LOWEST_VAL``: a step is saved at its end, before the
validation Lightning runs after it).

:func:`lightning_signals_off` turns off Lightning's own signal handling for the run (see there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from typing import Any

from resilience.config import CheckpointConfig, ConfigError, ResilienceConfig
from resilience.integrations.trainer_owned import refuse_disagreements

log = logging.getLogger("resilience")

# ModelCheckpoint attributes that differ from the Trainer's default ModelCheckpoint() when a user configured one
_CONFIGURED: tuple[str, ...] = ("dirpath", "filename", "monitor", "save_last", "save_top_k", "save_on_exception", "save_weights_only", "_every_n_train_steps")
_CONFIGURED += ("_every_n_epochs", "_train_time_interval", "_save_on_train_epoch_end")


@dataclasses.dataclass(frozen=True)
class LightningSettings:
    """What the integration takes from the ``Trainer`` and our config, reconciled.

    ``config``: ours; ``ckpt_every_steps``: the periodic save (optimizer steps; ``None``: only a
    stop's and the final save); ``recorded``: ``step_scheduler`` values written into each
    checkpoint's ``config.yaml``; ``default_checkpoint``: the Trainer's default ``ModelCheckpoint``,
    taken out of ``trainer.callbacks`` for the run (``None`` when there is none).
    """

    config: ResilienceConfig
    ckpt_every_steps: int | None
    recorded: dict[str, Any]
    default_checkpoint: Any = None


def _refuse_strategy(trainer: Any) -> None:
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or isinstance(strategy, DeepSpeedStrategy):
        raise ConfigError(
            f"Trainer(strategy={type(strategy).__name__}): its checkpoints are per-rank files this integration does not list yet; "
            "use one device or strategy='ddp'"
        )
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

    environment = trainer._accelerator_connector.cluster_environment  # Lightning 2.x: what its signal handling reads too
    spawns = not environment.creates_processes_externally or isinstance(strategy.launcher, _MultiProcessingLauncher)
    if trainer.world_size > 1 and spawns:
        raise ConfigError(
            f"Trainer(devices={trainer.num_devices}, num_nodes={trainer.num_nodes}) would start its ranks itself "
            f"({type(strategy.launcher).__name__}), so no launcher sees their exit codes and signals; start them with "
            "`resilience run -n N`, torchrun or srun (Lightning then finds LOCAL_RANK and starts nothing)"
        )
    _refuse_slurm_ranks(environment)


def _refuse_slurm_ranks(environment: Any) -> None:
    """Lightning takes ``SLURMEnvironment`` whenever ``SLURM_NTASKS`` is set, also for ranks that
    another launcher started inside a batch script: every rank would then read ``SLURM_PROCID``."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    rank = os.environ.get("RANK")
    if isinstance(environment, SLURMEnvironment) and rank is not None and os.environ.get("SLURM_PROCID") != rank:
        raise ConfigError(
            f"Lightning chose SLURMEnvironment, which takes the rank from SLURM_PROCID={os.environ.get('SLURM_PROCID')}, but this "
            f"process is RANK={rank} of another launcher; pass Trainer(plugins=[LightningEnvironment()]) "
            "(lightning.pytorch.plugins.environments), or start one task per rank with srun"
        )


def _checkpoint_callbacks(trainer: Any) -> Any:
    """The Trainer's default ``ModelCheckpoint`` (taken out for the run), or None; a configured one is refused."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    found = trainer.checkpoint_callbacks
    default = ModelCheckpoint()
    if len(found) == 1 and type(found[0]) is ModelCheckpoint and all(getattr(found[0], a) == getattr(default, a) for a in _CONFIGURED):
        return found[0]
    if found:
        raise ConfigError(
            f"Trainer(callbacks=[{type(found[0]).__name__}(...)]): its saves are not atomic, are not resumed from, and run again after "
            "a stop's save (Lightning calls the epoch-end hooks when it stops mid-epoch), spending the warning time; remove it: "
            "step_scheduler.ckpt_every_steps saves periodically, checkpoint.max_recent_checkpoints keeps the newest"
        )
    return None


def reconcile(config: ResilienceConfig, trainer: Any) -> LightningSettings:
    """Our ``config`` against ``trainer`` (see the module docstring); ``config`` and ``trainer`` untouched.

    Raises:
        ConfigError: a setting both set and disagreeing, or one refused (see the module docstring).
    """
    _refuse_strategy(trainer)
    default_checkpoint = _checkpoint_callbacks(trainer)
    sched = config.step_scheduler
    max_epochs = trainer.max_epochs if trainer.max_epochs not in (None, -1) else None
    max_steps = trainer.max_steps if trainer.max_steps not in (None, -1) else None
    accumulation = int(trainer.accumulate_grad_batches)
    owned = {
        "num_epochs": ("max_epochs", max_epochs),
        "max_steps": ("max_steps", max_steps),
        "gradient_accumulation_steps": ("accumulate_grad_batches", accumulation),
        "val_every_steps": ("val_check_interval", None),
        "global_batch_size": ("train loader's batch size x ranks x accumulate_grad_batches", None),
    }
    refuse_disagreements(sched, owned)
    if config.checkpoint.best_metric_key != CheckpointConfig().best_metric_key:
        raise ConfigError(
            f"checkpoint.best_metric_key={config.checkpoint.best_metric_key!r}: the Lightning integration keeps no LOWEST_VAL (a step is "
            "saved at its end, before the validation Lightning runs after it); remove it"
        )
    recorded = {"num_epochs": max_epochs, "max_steps": max_steps, "gradient_accumulation_steps": accumulation}
    return LightningSettings(config, sched.ckpt_every_steps, recorded, default_checkpoint)


@contextlib.contextmanager
def lightning_signals_off(trainer: Any, *, rank: int) -> Iterator[None]:
    """Lightning's own signal handling off while the block runs, restored after.

    ``Trainer.fit`` calls ``_SignalConnector.register_signal_handlers()`` after restoring a
    checkpoint; it would install (1) a SIGTERM handler on top of ours that broadcasts from inside
    the handler, makes ``fit()`` raise ``SIGTERMException`` at the next batch (no save) and kills
    Lightning-launched children, and (2) with ``SLURMEnvironment(auto_requeue=True)`` (the default
    when Lightning runs under Slurm) a SIGUSR1 handler, when no other is installed, that writes
    ``hpc_ckpt_<N>.ckpt`` non-atomically and calls ``scontrol requeue`` itself. Both would race with
    ours: ``step_scheduler.preemption_signal`` stops every rank at one step and saves it, and the
    ``resilience template slurm`` scripts requeue on exit code 75. So ``register_signal_handlers`` is
    replaced by a no-op for this trainer (its ``received_sigterm`` stays False) and
    ``SLURMEnvironment.auto_requeue`` is set to False (logged when it was on)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    connector = trainer._signal_connector  # Lightning 2.x: every fit() registers through it
    environment = trainer._accelerator_connector.cluster_environment  # what register_signal_handlers reads
    auto_requeue = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
    if auto_requeue:
        environment.auto_requeue = False
        if rank == 0:
            log.warning(
                "Lightning's SLURM auto-requeue is off for this run (its SIGUSR1 handler would save hpc_ckpt_N.ckpt and call scontrol "
                "requeue itself): step_scheduler.preemption_signal stops and saves, and exit code 75 requeues"
            )
    connector.register_signal_handlers = _no_handlers
    try:
        yield
    finally:
        del connector.register_signal_handlers  # the class's own again
        if auto_requeue:
            environment.auto_requeue = True


def _no_handlers() -> None:
    """``_SignalConnector.register_signal_handlers`` during our run: installs nothing (see :func:`lightning_signals_off`)."""
