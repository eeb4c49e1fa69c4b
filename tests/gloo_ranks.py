"""Run a test file's ``worker`` mode on N real gloo processes and collect each rank's JSON report.

The file, run as ``python FILE worker RANK PORT OUT``, joins a gloo group on 127.0.0.1:PORT and
writes its results to OUT; one start runs every scenario (one process-group start for all tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from resilience.launch import resolve_master_port

REPO = Path(__file__).resolve().parents[1]


def run_worker_ranks(script: str, world: int, tmp: Path, *, timeout: float, rank_env: Callable[[int], dict] | None = None) -> list[dict]:
    """Start ``script``'s worker mode on ``world`` ranks (``rank_env(rank)``: variables added for
    that rank) and return each rank's report, by rank; a rank that exits non-zero fails with its log."""
    port = resolve_master_port(None, {})  # a port free on this machine now
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, script, "worker", str(r), str(port), str(tmp / f"rank{r}.json")],
            env={**env, **(rank_env(r) if rank_env else {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for r, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {r} exited {proc.returncode}:\n{logs[r][-4000:]}"
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]
