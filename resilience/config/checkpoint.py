"""The ``checkpoint`` section: where and how checkpoints are written, kept and loaded."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from resilience.checkpoint.storage.object_store import is_object_url, split_url
from resilience.config.checks import ConfigError, check_bool, check_int, check_local_path

log = logging.getLogger("resilience")


def _check_retention_and_mindspore_keys(cfg: CheckpointConfig) -> None:
    """Validate the retention, LOWEST_VAL and MindSpore Transformers keys of ``checkpoint``."""
    for key in ("is_async", "enable_save", "no_save_optim", "no_load_optim", "load_balanced", "remove_redundancy", "save_global_layout_cache"):
        check_bool(f"checkpoint.{key}", getattr(cfg, key))
    if not cfg.remove_redundancy:  # honest, not silent: there is no redundant layout to opt into
        log.warning("checkpoint.remove_redundancy: false has no effect: replicated tensors are stored once anyway (by one of their holders)")
    if isinstance(cfg.async_timeout_s, bool) or not isinstance(cfg.async_timeout_s, (int, float)) or cfg.async_timeout_s <= 0:
        raise ConfigError(f"checkpoint.async_timeout_s: expected a number of seconds > 0, got {cfg.async_timeout_s!r}")
    check_int("checkpoint.max_recent_checkpoints", cfg.max_recent_checkpoints, minimum=1, allow_none=True)
    check_int("checkpoint.max_restarts_without_progress", cfg.max_restarts_without_progress, minimum=1, allow_none=True)
    check_int("checkpoint.max_preemptions_without_progress", cfg.max_preemptions_without_progress, minimum=1, allow_none=True)
    check_int("checkpoint.save_max", cfg.save_max, minimum=1, allow_none=True)
    if not isinstance(cfg.best_metric_key, str) or not cfg.best_metric_key:
        raise ConfigError(f"checkpoint.best_metric_key: expected a metric name, got {cfg.best_metric_key!r}")
    if cfg.prefix is not None and not isinstance(cfg.prefix, str):
        raise ConfigError(f"checkpoint.prefix: expected a string or null, got {cfg.prefix!r}")
    if cfg.load_path is not None and not isinstance(cfg.load_path, (str, os.PathLike)):
        raise ConfigError(f'checkpoint.load_path: expected a path, "" or null, got {cfg.load_path!r}')
    cfg.load_path = str(cfg.load_path) if cfg.load_path is not None and str(cfg.load_path).strip() else None
    if cfg.max_recent_checkpoints is not None and cfg.save_max is not None:
        raise ConfigError(
            "checkpoint.max_recent_checkpoints and checkpoint.save_max both set: they configure the same retention "
            "(save_max counts and removes only this run's checkpoints); set one of them"
        )
    if cfg.load_path is not None and cfg.restore_from is not None:
        raise ConfigError("checkpoint.load_path and checkpoint.restore_from both set: both name what to load; set one of them")


def _save_consolidated(value: Any, model_save_format: str) -> Any:
    """``checkpoint.save_consolidated`` normalised to ``"final"``, ``"every"`` or ``False``."""
    text = str(value).strip().lower() if isinstance(value, (str, bool)) else value
    if value is None:  # not set: NeMo AutoModel's default, where there is something to consolidate
        return "final" if model_save_format == "safetensors" else False
    if text not in ("final", "every", "true", "false"):
        raise ConfigError(f"checkpoint.save_consolidated: expected final, every, false (or legacy true = every), got {value!r}")
    if text == "false":
        return False
    if model_save_format != "safetensors":
        raise ConfigError(
            f"checkpoint.save_consolidated: {value!r} needs checkpoint.model_save_format: safetensors, "
            f"got {model_save_format!r}; set checkpoint.save_consolidated: false or use safetensors"
        )
    return "every" if text == "true" else text


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how checkpoints are written. YAML section ``checkpoint`` (NeMo AutoModel names)."""

    enabled: bool = True
    """Write and resume checkpoints (default true). When false, preemption still stops cleanly."""
    checkpoint_dir: str = "checkpoints/"
    """Root directory holding ``epoch_<E>_step_<S>/`` checkpoints and the ``LATEST`` pointer: a local or
    mounted path (``file:///abs`` is taken as ``/abs``), or object storage: ``s3://bucket/prefix``
    (boto3; endpoint and credentials from the AWS environment variables and ``~/.aws``) or
    ``msc://profile/prefix`` (multi-storage-client's configuration); see docs/storage.md. Any other
    ``scheme://`` URL is a ``ConfigError``, as is a URL in ``restore_from`` or ``load_path``."""
    local_dir: str | None = None
    """With an object-store ``checkpoint_dir`` only: a local directory for each rank's staged files
    (written, fsync'd and digested there, then uploaded), a resume's downloads, and rank 0's
    ``training.jsonl``/``validation.jsonl``. Default ``$TMPDIR/resilience-<user>/<scheme>/<bucket>/<prefix>``
    (node-local scratch). A ``ConfigError`` with a local ``checkpoint_dir``."""
    restore_from: str | None = None
    """A checkpoint directory (absolute, or a name under ``checkpoint_dir``) to resume from instead of
    ``LATEST``. It must exist and be valid: a missing one is an error, never a fresh start."""
    resume: bool = True
    """Resume automatically from ``LATEST`` when it exists (default true)."""
    max_recent_checkpoints: int | None = None
    """Keep the newest N checkpoints plus every pointer target (``LATEST``, ``LOWEST_VAL``, any other
    top-level symlink or ``.txt`` pointer); null keeps everything (default)."""
    best_metric_key: str = "default"
    """The validation metric that decides ``LOWEST_VAL`` (lower is better) when ``log_validation``
    gets several; with one metric that one is used (NeMo AutoModel semantics)."""
    is_async: bool = False
    """Asynchronous saving (MindSpore ``async_save``): a save copies the state into reused host
    buffers and returns; a background thread writes, fsyncs and publishes it. Default false."""
    max_restarts_without_progress: int | None = 3
    """Requeue-loop guard: after this many starts from the same ``LATEST`` that saved no new
    checkpoint and did not end in a clean preemption (an exception, a crash, a kill), the next
    start exits with ``ExitCode.NO_PROGRESS`` (76), which the Slurm templates never requeue
    (default 3; null disables). Clean preemptions count against ``max_preemptions_without_progress``."""
    max_preemptions_without_progress: int | None = 10
    """Requeue-loop guard for clean preemptions: after this many starts from the same ``LATEST``
    that were each stopped (exit 75) before they could save anything new, the next start exits
    76: the job never gets far enough to checkpoint (default 10; null disables)."""
    async_timeout_s: float = 600.0
    """Seconds any wait for an asynchronous save in flight may take before it raises (default 600)."""
    enable_save: bool = True
    """MindSpore Transformers: write checkpoints (default true). False still resumes/loads."""
    save_max: int | None = None
    """MindSpore Transformers: keep the newest N checkpoints *of this run* (MindSpore's default is 5,
    ours null = keep all). Checkpoints of other runs are never removed."""
    no_save_optim: bool = False
    """MindSpore Transformers: save model weights without the optimizer state."""
    no_load_optim: bool = False
    """MindSpore Transformers: load only the weights of the ``load_path``/``restore_from`` checkpoint;
    the optimizer, step counters, data position and RNG start fresh."""
    load_path: str | None = None
    """MindSpore Transformers: a checkpoint directory, or a root whose ``LATEST`` is followed, to load
    when ``checkpoint_dir`` holds no checkpoint of its own yet ("" or null: none)."""
    load_balanced: bool = True
    """Resume of replicated state (a plain or DDP model's safetensors weights, an optimizer every
    rank holds in full) with more than one rank: each byte is read from storage by one rank (1/N
    each) and broadcast over the library's gloo group in buckets of at most 64 MiB, the reading
    rank digesting it (default true, as MindSpore Transformers' key). False: every rank reads
    every file itself. Sharded (DTensor) state always reads only its own blocks."""
    remove_redundancy: bool = True
    """MindSpore Transformers: store replicated tensors once (default true). Accepted; it is how
    every save works: a block several ranks hold is written by one of its holders. ``false`` (write
    every copy) is accepted too but changes nothing beyond a warning saying so."""
    save_global_layout_cache: bool = True
    """MindSpore Transformers: reuse the model's save plan and ``shard_index.json`` while the layout
    (keys, shapes, dtypes, placements, mesh, world size) is unchanged, so the second and later
    saves do no planning and no planning collective; ``false`` plans every save."""
    prefix: str | None = "checkpoint"
    """MindSpore Transformers' file-name prefix: accepted, changes no name (the layout is NeMo's)."""
    model_save_format: str = "safetensors"
    """Model weights format: ``safetensors`` (per-rank shards ``model/shard-0000K-model-0000I-of-0000N.safetensors``
    plus ``model/consolidate.sh``; default) or ``torch_save`` (DCP ``model/*.distcp``)."""
    save_consolidated: Any = None
    """Hugging Face bundle in ``model/consolidated/``: ``final`` (the final checkpoint of a run only),
    ``every`` (legacy ``true``: every checkpoint) or ``false``. Default ``final`` with safetensors;
    needs ``model_save_format: safetensors``."""

    world_size_change: str = "strict"
    """Resuming under another world size: ``strict`` (default) refuses with an error naming the
    change; ``elastic`` resumes: weights and (DCP-resharded) optimizer as saved, the data position
    re-derived from the global batches consumed in the epoch (the epoch's sampler order is
    replayed for the new ranks), and rank r takes the RNG state of saved rank r mod old world size."""

    def __post_init__(self) -> None:
        check_bool("checkpoint.enabled", self.enabled)
        check_bool("checkpoint.resume", self.resume)
        if self.world_size_change not in ("strict", "elastic"):
            raise ConfigError(f"checkpoint.world_size_change: {self.world_size_change!r}; accepted: strict, elastic")
        # Before anything reads them: a URL without a backend is refused here, never a local folder named after it.
        if is_object_url(self.checkpoint_dir):
            self._check_object_root()
        else:
            try:
                self.checkpoint_dir = check_local_path("checkpoint.checkpoint_dir", self.checkpoint_dir)
            except ConfigError as exc:
                raise ConfigError(f"{exc}; or object storage: s3://bucket/prefix, msc://profile/prefix (see docs/storage.md)") from None
        for key in ("restore_from", "load_path", "local_dir"):
            setattr(self, key, check_local_path(f"checkpoint.{key}", getattr(self, key)))
        if self.local_dir is not None and not is_object_url(self.checkpoint_dir):
            raise ConfigError(
                f"checkpoint.local_dir={self.local_dir!r}: only used with an object-store checkpoint_dir (s3://, msc://); "
                f"checkpoint_dir={self.checkpoint_dir!r} is local: remove local_dir"
            )
        _check_retention_and_mindspore_keys(self)
        if not isinstance(self.checkpoint_dir, (str, os.PathLike)) or not str(self.checkpoint_dir).strip():
            raise ConfigError(f"checkpoint.checkpoint_dir: expected a non-empty path, got {self.checkpoint_dir!r}")
        self.checkpoint_dir = str(self.checkpoint_dir)
        if self.restore_from is not None and not isinstance(self.restore_from, (str, os.PathLike)):
            raise ConfigError(f"checkpoint.restore_from: expected a path or null, got {self.restore_from!r}")
        if self.model_save_format not in ("safetensors", "torch_save"):
            raise ConfigError(f"checkpoint.model_save_format: expected 'safetensors' or 'torch_save', got {self.model_save_format!r}")
        self.save_consolidated = _save_consolidated(self.save_consolidated, self.model_save_format)

    def _check_object_root(self) -> None:
        """An object-store ``checkpoint_dir``: a well-formed URL (the store itself is checked at
        ``resilient_loop()``: credentials, bucket, a write probe)."""
        try:
            split_url(self.checkpoint_dir)
        except ValueError as exc:
            raise ConfigError(f"checkpoint.checkpoint_dir: {exc}") from None
        if self.load_path is not None and is_object_url(self.load_path):
            raise ConfigError(f"checkpoint.load_path={self.load_path!r}: a URL is not supported here yet; accepted: a local or mounted path")
