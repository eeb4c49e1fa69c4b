"""The ``slurm`` section: how ``resilience template slurm`` renders the batch script."""

from __future__ import annotations

import dataclasses
import re

from resilience.config.checks import ConfigError, check_int, check_local_path

_SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?$")
_NO_LIMIT = ("UNLIMITED", "INFINITE")


def slurm_time_s(text: str) -> int | None:
    """Seconds in a Slurm ``--time`` value (sbatch(1): ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``,
    ``D-HH:MM``, ``D-HH:MM:SS``); ``None`` for ``UNLIMITED``/``INFINITE`` (any case).

    Raises:
        ValueError: ``text`` is none of these forms.
    """
    if text.upper() in _NO_LIMIT:
        return None
    match = _SLURM_TIME.match(text)
    if match is None:
        raise ValueError(text)
    days, first, second, third = match.groups()  # `first` always matches; `third` only after `second`
    head, mid, tail = int(first), int(second or 0), int(third or 0)
    if days is not None:  # D-HH[:MM[:SS]]
        return ((int(days) * 24 + head) * 60 + mid) * 60 + tail
    if third is not None:  # HH:MM:SS
        return (head * 60 + mid) * 60 + tail
    return head * 60 + mid  # MM[:SS]


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
    in_job_restarts: int = 0
    """``resilience run --max-restarts``: in-job restarts from ``LATEST`` after a stall, a crash or a kill,
    before the launcher exits 75 and the script requeues (``launcher: resilience`` only; on several nodes
    every node's launcher restarts its ranks together, through the shared ``--fault-file``)."""
    progress_timeout: str | float = "auto"
    """``resilience run --progress-timeout``: ``auto`` or seconds a rank may go without finishing a step."""
    signal_hold_timeout: float | str | None = None
    """``resilience run --signal-hold-timeout``: seconds (>= 0, shorter than ``signal_lead_s``) the
    launcher holds the stop signal for a rank that does not handle it yet before delivering it
    anyway (a program without ``resilient_loop()``), or ``inf`` (hold until it does); ``null``:
    the launcher's default, 60 s (``launcher: resilience`` only)."""
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
        if isinstance(self.time, int) and not isinstance(self.time, bool):  # YAML's 90: Slurm's minutes, as --time=90
            self.time = str(self.time)
        for key in ("script", "python", "job_name", "time", "output", "launcher", "requeue"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"slurm.{key}: expected a non-empty string, got {value!r}")
        if any(c.isspace() for c in self.job_name):  # an #SBATCH line is split at whitespace
            raise ConfigError(f"slurm.job_name: {self.job_name!r} holds whitespace; use '-' or '_' instead")
        for key in ("script", "output"):  # paths on the cluster's filesystem: an s3:// one would be a local folder
            setattr(self, key, check_local_path(f"slurm.{key}", getattr(self, key)))
        if self.partition is not None and (not isinstance(self.partition, str) or not self.partition):
            raise ConfigError(f"slurm.partition: expected a partition name or null, got {self.partition!r}")
        check_int("slurm.nodes", self.nodes, minimum=1)
        check_int("slurm.nproc_per_node", self.nproc_per_node, minimum=1)
        check_int("slurm.cpus_per_task", self.cpus_per_task, minimum=1, allow_none=True)
        check_int("slurm.signal_lead_s", self.signal_lead_s, minimum=1)
        check_int("slurm.max_restarts", self.max_restarts, minimum=0)
        try:
            wall_s = slurm_time_s(self.time)
        except ValueError:
            raise ConfigError(f"slurm.time: {self.time!r} is not a Slurm time; accepted: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, UNLIMITED") from None
        if wall_s is not None and self.signal_lead_s >= wall_s:
            raise ConfigError(
                f"slurm.signal_lead_s: {self.signal_lead_s} s is not shorter than slurm.time {self.time} ({wall_s} s): "
                "the warning would come as the job starts, and every start would stop at once"
            )
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"slurm.launcher: {self.launcher!r}; accepted: {', '.join(LAUNCHERS)}")
        self._check_watchdog()
        if self.requeue not in REQUEUE_MODES:
            raise ConfigError(f"slurm.requeue: {self.requeue!r}; accepted: {', '.join(REQUEUE_MODES)}")
        for key in ("script_args", "sbatch_extra", "setup"):
            value = getattr(self, key)
            if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
                raise ConfigError(f"slurm.{key}: expected a list of strings, got {value!r}")
            setattr(self, key, [str(v) for v in value])

    def _check_watchdog(self) -> None:
        """``in_job_restarts``, ``progress_timeout`` and ``signal_hold_timeout``: what ``resilience run`` accepts, where it runs."""
        check_int("slurm.in_job_restarts", self.in_job_restarts, minimum=0)
        timeout = self.progress_timeout
        if isinstance(timeout, bool) or not (timeout == "auto" or (isinstance(timeout, (int, float)) and 0 < timeout < float("inf"))):
            raise ConfigError(f"slurm.progress_timeout: expected 'auto' or a number of seconds > 0, got {timeout!r}")
        if self.launcher != "resilience" and (self.in_job_restarts or timeout != "auto"):
            raise ConfigError(f"slurm.in_job_restarts and slurm.progress_timeout need slurm.launcher: resilience (the watchdog is ours), got {self.launcher!r}")
        hold = self.signal_hold_timeout
        if isinstance(hold, str) and hold.strip().lower() in ("inf", "infinity"):
            hold = self.signal_hold_timeout = float("inf")
        if hold is None:
            return
        if isinstance(hold, bool) or not isinstance(hold, (int, float)) or not hold >= 0:
            raise ConfigError(f"slurm.signal_hold_timeout: expected a number of seconds >= 0, inf or null (the launcher's 60 s), got {hold!r}")
        if self.launcher != "resilience":
            raise ConfigError(f"slurm.signal_hold_timeout needs slurm.launcher: resilience (the hold is our launcher's), got {self.launcher!r}")
        if hold != float("inf") and hold >= self.signal_lead_s:
            raise ConfigError(
                f"slurm.signal_hold_timeout: {hold:g} s is not shorter than slurm.signal_lead_s ({self.signal_lead_s} s): "
                "a rank that never handles the signal would get it only after the job's end"
            )
