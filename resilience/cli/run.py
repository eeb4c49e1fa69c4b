"""The ``resilience run`` command: options, then start the ranks and forward signals until they exit."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

from resilience.env_names import PID_FILE_ENV
from resilience.exit_codes import ExitCode
from resilience.launch.forwarding import FORWARDED_SIGNALS, RecordedSignals
from resilience.launch.held_stops import DEFAULT_HOLD_TIMEOUT_S, write_record
from resilience.launch.node_faults import NodeFaults
from resilience.launch.rank_group import RankGroup
from resilience.launch.start import launch
from resilience.launch.supervise import Outcome, supervise
from resilience.launch.watchdog import DEFAULT_STARTUP_TIMEOUT_S, ProgressTimeout
from resilience.local_paths import URL

HELP = "start N local ranks (torchrun-like), forward USR1/USR2/TERM/INT/HUP/QUIT to them, watch their progress, restart them in-job, exit with their code"


def _stderr_log(message: str) -> None:
    print(f"resilience run: {message}", file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``run`` command's options to ``parser`` (used by ``resilience run``)."""
    parser.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        "-n",
        type=int,
        required=True,
        metavar="N",
        help="ranks to start on this node (torchrun's name; -n for short)",
    )
    parser.add_argument("--nnodes", type=int, default=1, metavar="N", help="number of nodes, one launcher each (default 1)")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0, metavar="R", help="this node's index, 0..nnodes-1 (default 0)")
    parser.add_argument("--master-addr", "--master_addr", default="127.0.0.1", metavar="HOST", help="rendezvous host, MASTER_ADDR (default 127.0.0.1)")
    parser.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=None,
        metavar="P",
        help="rendezvous port, MASTER_PORT (default: derived from SLURM_JOB_ID and SLURM_RESTART_COUNT inside Slurm, else a free local port)",
    )
    parser.add_argument(
        "--failure-grace",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds the other ranks may run after one exits non-zero, before SIGTERM (default 30)",
    )
    parser.add_argument("--kill-grace", type=float, default=5.0, metavar="S", help="seconds between SIGTERM and SIGKILL (default 5)")
    parser.add_argument(
        "--signal-hold-timeout",
        type=float,
        default=DEFAULT_HOLD_TIMEOUT_S,
        metavar="S",
        help="seconds a stop signal (USR1/USR2/TERM) is held for a rank that is not ready (no handler yet, no resilient_loop()) "
        f"before it is delivered anyway, so the program's own handler or the default action runs; inf: hold until ready "
        f"(default {DEFAULT_HOLD_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="the ranks' checkpoint root: a stop signal delivered after --signal-hold-timeout is recorded there "
        "(.held_stop.json), which resilience status DIR shows",
    )
    parser.add_argument(
        "--progress-timeout",
        default="auto",
        metavar="S|auto",
        help="seconds a rank inside resilient_loop may go without finishing a step before the watchdog prints every "
        "rank's stacks and ends them; auto (default): 5 x the longest step reported, at least 60 s",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=DEFAULT_STARTUP_TIMEOUT_S,
        metavar="S",
        help=f"the watchdog's limit before the first step: start-up, loading LATEST, the first step (default {DEFAULT_STARTUP_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        metavar="N",
        help="start the ranks again (resuming from LATEST) after a stall, a crash or a kill, up to N times (torchrun's name; "
        "default 0); then exit 75 (requeue)",
    )
    parser.add_argument(
        "--fault-file",
        default=None,
        metavar="PATH",
        help="with several nodes: a file every node's launcher shares (on a shared filesystem) so that a failure on one "
        "node ends every node's ranks at once and in-job restarts start them together (required for --max-restarts "
        "with --nnodes > 1; a new path for each run: an old file's records would end the ranks at once)",
    )
    parser.add_argument(
        "--pid-file",
        default=None,
        metavar="PATH",
        help=f"write 'launcher <pid>' and 'rank <r> <pid>' lines here (default: ${PID_FILE_ENV})",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("-m", "--module", action="store_true", help="run the target as a Python module, like python -m")
    mode.add_argument("--no-python", action="store_true", help="run the target as an executable, not with this Python")
    parser.add_argument("script", metavar="script.py|module|program", help="what each rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="arguments passed to every rank")
    return parser


def _rank_command(args: argparse.Namespace) -> list[str]:
    # -u like torchrun: ranks' output reaches the Slurm log as it happens.
    if args.module:
        return [sys.executable, "-u", "-m", args.script, *args.script_args]
    if args.no_python:
        return [args.script, *args.script_args]
    return [sys.executable, "-u", args.script, *args.script_args]


def run(args: argparse.Namespace) -> int:
    """Run parsed ``resilience run`` arguments (see :func:`add_arguments`); return the exit code.

    Installs record-only handlers for :data:`FORWARDED_SIGNALS` before starting the ranks,
    forwards each recorded signal to every live rank from this (main) thread, logging one
    line per signal to stderr, and watches the ranks' progress
    (:func:`~resilience.launch.supervise.supervise`). The exit code:

    - every rank exited with the same code of :class:`ExitCode` (0, 2, 75, 76, 77), or the
      launcher received a signal: the ranks' combined code (:func:`combine_exit_codes`);
    - a stall, a crash or a kill (the other ranks are ended): the ranks start again, resuming
      from ``LATEST``, up to ``--max-restarts`` times; the requeue-loop guard
      (``checkpoint.max_restarts_without_progress``) makes restarts that save nothing new end
      with 76. Once restarts are exhausted: 75 (requeue), except that without restarts
      (``--max-restarts 0``) a rank's own error exit keeps the combined code (1, no requeue).

    With several nodes and ``--fault-file`` (:mod:`~resilience.launch.node_faults`): a failure on
    any node ends every node's ranks at once and counts as this node's failure too (its kind, a
    stall or kill or an error exit, is the failed node's); each restart waits until every node's
    launcher is ready (75 when one will not restart or does not come); a local error exit that
    follows a kill on another node counts as that kill (75 once restarts are exhausted).

    Returns ``ExitCode.CONFIG_ERROR`` (2) for bad arguments or a program that cannot be started.
    Handlers are restored before returning.
    """
    pid_file = args.pid_file or os.environ.get(PID_FILE_ENV)
    cmd = _rank_command(args)
    try:
        timeout = ProgressTimeout.parse(args.progress_timeout, args.startup_timeout)
        if args.max_restarts < 0:
            raise ValueError(f"--max-restarts: expected an int >= 0, got {args.max_restarts}")
        if not args.signal_hold_timeout >= 0:
            raise ValueError(f"--signal-hold-timeout: expected a number of seconds >= 0 (inf: hold until ready), got {args.signal_hold_timeout}")
        if args.max_restarts and args.nnodes > 1 and not args.fault_file:
            raise ValueError(
                "--max-restarts: with --nnodes > 1 the launchers restart together through a shared file: pass "
                "--fault-file PATH (the same path, on a filesystem every node sees, to every node's launcher)"
            )
    except ValueError as error:
        _stderr_log(f"error: {error}")
        return int(ExitCode.CONFIG_ERROR)
    nodes = NodeFaults(args.fault_file, args.node_rank, args.nnodes) if args.fault_file and args.nnodes > 1 else None
    with RecordedSignals(FORWARDED_SIGNALS) as recorded:
        code = _run_starts(args, cmd, recorded, timeout, pid_file, nodes)
    if nodes is not None:
        nodes.record_end()  # another node waiting to restart gives up now, not at its timeout
    return code


def _run_starts(
    args: argparse.Namespace, cmd: list[str], recorded: RecordedSignals, timeout: ProgressTimeout, pid_file: str | None, nodes: NodeFaults | None
) -> int:
    """Start the ranks, again after each failure while restarts are left (see :func:`run`)."""
    restarts = 0
    while True:
        outcome = _start_once(args, cmd, recorded, timeout, pid_file, restarts, nodes)
        if isinstance(outcome, int):
            return outcome
        if outcome.fault is None:
            if outcome.code == ExitCode.NO_PROGRESS and restarts:
                _stderr_log(
                    f"the ranks exited {int(ExitCode.NO_PROGRESS)} (NO_PROGRESS) after {restarts} in-job restart(s): "
                    "the starts before saved no new checkpoint (checkpoint.max_restarts_without_progress); not restarted, not requeued"
                )
            _stderr_log(f"ranks exited with {outcome.codes}; exit code {outcome.code}")
            return outcome.code
        if restarts < args.max_restarts and not outcome.stop_requested:
            why_not = _restart_barrier(nodes, args)
            if why_not is None:
                restarts += 1
                _stderr_log(f"{outcome.fault}; restarting every local rank from LATEST (in-job restart {restarts} of {args.max_restarts})")
                continue
            _stderr_log(f"{outcome.fault}; not restarted: {why_not}; exit code {int(ExitCode.PREEMPTED)} (requeue)")
            return int(ExitCode.PREEMPTED)
        if nodes is not None and not outcome.infrastructure:
            # a rank killed on another node makes ours fail in their next collective: that kill is the cause
            cause = nodes.peer_infrastructure()
            if cause is not None:
                outcome = dataclasses.replace(outcome, fault=f"{outcome.fault} after {cause.describe()}", infrastructure=True)
        return _exhausted(outcome, restarts, args.max_restarts)


def _restart_barrier(nodes: NodeFaults | None, args: argparse.Namespace) -> str | None:
    """With several nodes: wait until every node's launcher is ready to restart (see
    :meth:`NodeFaults.wait_for_restart`); ``None`` when they are (or on one node), else why not."""
    if nodes is None:
        return None
    _stderr_log(f"waiting for the other nodes' launchers to end their ranks too (in {nodes.path})")
    try:
        why_not = nodes.wait_for_restart(args.failure_grace + 3 * args.kill_grace + 60)
    except OSError as error:
        return f"cannot write {nodes.path}: {error}"
    if why_not is None:
        nodes.begin(nodes.start + 1)
    return why_not


def _start_once(
    args: argparse.Namespace,
    cmd: list[str],
    recorded: RecordedSignals,
    timeout: ProgressTimeout,
    pid_file: str | None,
    restarts: int,
    nodes: NodeFaults | None,
) -> Outcome | int:
    """One start of the ranks, watched to its end; an ``int`` exit code when they cannot start."""
    try:
        group = launch(
            cmd,
            args.nproc_per_node,
            master_addr=args.master_addr,
            master_port=args.master_port,
            node_rank=args.node_rank,
            nnodes=args.nnodes,
            failure_grace_s=args.failure_grace,
            kill_grace_s=args.kill_grace,
            log=_stderr_log,
            restart_count=restarts,
            collective_timeout_s=timeout.collective_s,
            hold_timeout_s=args.signal_hold_timeout,
        )
    except (ValueError, OSError) as error:
        _stderr_log(f"error: {error}")
        return int(ExitCode.CONFIG_ERROR)
    with group:
        if pid_file:
            try:
                group.write_pid_file(pid_file)
            except OSError as error:
                _stderr_log(f"error: cannot write the pid file {pid_file!r}: {error}")
                return int(ExitCode.CONFIG_ERROR)  # leaving `with group` stops the ranks
        outcome = supervise(group, recorded, timeout, _stderr_log, nodes)
        if args.checkpoint_dir and group.delivered_after_hold:
            _record_held_stop(args.checkpoint_dir, group, outcome)
        return outcome


def _record_held_stop(root: str, group: RankGroup, outcome: Outcome) -> None:
    """Record the last stop signal delivered after the hold in ``root`` for ``resilience status``
    (the launcher got a signal: ``outcome.code`` is its exit code, see :func:`run`). Not on object
    storage (``s3://``, ``msc://``): the record is a local file, never a folder named after the URL."""
    if URL.match(root):
        _stderr_log(f"the stop signal delivered after the hold is not recorded: {root} is not a local directory")
        return
    try:
        path = write_record(root, group.delivered_after_hold[-1], outcome.codes, outcome.code)
    except OSError as error:
        _stderr_log(f"cannot record the held stop signal in {root}: {error}")
    else:
        _stderr_log(f"recorded the stop signal delivered after the hold in {path} (resilience status {root} shows it)")


def _exhausted(outcome: Outcome, restarts: int, max_restarts: int) -> int:
    """The exit code after a failed start with no restart left (see :func:`run`)."""
    if outcome.infrastructure or max_restarts > 0:
        code = int(ExitCode.PREEMPTED)
        why = f"no in-job restart left ({restarts} of {max_restarts} used)" if max_restarts else "no in-job restarts (--max-restarts 0)"
        _stderr_log(f"{outcome.fault}; {why}: ranks exited with {outcome.codes}; exit code {code} (requeue: the next start resumes from LATEST)")
        return code
    _stderr_log(f"{outcome.fault}; ranks exited with {outcome.codes}; exit code {outcome.code}")
    return outcome.code


def main(argv: Sequence[str] | None = None) -> int:
    """``resilience run`` on its own: parse ``argv`` (default ``sys.argv[1:]``) and :func:`run`."""
    parser = add_arguments(
        argparse.ArgumentParser(
            prog="resilience run",
            description="Start local ranks, forward signals to them, watch their progress, restart them, exit with their code.",
        )
    )
    return run(parser.parse_args(argv))
