"""MindSpore Transformers names and behaviours on top of the NeMo AutoModel configuration.

Two jobs:

* :func:`normalize_aliases` rewrites configuration keys that MindSpore Transformers spells
  differently but that mean the same thing as ours (``checkpoint.save_path`` is
  ``checkpoint.checkpoint_dir``, ...) before validation, so either spelling works and both
  together must agree. Keys with no NeMo equivalent (``save_max``, ``no_save_optim``, ...) are
  fields of :class:`resilience.config.CheckpointConfig` under their MindSpore names.
* :func:`rescale_for_global_batch_size` is MindSpore's resume rule for a changed global batch
  size: ``global_step`` is scaled by old/new so the number of samples consumed stays the same,
  and the data cursor moves with it.

Sources: MindSpore Transformers "Weight Saving and Loading" and "Resumable Training" (the
``checkpoint`` section, ``CheckpointConfig``, ``common.json``/``CommonInfo``).
"""

from __future__ import annotations

import copy
import logging
from fractions import Fraction
from typing import Any, Mapping

from resilience.config import ConfigError
from resilience.config.checks import check_local_path

log = logging.getLogger("resilience")

# (MindSpore section, key) -> (our section, key): same meaning, either spelling accepted.
ALIASES: dict[tuple[str, str], tuple[str, str]] = {
    ("checkpoint", "save_path"): ("checkpoint", "checkpoint_dir"),
    ("checkpoint", "save_interleaved_steps"): ("step_scheduler", "ckpt_every_steps"),
    ("checkpoint", "async_save"): ("checkpoint", "is_async"),
    ("training", "global_batch_size"): ("step_scheduler", "global_batch_size"),
}
# MindSpore's `training:` section is otherwise the user's: its alias is copied, not removed.
_KEEP_IN_PLACE = {("training", "global_batch_size")}


def normalize_aliases(data: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``data`` (parsed YAML) with MindSpore spellings moved to ours.

    Raises:
        ConfigError: both spellings given with different values (naming both), or
            ``checkpoint.save_path`` empty while saving is enabled (MindSpore raises
            ``ValueError("save_path must be provided ...")`` for it too), or ``save_path`` a URL
            other than ``file://`` (see :func:`resilience.local_paths.local_path`).
    """
    out = dict(data)
    for (src_section, src_key), (dst_section, dst_key) in ALIASES.items():
        src = out.get(src_section)
        if not isinstance(src, Mapping) or src_key not in src:
            continue
        value = src[src_key]
        if (src_section, src_key) == ("checkpoint", "save_path") and not _save_path_given(value):
            if _saving_enabled(src):
                raise ConfigError(
                    f"checkpoint.save_path must be provided when checkpoint.enable_save is true (got {value!r}); "
                    "give the directory to save into, or set checkpoint.enable_save: false"
                )
            out[src_section] = {k: v for k, v in src.items() if k != src_key}
            continue
        if (src_section, src_key) == ("checkpoint", "save_path"):
            value = check_local_path("checkpoint.save_path", value)  # the error names the key as the user spelt it
        dst = out.get(dst_section)
        dst = dict(dst) if isinstance(dst, Mapping) else {}
        if dst_key in dst and dst[dst_key] != value:
            raise ConfigError(
                f"{src_section}.{src_key}={value!r} (MindSpore Transformers) and {dst_section}.{dst_key}={dst[dst_key]!r} "
                "(NeMo AutoModel) name the same setting with different values; give one of them"
            )
        if (src_section, src_key) not in _KEEP_IN_PLACE:
            out[src_section] = {k: v for k, v in src.items() if k != src_key}
            if src_section == dst_section:
                dst = {k: v for k, v in dst.items() if k != src_key}
        dst[dst_key] = value
        out[dst_section] = dst
    return out


def _save_path_given(value: Any) -> bool:
    return value is not None and str(value).strip() != ""


def _saving_enabled(section: Mapping[str, Any]) -> bool:
    return section.get("enable_save", True) is not False and section.get("enabled", True) is not False


def rescale_for_global_batch_size(
    step_state: Mapping[str, int], data_position: Mapping[str, Any] | None, old: int, new: int
) -> tuple[dict[str, int], dict[str, Any] | None]:
    """Step counters and data position after resuming with global batch ``new`` a run saved with ``old``.

    MindSpore's rule: ``global_step' = global_step x old / new``, so ``global_step' x new`` samples
    have been consumed, as before. The position within the epoch (``batches_in_epoch``) scales
    the same way, and a stateful loader's own state (which counts batches of the old size) is
    dropped: the loop then replays the epoch's sampler order (``set_epoch``) and skips
    ``batches_in_epoch'`` batches of the new size, landing on the same sample. When a ratio is
    not integral the counts are rounded down (some samples are seen twice) and a warning is logged.

    Args:
        step_state: ``StepScheduler.state_dict()`` of the checkpoint (epoch, batches_in_epoch, global_step).
        data_position: this rank's saved data position, or ``None``.
        old, new: global batch sizes (samples per optimizer step) at save and now; both >= 1.
    """
    ratio = Fraction(old, new)
    state = copy.deepcopy(dict(step_state))
    for key in ("global_step", "batches_in_epoch"):
        scaled = state[key] * ratio
        if scaled.denominator != 1:
            log.warning(
                "global_batch_size changed from %d to %d: %s %d x %d/%d = %s is not a whole number of steps; "
                "resuming at %d (the samples of the partial step are seen again)",
                old, new, key, state[key], old, new, float(scaled), int(scaled),
            )
        state[key] = int(scaled)
    position = None
    if data_position is not None:
        position = {**data_position, "batches_in_epoch": state["batches_in_epoch"], "loader": None}
    return state, position
