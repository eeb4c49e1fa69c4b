"""``MASTER_PORT``: derived from the Slurm job inside Slurm, else a free local port."""

from __future__ import annotations

import socket
from collections.abc import Mapping

from resilience.env_names import SLURM

#: Derived ports lie in ``[PORT_BASE, PORT_BASE + PORT_SPAN)``. Part of it overlaps Linux's
#: default ephemeral range (32768-60999), where an outgoing connection may hold the port: the
#: rendezvous then fails to bind, the run fails, and the next restart gets the next port.
PORT_BASE = 20000
PORT_SPAN = 40000
_PORTS_PER_JOB = 10
_JOB_ID, _RESTART_COUNT = SLURM["job_id"][0], SLURM["restart_count"][0]


def slurm_master_port(job_id: str | int, restart_count: str | int | None = None) -> int:
    """Rendezvous port for one run of a Slurm job: the same on every node, new on each restart.

    ``port = 20000 + (job_id mod 4000) * 10 + (restart_count mod 10)``, always in
    ``20000..59999``. Every node of a job computes the same value from ``SLURM_JOB_ID`` and
    ``SLURM_RESTART_COUNT`` (unset on a job's first run: ``None`` or ``""`` counts as 0), so no
    port exchange is needed. Consecutive job ids get blocks 10 ports apart, so jobs sharing a
    node do not collide unless their ids differ by a multiple of 4000. The restart count moves
    the port because a requeued job restarts on the same node seconds later, while the old
    rendezvous socket may still linger.

    Raises ``ValueError`` naming ``SLURM_JOB_ID``/``SLURM_RESTART_COUNT`` when either is not a
    non-negative integer.
    """
    job = _non_negative_int(_JOB_ID, job_id)
    restart = 0 if restart_count in (None, "") else _non_negative_int(_RESTART_COUNT, restart_count)
    blocks = PORT_SPAN // _PORTS_PER_JOB
    return PORT_BASE + (job % blocks) * _PORTS_PER_JOB + restart % _PORTS_PER_JOB


def _non_negative_int(name: str, value: str | int) -> int:
    # Plain ASCII digits only: int() would also take "1_000" or " 12".
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def _free_port() -> int:
    """A port the kernel reports free right now (it can be taken before a rank binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def resolve_master_port(master_port: int | None, env: Mapping[str, str], nnodes: int = 1) -> int:
    """Pick ``MASTER_PORT``: the given one, else Slurm-derived, else a free local port.

    - ``master_port`` given: used as is (``1..65535``, else ``ValueError``).
    - ``SLURM_JOB_ID`` in ``env``: :func:`slurm_master_port` of it and ``SLURM_RESTART_COUNT``.
    - otherwise, one node: a port that is free on this machine now.
    - otherwise (several nodes outside Slurm): ``ValueError``, since the nodes could not
      agree on a free port; pass ``master_port``.
    """
    if master_port is not None:
        if isinstance(master_port, bool) or not isinstance(master_port, int) or not (1 <= master_port <= 65535):
            raise ValueError(f"master_port must be an int in 1..65535, got {master_port!r}")
        return master_port
    if env.get(_JOB_ID):
        return slurm_master_port(env[_JOB_ID], env.get(_RESTART_COUNT))
    if nnodes > 1:
        raise ValueError("master_port is required when nnodes > 1 outside Slurm (no SLURM_JOB_ID to derive it from): every node must use the same port")
    return _free_port()
