"""Slurm batch scripts rendered from the training's own YAML (the ``resilience template slurm`` command is :mod:`resilience.cli.template`).

``render_slurm`` turns a :class:`~resilience.config.ResilienceConfig` into the text of a batch
script (``templates/slurm.sub``): the ``#SBATCH`` lines from the ``slurm:`` section, and a body
that traps the stop signal, launches the ranks, forwards the signal, and requeues on
``ExitCode.PREEMPTED``. The ``--signal`` line is built from ``step_scheduler.preemption_signal``
(its first signal) and ``slurm.signal_lead_s``, so the signal Slurm sends and the one training
listens for come from one setting and cannot disagree.

The script's shell code lives in ``resilience/slurm/templates/*.sh.in`` (package data, read-only);
``@NAME@`` fields in them are filled here. What the script does, in order:

1. installs a fork-free trap for the signal before anything runs, and prints
   ``resilience: trap installed``; the trap counts the signal and creates the stop file
   (``RESILIENCE_STOP_FILE``) that ranks read when their loop starts;
2. prints ``resilience: attempt N`` (``N = SLURM_RESTART_COUNT + 1``; Slurm leaves the count unset
   on the first run) and exports ``RESILIENCE_TEMPLATE=1``, ``RESILIENCE_RUN_ID``, ``MASTER_PORT``
   (job id and restart count, as :func:`resilience.launch.slurm_master_port`) and ``MASTER_ADDR``
   (multi-node: the first node's ``NodeAddr`` from ``scontrol show node``);
3. runs ``slurm.setup``, then launches the ranks in the background with ``slurm.launcher``;
4. waits, forwarding each signal from the main loop: with ``launcher: resilience`` to this node's
   launcher as soon as it runs (retried every 0.5 s until then), which holds a stop signal for ranks
   that do not handle it yet and delivers it after ``--signal-hold-timeout``
   (``slurm.signal_hold_timeout``) to a program that never does; the launcher records that
   delivery under ``--checkpoint-dir`` (``checkpoint.checkpoint_dir``) for ``resilience status``.
   With ``srun`` and ``torchrun`` to this node's training processes once every rank on this node
   handles it (read from ``SigCgt`` in ``/proc/PID/status``); a rank that does not handle it yet
   has not read the stop file yet either, and stops through it;
5. kills and reaps whatever the attempt left running, then acts on the ranks' exit code
   (:class:`~resilience.exit_codes.ExitCode`): 75 requeues (``scontrol requeue``, with
   ``<array job id>_<task id>`` for array tasks, or ``sbatch --dependency=afterany`` in resubmit
   mode) unless ``slurm.max_restarts`` restarts were made, then exits 77; 0 and 76 exit as they
   are; any other code exits unchanged, never requeued.

Files under ``$RESILIENCE_STATE_DIR`` (default ``$SLURM_SUBMIT_DIR/.resilience``, which every node
must see): ``<id>.<restart>.stop`` while a stop is pending and
``<id>.<restart>.<node>.pids`` with the launcher's and ranks' pids (``launcher PID``,
``agent PID``, ``rank R PID`` lines). ``RESILIENCE_TEST_PRELAUNCH_SLEEP=S`` in the submitting
environment delays the launch by S seconds (tests use it to signal before the ranks start).
"""

from __future__ import annotations

import functools
import re
import shlex
import signal
from importlib import resources

from resilience.config import ConfigError, ResilienceConfig
from resilience.launch.forwarding import FORWARDED_SIGNALS
from resilience.launch.rank_group import STOP_SIGNALS

#: Signal names ``sbatch --signal`` accepts (Slurm 22.05 ``sig_name2num``; checked with
#: ``sbatch --test-only``), less the ones a batch script cannot use: KILL and STOP cannot be
#: caught, and CONT is what Slurm sends just before every warning signal.
SLURM_SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP", "QUIT", "ABRT", "ALRM", "URG", "XCPU", "TSTP", "TTIN", "TTOU")

#: In ``slurm.script_args``, this text is replaced by the ``config_path`` given to
#: :func:`render_slurm` (the YAML being rendered), e.g. ``["--config", "{config}"]``.
CONFIG_PLACEHOLDER = "{config}"

_FIELD = re.compile(r"@([A-Z_]+)@")


@functools.cache
def _source(name: str) -> str:
    """A template source from the package (immutable package data, read once)."""
    return (resources.files("resilience.slurm") / "templates" / name).read_text()  # one part per join: Python 3.10's Traversable


def slurm_signal(config: ResilienceConfig) -> str:
    """The signal name for ``--signal=B:<NAME>@N``: the first of ``step_scheduler.preemption_signal``
    without ``SIG`` (``"USR1"``).

    Raises:
        ConfigError: ``preemption_signal`` is null (nothing for Slurm to send), or its first signal
            is not one ``sbatch --signal`` accepts by name (see :data:`SLURM_SIGNALS`).
    """
    signals = config.step_scheduler.signals
    if not signals:
        raise ConfigError(
            "step_scheduler.preemption_signal: null, but a Slurm batch script needs a signal to put in --signal=B:<SIG>@<seconds>; set it, e.g. SIGUSR1"
        )
    name = signals[0].name.removeprefix("SIG")
    if name not in SLURM_SIGNALS:
        raise ConfigError(
            f"step_scheduler.preemption_signal: its first signal {signals[0].name} is not one "
            f"Slurm's --signal can send to a batch script; accepted: "
            f"{', '.join('SIG' + s for s in SLURM_SIGNALS)} (SIGUSR1 is the usual choice)"
        )
    return name


def _sbatch_lines(config: ResilienceConfig, signal_name: str) -> list[str]:
    s = config.slurm
    lines = [f"--job-name={s.job_name}"]
    if s.partition is not None:
        lines.append(f"--partition={s.partition}")
    lines += [f"--nodes={s.nodes}", f"--ntasks-per-node={s.nproc_per_node}"]
    if s.cpus_per_task is not None:
        lines.append(f"--cpus-per-task={s.cpus_per_task}")
    lines += [
        f"--time={s.time}",
        f"--signal=B:{signal_name}@{s.signal_lead_s}",
        "--requeue",
        "--open-mode=append",
        f"--output={s.output}",
        *s.sbatch_extra,
    ]
    for line in lines:
        if "\n" in line or "\r" in line:
            raise ConfigError(f"slurm: an #SBATCH option may not contain a line break: {line!r}")
    return [f"#SBATCH {line}" for line in lines]


def _header(config: ResilienceConfig, config_path: str | None, signal_name: str) -> str:
    s = config.slurm
    source = config_path if config_path is not None else "the default configuration (no YAML)"
    return "\n".join(
        [
            f"# Slurm batch script rendered from {source} by `resilience template slurm`.",
            "# Edit the YAML and render again rather than this file: the --signal line below and the",
            "# training's step_scheduler.preemption_signal come from the same setting.",
            "#",
            "#   sbatch THIS_FILE [extra arguments for every rank]",
            f"#   scancel --batch --signal={signal_name} <jobid>    # what Slurm sends {s.signal_lead_s} s before the end",
        ]
    )


def _command(config: ResilienceConfig, config_path: str | None) -> str:
    s = config.slurm
    if config_path is None and any(CONFIG_PLACEHOLDER in a for a in s.script_args):
        raise ConfigError(f"slurm.script_args: {CONFIG_PLACEHOLDER} stands for the YAML's path, but the script is rendered without a YAML")
    args = [s.script, *(str(a) if config_path is None else str(a).replace(CONFIG_PLACEHOLDER, config_path) for a in s.script_args)]
    return " ".join(shlex.quote(a) for a in args)


def _launch_source(config: ResilienceConfig) -> str:
    s = config.slurm
    multi = s.nodes > 1
    if s.launcher == "resilience":
        return _source("launch-resilience-multi.sh.in" if multi else "launch-resilience-single.sh.in")
    if s.launcher == "srun":
        return _source("launch-srun.sh.in")
    launch = _source("launch-torchrun-multi.sh.in" if multi else "launch-torchrun-single.sh.in")
    launch = launch.replace("@SHIM@", _source("torchrun-shim.sh.in").rstrip("\n"))
    return launch.replace("@TORCHRUN_POLL@", _source("torchrun-poll.sh.in").rstrip("\n"))


def _run_options(config: ResilienceConfig) -> str:
    """`` --max-restarts N --progress-timeout S --signal-hold-timeout S`` for ``resilience run``;
    empty at the defaults (0, ``auto``, null: the launcher's 60 s)."""
    s = config.slurm
    options = []
    if s.in_job_restarts:
        options.append(f" --max-restarts {s.in_job_restarts}")
    if s.progress_timeout != "auto":
        options.append(f" --progress-timeout {s.progress_timeout:g}")
    if s.signal_hold_timeout is not None:
        options.append(f" --signal-hold-timeout {s.signal_hold_timeout:g}")
    return "".join(options)


def _launcher_holds(signal_name: str) -> str:
    """``1`` when ``resilience run`` holds ``signal_name`` for ranks that do not handle it yet (its
    stop signals, delivered after ``--signal-hold-timeout``), so the batch shell may pass it on at
    once; ``0`` for a signal it forwards to every rank as it comes."""
    return "1" if signal_name in {sig.name.removeprefix("SIG") for sig in STOP_SIGNALS} else "0"


def _master_addr(config: ResilienceConfig) -> str:
    if config.slurm.nodes == 1:
        return "export MASTER_ADDR=127.0.0.1"
    return "\n".join(
        [
            "# The first node's NodeAddr: node names need not resolve from the other nodes.",
            'rs_first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            "MASTER_ADDR=$(scontrol show node \"$rs_first\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p' | head -n 1)",
            "export MASTER_ADDR=${MASTER_ADDR:-$rs_first}",
        ]
    )


def render_slurm(config: ResilienceConfig, *, config_path: str | None) -> str:
    """The batch script for ``config``, as text (see the module docstring for what it does).

    Pure: the result depends only on the arguments (and the package's own template sources); no
    environment, clock or user file is read. One node or several is chosen by ``slurm.nodes``;
    how ranks start by ``slurm.launcher``; requeue or resubmission by ``slurm.requeue``.

    Args:
        config: a validated configuration; its ``slurm`` section and
            ``step_scheduler.preemption_signal`` are used.
        config_path: the YAML's path as the job will see it (relative to the submit directory or
            absolute); it replaces ``{config}`` in ``slurm.script_args`` and is named in the header.
            ``None`` for a script rendered from the defaults alone (``templates/slurm.sub``).

    Raises:
        ConfigError: no usable preemption signal (see :func:`slurm_signal`; with ``slurm.launcher:
            resilience``, one its launcher forwards), an ``#SBATCH``
            option containing a line break, or ``{config}`` in ``slurm.script_args`` with no
            ``config_path``.
    """
    s = config.slurm
    signal_name = slurm_signal(config)
    if s.launcher == "resilience" and getattr(signal, "SIG" + signal_name) not in FORWARDED_SIGNALS:
        # the batch shell hands the signal to the launcher, which would never pass this one on
        raise ConfigError(
            f"step_scheduler.preemption_signal: SIG{signal_name} with slurm.launcher: resilience, whose launcher forwards only "
            f"{', '.join(sig.name for sig in FORWARDED_SIGNALS)}; use SIGUSR1 (the usual choice), or another launcher"
        )
    cpus_per_task = s.cpus_per_task or 1
    text = _source("batch.sh.in")
    text = text.replace("@LAUNCH@", _launch_source(config).rstrip("\n"))
    text = text.replace("@REQUEUE@", _source(f"{s.requeue}.sh.in").rstrip("\n"))
    collect = _source("torchrun-collect.sh.in").rstrip("\n") if s.launcher == "torchrun" else ""
    text = text.replace("@COLLECT_RC@\n", collect + "\n" if collect else "")
    values = {
        "HEADER": _header(config, config_path, signal_name),
        "SBATCH": "\n".join(_sbatch_lines(config, signal_name)),
        "SIGNAL": signal_name,
        "MAX_RESTARTS": str(s.max_restarts),
        "MASTER_ADDR": _master_addr(config),
        "SETUP": "\n".join(s.setup) if s.setup else "# (none)",
        "PYTHON": shlex.quote(s.python),
        "COMMAND": _command(config, config_path),
        "NPROC": str(s.nproc_per_node),
        "RUN_OPTIONS": _run_options(config),
        "CHECKPOINT_DIR": shlex.quote(config.checkpoint.checkpoint_dir),
        "LAUNCHER_HOLDS": _launcher_holds(signal_name),
        "CPUS_PER_TASK": str(cpus_per_task),
        "STEP_CPUS": str(s.nproc_per_node * cpus_per_task),
    }
    # One pass, so text inserted from the configuration is never scanned for fields itself.
    return _FIELD.sub(lambda m: values[m.group(1)], text)
