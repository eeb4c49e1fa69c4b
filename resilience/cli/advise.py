"""``resilience advise DIR``: a Slurm ``--signal=B:USR1@N`` lead time from the step and save times in the manifests.

Only the standard library is imported at import time; the checkpoint modules are imported inside
the functions, so registering the command costs ``resilience run`` nothing.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from resilience.checkpoint.layout import CONFIG, MANIFEST, list_checkpoints
from resilience.cli.output import JSON_VERSION, UsageError, add_json_flag, existing_dir, print_doc, read_side, saved_section, usage_failed
from resilience.config import StepSchedulerConfig
from resilience.exit_codes import ExitCode

HELP = "recommend #SBATCH --signal=B:USR1@N from the step and save times recorded in the checkpoints' manifests"

SLURM_SIGNAL_INTERVAL_S = 30
"""Slurm checks ``--signal`` times about every 30 s, so a signal asked for ``@N`` arrives
between N and N + 30 s before the end (sbatch(1), ``--signal``)."""


TORCHRUN_SHUTDOWN_TIMEOUT_S = 30
"""Seconds torchrun's agent (torch 2.13) waits after passing a SIGTERM on to its workers before it
SIGKILLs them: ``LaunchConfig.shutdown_timeout`` in ``torch/distributed/launcher/api.py``
(``--shutdown-timeout``, else ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30), used by
``SubprocessContext._close`` in ``torch/distributed/elastic/multiprocessing/api.py``."""
_SHUTDOWN_TIMEOUT = re.compile(r"(?:TORCH_ELASTIC_SHUTDOWN_TIMEOUT=|--shutdown[-_]timeout[= ])['\"]?(\d+)")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def _recorded_timings(root: Path) -> list[dict[str, Any]]:
    """``{"name", "saved_at", "step_s", "save_s"}`` of every readable manifest under ``root``
    (or of ``root`` itself when it is a checkpoint), newest first."""
    from resilience.checkpoint.storage.manifest import CheckpointInvalid, read_manifest

    directories = [root] if (root / MANIFEST).exists() else list_checkpoints(root)
    rows: list[dict[str, Any]] = []
    for order, directory in enumerate(directories):
        try:
            meta = read_manifest(directory).get("meta") or {}
        except CheckpointInvalid:
            continue
        timings = meta.get("timings")
        if not isinstance(timings, dict):
            timings = {}
        rows.append(
            {
                "name": directory.name,
                "saved_at": _number(meta.get("saved_at")),
                "order": order,
                "step_s": _number(timings.get("step_s")),
                "save_s": _number(timings.get("save_s")),
            }
        )
    rows.sort(key=lambda r: (r["saved_at"] is None, -(r["saved_at"] or 0), r["order"]))
    return rows


def _run_settings(root: Path, source: str) -> dict[str, Any]:
    """The saved ``config.yaml``'s cadence, interval and first Slurm-sendable signal, from the
    checkpoint ``source`` (under ``root``) whose timings are used; ``{}`` when unreadable."""
    sched = saved_section(root if root.name == source else root / source, "step_scheduler")
    settings: dict[str, Any] = {}
    if sched.get("agreement_every_steps") is not None:
        settings["agreement_every_steps"] = sched["agreement_every_steps"]
    if isinstance(sched.get("agreement_interval_s"), (int, float)):
        settings["agreement_interval_s"] = float(sched["agreement_interval_s"])
    signals = sched.get("preemption_signal")
    names = [str(x).upper().removeprefix("SIG") for x in (signals if isinstance(signals, list) else [signals]) if isinstance(x, str)]
    sendable = [n for n in names if n in ("USR1", "USR2", "TERM")]
    if sendable:
        settings["signal"] = "USR1" if "USR1" in sendable else sendable[0]
    slurm = saved_section(root if root.name == source else root / source, "slurm")
    if slurm.get("launcher") == "torchrun":
        setup = slurm.get("setup")
        if not isinstance(setup, list):
            setup = []
        found = [int(m.group(1)) for line in setup for m in [_SHUTDOWN_TIMEOUT.search(str(line))] if m]
        settings["torchrun_shutdown_timeout_s"] = found[-1] if found else TORCHRUN_SHUTDOWN_TIMEOUT_S
    return settings


def advise(
    root: Path, *, safety: float = 1.5, agreement_every_steps: int | str | None = None, median: bool = False, agreement_interval_s: float | None = None
) -> dict[str, Any]:
    """The recommended Slurm lead time from the timings recorded under ``root``.

    ``agreement_every_steps`` is the loop's cadence k (an int, or ``auto``: the steps that fit
    in ``agreement_interval_s`` seconds, as the loop adapts it); by default both, and the signal
    named in the ``#SBATCH`` line, come from the run's own ``config.yaml`` in the checkpoint
    (else ``auto``, 0.1 s and USR1, the defaults).

    Uses the newest checkpoint (by ``saved_at``) that recorded both ``step_s`` and ``save_s``
    (else the newest with ``step_s``, counting a save as one step, as
    :func:`resilience.timing.must_stop` does), or with ``median`` the medians over all
    checkpoints. ``lead_s = ceil(seconds_needed + 30)``: Slurm checks signal times every 30 s.

    ``warnings``: under ``slurm.launcher: torchrun`` (from the saved config), when
    ``seconds_needed`` exceeds torchrun's SIGTERM-to-SIGKILL budget
    (:data:`TORCHRUN_SHUTDOWN_TIMEOUT_S`, or a ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT=N`` /
    ``--shutdown-timeout N`` found in ``slurm.setup``).

    Raises:
        LookupError: no manifest under ``root`` recorded a step time.
    """
    from resilience.timing import auto_cadence, seconds_needed

    rows = _recorded_timings(root)
    with_step = [r for r in rows if r["step_s"] is not None]
    if not rows:
        raise LookupError(f"no checkpoint with a readable manifest under {root}: advise reads the step and save times that resilient_loop records in them")
    if not with_step:
        raise LookupError(
            f"no step times recorded in the manifests under {root} ({len(rows)} readable): timings are recorded by "
            "resilient_loop from the second step on; run training a little longer, or choose --signal=...@N by hand"
        )
    notes = []
    if median:
        step_s = statistics.median(r["step_s"] for r in with_step)
        saves = [r["save_s"] for r in rows if r["save_s"] is not None]
        save_s = statistics.median(saves) if saves else None
        source = f"median over {len(with_step)} checkpoint{'s' if len(with_step) != 1 else ''}"
    else:
        both = [r for r in with_step if r["save_s"] is not None]
        row = both[0] if both else with_step[0]
        step_s, save_s = row["step_s"], row["save_s"]
        source = row["name"]
    if save_s is None:
        save_s = step_s
        notes.append("no save time recorded yet: a save is counted as one step (as the loop's deadline rule does)")
    settings = _run_settings(root, source) if not median else _run_settings(root, with_step[0]["name"])
    if agreement_every_steps is None:
        agreement_every_steps = settings.get("agreement_every_steps", "auto")
    if not (isinstance(agreement_every_steps, int) and agreement_every_steps >= 1):
        agreement_every_steps = "auto"  # also for a saved value that is neither an int >= 1 nor auto
    if agreement_interval_s is None:
        agreement_interval_s = settings.get("agreement_interval_s", StepSchedulerConfig().agreement_interval_s)
    signal_name = settings.get("signal", "USR1")
    if isinstance(agreement_every_steps, int):
        k = agreement_every_steps
    else:
        k = auto_cadence(step_s, agreement_interval_s) or 1
        notes.append(f"agreement_every_steps auto: k = {k} for {_sig(step_s)} s steps (a round every {agreement_interval_s:g} s at most, at least every step)")
    needed = seconds_needed(step_s, save_s, agreement_every_steps=k, safety=safety)
    lead_s = math.ceil(needed + SLURM_SIGNAL_INTERVAL_S)
    warnings = []
    budget = settings.get("torchrun_shutdown_timeout_s")
    if budget is not None and needed > budget:
        warnings.append(
            f"slurm.launcher: torchrun: a stop needs {needed:.1f} s, but torchrun's agent SIGKILLs its workers "
            f"{budget} s after it receives SIGTERM (its --shutdown-timeout), and Slurm sends SIGTERM to every "
            f"process of a step at its end, on scancel and after a preemption's GraceTime: add "
            f"'export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={math.ceil(needed)}' (or more) to slurm.setup, or use "
            f"slurm.launcher: resilience or srun"
        )
    return {
        "version": JSON_VERSION,
        "root": str(root),
        "source": source,
        "step_s": step_s,
        "save_s": save_s,
        "safety": safety,
        "agreement_every_steps": k,
        "seconds_needed": needed,
        "slurm_signal_interval_s": SLURM_SIGNAL_INTERVAL_S,
        "lead_s": lead_s,
        "sbatch": f"#SBATCH --signal=B:{signal_name}@{lead_s}",
        "notes": notes,
        "warnings": warnings,
    }


def _sig(seconds: float) -> str:
    """Seconds to 4 significant digits: a 0.8 ms step printed as 0.001 made the shown arithmetic
    disagree with its result."""
    return f"{seconds:.4g}"


def format_advice(doc: dict[str, Any]) -> str:
    """The terminal form of an :func:`advise` document, with the arithmetic."""
    k = doc["agreement_every_steps"]
    steps = 2 * k - 1
    return "\n".join(
        [
            f"Timings from {doc['source']}: step {_sig(doc['step_s'])} s, save {_sig(doc['save_s'])} s",
            *[f"  note: {n}" for n in doc["notes"]],
            *[f"  warning: {w}" for w in doc.get("warnings", [])],
            "A stop needs (steps the agreement may still run + one save) x safety:",
            f"  ((2 x {k} - 1) x {_sig(doc['step_s'])} s + {_sig(doc['save_s'])} s) x {doc['safety']:g}"
            f" = ({steps} x {_sig(doc['step_s'])} + {_sig(doc['save_s'])}) x {doc['safety']:g} = {doc['seconds_needed']:.3f} s",
            f"Slurm checks signal times every {doc['slurm_signal_interval_s']} s, so the signal comes between N and "
            f"N + {doc['slurm_signal_interval_s']} s before the end:",
            f"  N = ceil({doc['seconds_needed']:.3f} + {doc['slurm_signal_interval_s']}) = {doc['lead_s']}",
            "",
            doc["sbatch"],
            f"(in the training YAML: slurm.signal_lead_s: {doc['lead_s']})",
        ]
    )


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare ``CHECKPOINT_DIR``, ``--safety``, ``--agreement-every-steps``, ``--median``, ``--json``."""
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="the checkpoint root (or one checkpoint directory)")
    parser.add_argument("--safety", default="1.5", help="factor on step + save time (default 1.5, as step_scheduler.deadline_safety)")
    parser.add_argument(
        "--agreement-every-steps",
        default=None,
        help="the stop agreement's cadence k in steps, or auto (step_scheduler.agreement_every_steps; default: the run's own, "
        f"from its saved {CONFIG}, else auto): a stop may run 2k - 1 more steps",
    )
    parser.add_argument("--median", action="store_true", help="the median over all checkpoints instead of the newest timings")
    add_json_flag(parser, instead_of="text")
    return parser


def _parse_advise(args: argparse.Namespace) -> tuple[Path, float, int | str | None]:
    try:
        safety = float(args.safety)
    except ValueError:
        safety = float("nan")
    if not math.isfinite(safety) or safety < 1:  # as step_scheduler.deadline_safety: below 1 the stop would not fit
        raise UsageError(f"--safety: expected a number >= 1 (as step_scheduler.deadline_safety), e.g. 1.5, got {args.safety!r}")
    every: int | str | None = args.agreement_every_steps
    if every not in (None, "auto"):
        try:
            every = int(args.agreement_every_steps)
        except ValueError:
            every = 0
        if every < 1:
            raise UsageError(f"--agreement-every-steps: expected an integer >= 1 or auto, got {args.agreement_every_steps!r}")
    return read_side(existing_dir(args.checkpoint_dir, "CHECKPOINT_DIR")), safety, every


def run(args: argparse.Namespace) -> int:
    """Print the recommended lead time; 1 when no timings are recorded, 2 on bad arguments."""
    try:
        root, safety, every = _parse_advise(args)
    except UsageError as exc:
        return usage_failed("advise", exc)
    try:
        doc = advise(root, safety=safety, agreement_every_steps=every, median=args.median)
    except LookupError as exc:
        print(f"resilience advise: {exc}", file=sys.stderr)
        return int(ExitCode.FAILED)
    print_doc(doc, args.json, format_advice)
    return int(ExitCode.DONE)
