"""Refusing, before training, a model the configured ``checkpoint.model_save_format`` cannot save.

Checked when the :class:`~resilience.checkpoint.checkpointer.Checkpointer` is made (so at
``resilient_loop()``), never first found at the first save: a ``DTensor`` parameter with a
``Partial`` placement (a pending reduction, not values), or shards whose offsets do not tile their
tensor, cannot be stored piece by piece in ``safetensors``; a PEFT model is saved as its adapters,
so a trainable parameter outside them (a base norm unfrozen by hand) would be lost.
"""

from __future__ import annotations

import torch

from resilience.checkpoint.formats import hf_export, model_io
from resilience.config import CheckpointConfig, ConfigError
from resilience.distributed import DistContext


def check_savable(config: CheckpointConfig, model: torch.nn.Module, ctx: DistContext) -> None:
    """Raise when ``model`` cannot be saved under ``config`` (a collective over ``ctx`` for a
    sharded model: every rank calls it and raises alike).

    Raises:
        ConfigError: naming ``checkpoint.model_save_format``: see :func:`model_io.save_problem`; or a
            PEFT model with trainable parameters its adapter checkpoint would not hold.
    """
    if not (config.enabled and config.enable_save):
        return
    if hf_export.is_peft_model(model):
        lost = hf_export.peft_unsaved_trainable(model)
        if lost:
            shown = ", ".join(lost[:3]) + (f" and {len(lost) - 3} more" if len(lost) > 3 else "")
            raise ConfigError(
                f"a PEFT model is checkpointed as its adapters only, and these trainable parameters are not among them: {shown}; "
                "they would come back untrained after a resume: list their modules in the peft config's modules_to_save, or freeze them"
            )
        return
    if config.model_save_format != "safetensors":
        return
    problem = model_io.save_problem(model, rank=ctx.rank, world_size=ctx.world_size, gather=ctx.all_gather_object, agree=ctx.same_everywhere)
    if problem:
        raise ConfigError(
            f"checkpoint.model_save_format=safetensors cannot save this model: {problem}; accepted: parameters that are "
            "plain tensors or DTensors with Shard/Replicate placements (redistribute the others before training)"
        )
