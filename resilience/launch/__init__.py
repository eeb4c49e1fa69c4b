"""Local multi-rank launcher (``resilience run``): start ranks, forward signals, combine codes.

Why not ``torchrun``: Slurm delivers the preemption warning (``#SBATCH --signal=B:USR1@300``)
to the batch shell, which must pass it on to the training ranks. torchrun's agent (torch
2.13.0) dies on SIGUSR1 (rc 138) and takes its workers with it; with
``--signals-to-handle=...,SIGUSR1`` it forwards, but then exits 1 even when every worker
exits 0. This launcher records SIGUSR1, SIGUSR2, SIGTERM (and the terminal's SIGINT,
SIGHUP, SIGQUIT), forwards each one to every live rank, waits for the ranks, and exits with
their combined code (:func:`combine_exit_codes`), so a rank's ``75`` (``ExitCode.PREEMPTED``)
reaches the batch script unchanged.

One module per piece: :mod:`~resilience.launch.start` (:func:`launch` and the ranks'
environment), :mod:`~resilience.launch.rank_group` (:class:`RankGroup`: waiting, the failure
grace, reaping), :mod:`~resilience.launch.exit_status` (:func:`combine_exit_codes`),
:mod:`~resilience.launch.ports` (``MASTER_PORT``), :mod:`~resilience.launch.ready_dirs` (the
handshake's temp directories, and removing those of killed launchers),
:mod:`~resilience.launch.forwarding` (the signals the launcher records and passes on),
:mod:`~resilience.launch.held_stops` (how long a stop signal waits for a rank that is not ready),
:mod:`~resilience.launch.watchdog` and :mod:`~resilience.launch.supervise` (the progress watchdog),
:mod:`~resilience.launch.node_faults` (the fault file several nodes' launchers share); the
``resilience run`` command itself is :mod:`resilience.cli.run`. None of them imports torch, so ``resilience run`` has its handlers
in place before a Slurm warning can arrive.
"""

from __future__ import annotations

from resilience.launch.exit_status import combine_exit_codes
from resilience.launch.forwarding import FORWARDED_SIGNALS, STOP_SIGNALS
from resilience.launch.ports import PORT_BASE, PORT_SPAN, resolve_master_port, slurm_master_port
from resilience.launch.rank_group import POLL_INTERVAL_S, Log, RankGroup
from resilience.launch.start import launch

__all__ = [
    "FORWARDED_SIGNALS",
    "POLL_INTERVAL_S",
    "PORT_BASE",
    "PORT_SPAN",
    "STOP_SIGNALS",
    "Log",
    "RankGroup",
    "combine_exit_codes",
    "launch",
    "resolve_master_port",
    "slurm_master_port",
]
