"""The ``resilience run`` command: options, then start the ranks and forward signals until they exit."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from resilience.env_names import PID_FILE_ENV
from resilience.exit_codes import ExitCode
from resilience.launch.forwarding import FORWARDED_SIGNALS, RecordedSignals, forward
from resilience.launch.rank_group import POLL_INTERVAL_S
from resilience.launch.start import launch

HELP = "start N local ranks (torchrun-like), forward USR1/USR2/TERM/INT to them and exit with their combined code"


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
    line per signal to stderr, waits for the ranks and returns :func:`combine_exit_codes` of
    their codes. Returns ``ExitCode.CONFIG_ERROR`` (2) for bad arguments or a program that
    cannot be started. Handlers are restored before returning.
    """
    pid_file = args.pid_file or os.environ.get(PID_FILE_ENV)
    cmd = _rank_command(args)
    with RecordedSignals(FORWARDED_SIGNALS) as recorded:
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
            code = None
            while code is None:
                for signum in recorded.take(POLL_INTERVAL_S):
                    forward(group, signum, _stderr_log)
                code = group.poll()
        codes = [proc.returncode for proc in group.procs]
    _stderr_log(f"ranks exited with {codes}; exit code {code}")
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """``resilience run`` on its own: parse ``argv`` (default ``sys.argv[1:]``) and :func:`run`."""
    parser = add_arguments(
        argparse.ArgumentParser(
            prog="resilience run",
            description="Start local ranks, forward signals to them, exit with their code.",
        )
    )
    return run(parser.parse_args(argv))
