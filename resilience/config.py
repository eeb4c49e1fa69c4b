"""Configuration: ``kw_only`` dataclasses, YAML loading, dotted overrides, validation.

Section and key names follow NeMo AutoModel's YAML (``step_scheduler:``, ``checkpoint:``) so a
recipe written for it reads the same here. Sections this module does not know are the user's
(model, optimizer, data, ...) and are returned untouched in :attr:`ResilienceConfig.extra`;
a top-level name that is *close* to one of ours (``checkpont``) is an error, not a user section.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from resilience.signals import DEFAULT_PREEMPTION_SIGNAL, parse_preemption_signal


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the key and what is accepted."""


def _check_int(key: str, value: Any, *, minimum: int | None = None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        accepted = "an integer" + (" or null" if allow_none else "")
        raise ConfigError(f"{key}: expected {accepted}, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key}: must be >= {minimum}, got {value}")


def _check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r} ({type(value).__name__})")


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def _check_retention_and_mindspore_keys(cfg: "CheckpointConfig") -> None:
    """Validate the retention, LOWEST_VAL and MindSpore Transformers keys of ``checkpoint``."""
    for key in ("is_async", "enable_save", "no_save_optim", "no_load_optim", "load_balanced"):
        _check_bool(f"checkpoint.{key}", getattr(cfg, key))
    if isinstance(cfg.async_timeout_s, bool) or not isinstance(cfg.async_timeout_s, (int, float)) or cfg.async_timeout_s <= 0:
        raise ConfigError(f"checkpoint.async_timeout_s: expected a number of seconds > 0, got {cfg.async_timeout_s!r}")
    _check_int("checkpoint.max_recent_checkpoints", cfg.max_recent_checkpoints, minimum=1, allow_none=True)
    _check_int("checkpoint.max_restarts_without_progress", cfg.max_restarts_without_progress, minimum=1, allow_none=True)
    _check_int("checkpoint.save_max", cfg.save_max, minimum=1, allow_none=True)
    if not isinstance(cfg.best_metric_key, str) or not cfg.best_metric_key:
        raise ConfigError(f"checkpoint.best_metric_key: expected a metric name, got {cfg.best_metric_key!r}")
    if cfg.prefix is not None and not isinstance(cfg.prefix, str):
        raise ConfigError(f"checkpoint.prefix: expected a string or null, got {cfg.prefix!r}")
    if cfg.load_path is not None and not isinstance(cfg.load_path, (str, os.PathLike)):
        raise ConfigError(f"checkpoint.load_path: expected a path, \"\" or null, got {cfg.load_path!r}")
    cfg.load_path = str(cfg.load_path) if cfg.load_path is not None and str(cfg.load_path).strip() else None
    if cfg.max_recent_checkpoints is not None and cfg.save_max is not None:
        raise ConfigError(
            "checkpoint.max_recent_checkpoints and checkpoint.save_max both set: they configure the same retention "
            "(save_max counts and removes only this run's checkpoints); set one of them"
        )
    if cfg.load_path is not None and cfg.restore_from is not None:
        raise ConfigError("checkpoint.load_path and checkpoint.restore_from both set: both name what to load; set one of them")
    retention = "max_recent_checkpoints" if cfg.max_recent_checkpoints is not None else "save_max" if cfg.save_max is not None else None
    if retention and _URL.match(str(cfg.checkpoint_dir)):
        raise ConfigError(
            f"checkpoint.{retention} is only supported for local checkpoint directories, and checkpoint.checkpoint_dir "
            f"is the URL {cfg.checkpoint_dir!r}; unset checkpoint.{retention} or use a local (or mounted) path"
        )


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
class StepSchedulerConfig:
    """When to step, stop and save. YAML section ``step_scheduler`` (NeMo AutoModel names)."""

    num_epochs: int = 1
    """Epochs to train (default 1). Training ends at ``num_epochs`` or ``max_steps``, whichever first."""
    max_steps: int | None = None
    """Optimizer steps to train in total, or null for no step limit (default null)."""
    ckpt_every_steps: int | None = None
    """Save every N global steps (default null: save only at the end and on preemption)."""
    preemption_signal: Any = DEFAULT_PREEMPTION_SIGNAL
    """Signal(s) that request a stop-and-save: a name, a number, a list, or null (default SIGTERM)."""
    agreement_every_steps: int = 1
    """Cadence, in steps, of the non-blocking cross-rank stop agreement (default 1). A signal stops
    every rank within 2 x this many steps; larger values make the per-step cost smaller."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all ranks (MindSpore ``training.global_batch_size``). Recorded in
    each checkpoint; resuming with a different value rescales ``global_step`` by old/new (default null)."""
    val_every_steps: int | None = None
    """Validate every N global steps: sets ``Step.is_val_step`` for the training loop (default null)."""
    wall_time_s: float | None = None
    """This run's wall time in seconds from its start, for deadline stopping outside Slurm (default
    null: inside a Slurm job the end time comes from ``scontrol show job``)."""
    deadline_stop: bool = True
    """Stop and save by ourselves when the time left before the job's end no longer covers the
    steps a stop may still take plus one save, times ``deadline_safety`` (default true)."""
    deadline_safety: float = 1.5
    """Safety factor on (steps until an agreed stop + one save) for deadline stopping and the
    lead-time warning (default 1.5)."""

    def __post_init__(self) -> None:
        if self.wall_time_s is not None and (isinstance(self.wall_time_s, bool) or not isinstance(self.wall_time_s, (int, float)) or self.wall_time_s <= 0):
            raise ConfigError(f"step_scheduler.wall_time_s: expected seconds > 0 or null, got {self.wall_time_s!r}")
        _check_bool("step_scheduler.deadline_stop", self.deadline_stop)
        if isinstance(self.deadline_safety, bool) or not isinstance(self.deadline_safety, (int, float)) or self.deadline_safety < 1:
            raise ConfigError(f"step_scheduler.deadline_safety: expected a number >= 1, got {self.deadline_safety!r}")
        _check_int("step_scheduler.global_batch_size", self.global_batch_size, minimum=1, allow_none=True)
        _check_int("step_scheduler.val_every_steps", self.val_every_steps, minimum=1, allow_none=True)
        _check_int("step_scheduler.num_epochs", self.num_epochs, minimum=1)
        _check_int("step_scheduler.max_steps", self.max_steps, minimum=1, allow_none=True)
        _check_int("step_scheduler.ckpt_every_steps", self.ckpt_every_steps, minimum=1, allow_none=True)
        _check_int("step_scheduler.agreement_every_steps", self.agreement_every_steps, minimum=1)
        # Parsed now so a bad spec fails at config time, before any training; re-raised as
        # ConfigError so callers need to catch one type for every bad value.
        try:
            self.signals = parse_preemption_signal(self.preemption_signal, key="step_scheduler.preemption_signal")
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from exc


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how checkpoints are written. YAML section ``checkpoint`` (NeMo AutoModel names)."""

    enabled: bool = True
    """Write and resume checkpoints (default true). When false, preemption still stops cleanly."""
    checkpoint_dir: str = "checkpoints/"
    """Root directory holding ``epoch_<E>_step_<S>/`` checkpoints and the ``LATEST`` pointer."""
    restore_from: str | None = None
    """A checkpoint directory (absolute, or a name under ``checkpoint_dir``) to resume from instead of
    ``LATEST``. It must exist and be valid: a missing one is an error, never a fresh start."""
    resume: bool = True
    """Resume automatically from ``LATEST`` when it exists (default true)."""
    max_recent_checkpoints: int | None = None
    """Keep the newest N checkpoints plus every pointer target (``LATEST``, ``LOWEST_VAL``, any other
    top-level symlink or ``.txt`` pointer); null keeps everything (default). Local directories only."""
    best_metric_key: str = "default"
    """The validation metric that decides ``LOWEST_VAL`` (lower is better) when ``log_validation``
    gets several; with one metric that one is used (NeMo AutoModel semantics)."""
    is_async: bool = False
    """Asynchronous saving (MindSpore ``async_save``): a save copies the state into reused host
    buffers and returns; a background thread writes, fsyncs and publishes it. Default false."""
    max_restarts_without_progress: int | None = 3
    """Requeue-loop guard: after this many consecutive starts from the same ``LATEST`` (restarts
    that produced no new checkpoint), exit with ``ExitCode.NO_PROGRESS`` (76), which the Slurm
    templates never requeue (default 3; null disables)."""
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
    load_balanced: bool = False
    """MindSpore Transformers: accepted; a no-op (there are no redundant shards to balance here)."""
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
        _check_bool("checkpoint.enabled", self.enabled)
        _check_bool("checkpoint.resume", self.resume)
        if self.world_size_change not in ("strict", "elastic"):
            raise ConfigError(f"checkpoint.world_size_change: {self.world_size_change!r}; accepted: strict, elastic")
        _check_retention_and_mindspore_keys(self)
        if not isinstance(self.checkpoint_dir, (str, os.PathLike)) or not str(self.checkpoint_dir).strip():
            raise ConfigError(f"checkpoint.checkpoint_dir: expected a non-empty path, got {self.checkpoint_dir!r}")
        self.checkpoint_dir = str(self.checkpoint_dir)
        if self.restore_from is not None and not isinstance(self.restore_from, (str, os.PathLike)):
            raise ConfigError(f"checkpoint.restore_from: expected a path or null, got {self.restore_from!r}")
        if self.model_save_format not in ("safetensors", "torch_save"):
            raise ConfigError(
                f"checkpoint.model_save_format: expected 'safetensors' or 'torch_save', got {self.model_save_format!r}"
            )
        self.save_consolidated = _save_consolidated(self.save_consolidated, self.model_save_format)


_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
LAUNCHERS = ("resilience", "srun", "torchrun")
REQUEUE_MODES = ("requeue", "resubmit")


@dataclasses.dataclass(kw_only=True)
class SlurmConfig:
    """How ``resilience template slurm CONFIG.yaml`` renders the batch script. YAML section ``slurm``.

    The ``--signal`` line is built from ``step_scheduler.preemption_signal`` (its first signal)
    and ``signal_lead_s``, so the signal Slurm sends and the one training listens for come from
    one setting.
    """

    script: str = "train.py"
    """The training script every rank runs (path as seen from the job's working directory)."""
    script_args: list = dataclasses.field(default_factory=list)
    """Arguments after the script, e.g. ``["--config", "train.yaml"]``."""
    python: str = "python3"
    """The Python interpreter on the compute nodes (e.g. a venv's ``bin/python``)."""
    job_name: str = "resilience"
    partition: str | None = None
    nodes: int = 1
    nproc_per_node: int = 1
    """Ranks per node."""
    cpus_per_task: int | None = None
    time: str = "01:00:00"
    """Wall time in Slurm's ``--time`` format (``MM``, ``HH:MM:SS``, ``D-HH:MM:SS``)."""
    signal_lead_s: int = 300
    """Seconds before the wall time at which Slurm sends the signal (``--signal=B:SIG@N``).
    Slurm checks every 30 s, so the signal arrives between N and N+30 s before the end."""
    max_restarts: int = 10
    """Requeues allowed before the script gives up with ``ExitCode.RESTART_LIMIT`` (77)."""
    launcher: str = "resilience"
    """``resilience`` (our launcher, one per node), ``srun`` (one task per rank) or ``torchrun``."""
    requeue: str = "requeue"
    """``requeue`` (``scontrol requeue``, same job id) or ``resubmit`` (``sbatch`` a new job)."""
    output: str = "slurm-%j.out"
    """Log file; opened with ``--open-mode=append`` so a requeued attempt does not truncate it."""
    sbatch_extra: list = dataclasses.field(default_factory=list)
    """Further ``#SBATCH`` options, e.g. ``["--account=abc", "--mem=16G"]``."""
    setup: list = dataclasses.field(default_factory=list)
    """Shell lines run before the launch (``module load ...``, ``source venv/bin/activate``)."""

    def __post_init__(self) -> None:
        for key in ("script", "python", "job_name", "time", "output", "launcher", "requeue"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"slurm.{key}: expected a non-empty string, got {value!r}")
        if self.partition is not None and (not isinstance(self.partition, str) or not self.partition):
            raise ConfigError(f"slurm.partition: expected a partition name or null, got {self.partition!r}")
        _check_int("slurm.nodes", self.nodes, minimum=1)
        _check_int("slurm.nproc_per_node", self.nproc_per_node, minimum=1)
        _check_int("slurm.cpus_per_task", self.cpus_per_task, minimum=1, allow_none=True)
        _check_int("slurm.signal_lead_s", self.signal_lead_s, minimum=1)
        _check_int("slurm.max_restarts", self.max_restarts, minimum=0)
        if not _SLURM_TIME.match(self.time):
            raise ConfigError(f"slurm.time: {self.time!r} is not a Slurm time; accepted: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM:SS")
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"slurm.launcher: {self.launcher!r}; accepted: {', '.join(LAUNCHERS)}")
        if self.requeue not in REQUEUE_MODES:
            raise ConfigError(f"slurm.requeue: {self.requeue!r}; accepted: {', '.join(REQUEUE_MODES)}")
        for key in ("script_args", "sbatch_extra", "setup"):
            value = getattr(self, key)
            if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
                raise ConfigError(f"slurm.{key}: expected a list of strings, got {value!r}")
            setattr(self, key, [str(v) for v in value])


_SECTIONS: dict[str, type] = {
    "step_scheduler": StepSchedulerConfig,
    "checkpoint": CheckpointConfig,
    "slurm": SlurmConfig,
}


@dataclasses.dataclass(kw_only=True)
class ResilienceConfig:
    """The whole configuration: our sections plus the user's own sections in ``extra``."""

    step_scheduler: StepSchedulerConfig = dataclasses.field(default_factory=StepSchedulerConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    slurm: SlurmConfig = dataclasses.field(default_factory=SlurmConfig)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Top-level sections that are not ours (model, optimizer, data, ...), as plain YAML data."""

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain YAML-able data (what ``config.yaml`` in a checkpoint holds)."""
        out: dict[str, Any] = {}
        for name in _SECTIONS:
            section = dataclasses.asdict(getattr(self, name))
            if name == "step_scheduler" and isinstance(section["preemption_signal"], (list, tuple)):
                section["preemption_signal"] = [_yamlable(s) for s in section["preemption_signal"]]
            else:
                section = {k: _yamlable(v) for k, v in section.items()}
            out[name] = section
        out.update(self.extra)
        return out


def _yamlable(value: Any) -> Any:
    if hasattr(value, "name") and isinstance(value, int):  # signal.Signals
        return value.name
    return value


def _suggest(key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else f"; accepted keys: {', '.join(sorted(known))}"


def _build_section(name: str, cls: type, raw: Any) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{name}: expected a mapping of keys, got {type(raw).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in known:
            raise ConfigError(f"{name}.{key}: unknown key{_suggest(str(key), known)}")
    return cls(**raw)


def config_from_dict(data: Mapping[str, Any] | None) -> ResilienceConfig:
    """Validate plain data (parsed YAML) into a :class:`ResilienceConfig`.

    Raises:
        ConfigError: an unknown key inside one of our sections (with the closest known key), a
            top-level name close to one of ours, or a value of the wrong type or range;
            MindSpore Transformers and NeMo spellings of one setting that disagree.
    """
    from resilience.mindspore_compat import normalize_aliases  # imports ConfigError from here

    data = normalize_aliases(dict(data or {}))
    sections = {}
    extra = {}
    for key, value in data.items():
        if key in _SECTIONS:
            sections[key] = _build_section(key, _SECTIONS[key], value)
        elif difflib.get_close_matches(str(key), list(_SECTIONS), n=1, cutoff=0.75):
            raise ConfigError(f"{key}: unknown section{_suggest(str(key), list(_SECTIONS))}")
        else:
            extra[key] = value
    return ResilienceConfig(**sections, extra=extra)


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply dotted ``section.key=value`` overrides (values parsed as YAML) to ``data`` in place.

    Raises:
        ConfigError: an override without ``=`` or with an empty key.
    """
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected section.key=value, e.g. checkpoint.checkpoint_dir=/tmp/ck")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
            node = child
        node[parts[-1]] = yaml.safe_load(text) if text.strip() else None
    return data


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> ResilienceConfig:
    """Read a YAML file (or nothing), apply dotted overrides, and validate.

    Raises:
        ConfigError: unreadable file, a file that is not UTF-8, invalid YAML, a top level that is not a mapping, or any
            invalid key/value (see :func:`config_from_dict`).
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"config file {path}: cannot read it ({exc.strerror or exc})") from exc
        except UnicodeDecodeError as exc:  # a ValueError, not an OSError: binary or another encoding
            raise ConfigError(f"config file {path}: not UTF-8 text ({exc.reason} at byte {exc.start}); accepted: a UTF-8 YAML file") from exc
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path}: invalid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: the top level must be a mapping of sections")
        data = loaded or {}
    apply_overrides(data, overrides)
    return config_from_dict(data)
