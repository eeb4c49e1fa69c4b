""":func:`launch`: start one node's ranks with the environment ``torch.distributed`` expects.

Each rank gets the environment variables that ``torch.distributed`` (``env://``) and torchrun
users expect:

=========================  ==========================================================
variable                   value
=========================  ==========================================================
``RANK``                   ``node_rank * nproc_per_node + local_rank``
``LOCAL_RANK``             index of the rank on this node, ``0 .. nproc_per_node-1``
``WORLD_SIZE``             ``nnodes * nproc_per_node``
``LOCAL_WORLD_SIZE``       ``nproc_per_node``
``GROUP_RANK``             ``node_rank`` (torchrun's name)
``MASTER_ADDR``            ``master_addr`` (default ``127.0.0.1``)
``MASTER_PORT``            see :func:`resolve_master_port`
``RESILIENCE_LAUNCHER_PID``  the launcher's pid
``RESILIENCE_PROGRESS_FILE``  where the rank reports its progress (:mod:`resilience.progress`)
``RESILIENCE_RESTART_COUNT``  ``restart_count``: in-job restarts before this start
``RESILIENCE_COLLECTIVE_TIMEOUT_S``  ``collective_timeout_s``, when given
=========================  ==========================================================

Ranks stay in the launcher's process group (no ``setsid``), so a terminal's Ctrl-C and
Slurm's process tracking treat them like any child; the launcher still forwards signals
itself because Slurm's ``B:`` signals and ``scancel --batch`` reach the batch shell only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from resilience.env_names import COLLECTIVE_TIMEOUT_ENV, LAUNCHER_PID_ENV, PROGRESS_FILE_ENV, READY_DIR_ENV, RESTART_COUNT_ENV, STOP_FILE_ENV, TORCH
from resilience.launch.held_stops import DEFAULT_HOLD_TIMEOUT_S
from resilience.launch.ports import resolve_master_port
from resilience.launch.rank_group import Log, RankGroup
from resilience.launch.ready_dirs import make_ready_dir
from resilience.progress import progress_file


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def launch(
    cmd: Sequence[str],
    nproc_per_node: int,
    *,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    env: Mapping[str, str] | None = None,
    node_rank: int = 0,
    nnodes: int = 1,
    failure_grace_s: float = 30.0,
    kill_grace_s: float = 5.0,
    log: Log | None = None,
    restart_count: int = 0,
    collective_timeout_s: float | None = None,
    hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S,
) -> RankGroup:
    """Start ``nproc_per_node`` processes running ``cmd``, one per local rank.

    Args:
        cmd: the full command, e.g. ``[sys.executable, "train.py", "--lr", "0.1"]``.
        nproc_per_node: ranks on this node (``>= 1``).
        master_addr: ``MASTER_ADDR`` for every rank (the rendezvous host).
        master_port: ``MASTER_PORT``; ``None`` picks one with :func:`resolve_master_port`.
        env: variables added to (overriding) ``os.environ`` for every rank; the per-rank
            variables of the module docstring are set last and win.
        node_rank: this node's index, ``0 .. nnodes-1``.
        nnodes: number of nodes, each running its own launcher.
        failure_grace_s: see :class:`RankGroup` (seconds).
        kill_grace_s: see :class:`RankGroup` (seconds).
        log: called with one line per notable event (failure grace, kills); default silent.
        restart_count: in-job restarts before this start (``RESILIENCE_RESTART_COUNT``, >= 0).
        collective_timeout_s: the ranks' ``RESILIENCE_COLLECTIVE_TIMEOUT_S`` (seconds > 0); not
            set when ``None``.
        hold_timeout_s: see :class:`RankGroup` (seconds >= 0; ``inf`` holds a stop signal until
            the rank is ready, however long).

    Ranks inherit stdin/stdout/stderr and the launcher's process group. Returns the
    :class:`RankGroup`; use it as a context manager so no rank outlives the caller. A rank that
    runs :func:`~resilience.resilient_loop` is also SIGKILLed by the kernel when the thread that
    called this ends (:mod:`resilience.parent_death`): call it from a thread that outlives the ranks.

    Raises:
        ValueError: a bad argument (named in the message), or no way to pick a port.
        OSError: ``cmd[0]`` cannot be executed; ranks already started are killed first.
    """
    if isinstance(cmd, (str, bytes)) or not cmd or not all(isinstance(a, str) for a in cmd):
        raise ValueError(f"cmd must be a non-empty list of str, got {cmd!r}")
    _check_int("nproc_per_node", nproc_per_node, 1)
    _check_int("nnodes", nnodes, 1)
    _check_int("node_rank", node_rank, 0)
    if node_rank >= nnodes:
        raise ValueError(f"node_rank must be in 0..nnodes-1 = 0..{nnodes - 1}, got {node_rank}")
    failure_grace_s = _check_seconds("failure_grace_s", failure_grace_s)
    kill_grace_s = _check_seconds("kill_grace_s", kill_grace_s)
    hold_timeout_s = _check_seconds("hold_timeout_s", hold_timeout_s)
    _check_int("restart_count", restart_count, 0)
    if collective_timeout_s is not None and not _check_seconds("collective_timeout_s", collective_timeout_s) > 0:
        raise ValueError(f"collective_timeout_s must be a number of seconds > 0, got {collective_timeout_s!r}")

    base = dict(os.environ)
    base.update(env or {})
    port = resolve_master_port(master_port, base, nnodes)
    ranks = [node_rank * nproc_per_node + local for local in range(nproc_per_node)]
    # Handshake files (resilience.stop.handshake): a batch script's stop file wins over our own.
    ready_dir = make_ready_dir()  # also removes those of launchers that were killed
    stop_file = base.get(STOP_FILE_ENV) or os.path.join(ready_dir, "stop")
    procs: list[subprocess.Popen] = []
    try:
        for local, rank in enumerate(ranks):
            rank_env = dict(base)
            rank_env.update(
                {
                    TORCH["rank"]: str(rank),
                    TORCH["local_rank"]: str(local),
                    TORCH["world_size"]: str(nnodes * nproc_per_node),
                    TORCH["local_world_size"]: str(nproc_per_node),
                    TORCH["group_rank"]: str(node_rank),
                    TORCH["master_addr"]: master_addr,
                    TORCH["master_port"]: str(port),
                    LAUNCHER_PID_ENV: str(os.getpid()),
                }
            )
            rank_env[READY_DIR_ENV] = ready_dir
            rank_env[STOP_FILE_ENV] = stop_file
            rank_env[PROGRESS_FILE_ENV] = progress_file(ready_dir, rank)
            rank_env[RESTART_COUNT_ENV] = str(restart_count)
            if collective_timeout_s is not None:
                rank_env[COLLECTIVE_TIMEOUT_ENV] = f"{collective_timeout_s:g}"
            procs.append(subprocess.Popen(list(cmd), env=rank_env))
    except BaseException:
        for proc in procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(ready_dir, ignore_errors=True)
        raise
    return RankGroup(
        procs,
        ranks,
        cmd,
        failure_grace_s=failure_grace_s,
        kill_grace_s=kill_grace_s,
        log=log,
        ready_dir=ready_dir,
        stop_file=stop_file,
        hold_timeout_s=hold_timeout_s,
    )
