"""MindSpore Transformers names on top of the NeMo AutoModel configuration.

* :func:`normalize_aliases` rewrites configuration keys that MindSpore Transformers spells
  differently but that mean the same thing as ours (``checkpoint.save_path`` is
  ``checkpoint.checkpoint_dir``, ...) before validation, so either spelling works and both
  together must agree. Keys with no NeMo equivalent (``save_max``, ``no_save_optim``, ...) are
  fields of :class:`resilience.config.CheckpointConfig` under their MindSpore names.

A changed global batch size at resume is :mod:`resilience.state.batch_size`'s: unlike MindSpore,
which scales ``global_step`` by old/new, ``global_step`` keeps counting optimizer steps (so it
never goes back below existing checkpoints, and stays equal to the LR scheduler's step).

Sources: MindSpore Transformers "Weight Saving and Loading" and "Resumable Training" (the
``checkpoint`` section, ``CheckpointConfig``, ``common.json``/``CommonInfo``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from resilience.checkpoint.storage.object_store import is_object_url
from resilience.config.checks import ConfigError, check_local_path

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
            other than ``file://``, ``s3://`` or ``msc://`` (see :func:`resilience.local_paths.local_path`).
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
        if (src_section, src_key) == ("checkpoint", "save_path") and not is_object_url(value):
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
