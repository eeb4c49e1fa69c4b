"""Launch ``helpers/worker_train.py`` (2 ranks, DataLoader workers) under ``resilience run`` and wait for it.

Shared by the DataLoader-worker tests run directly (tests/launch/) and under Slurm (tests/slurm/).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HELPER = Path(__file__).resolve().parent / "helpers" / "worker_train.py"
TOTAL_STEPS = 20  # the steps of a whole worker_train.py run


def worker_env(loader: str, persistent: bool, **extra: str) -> dict:
    """The environment of a run: ``loader`` (worker_train.py's LOADER), 2 workers, persistent or not."""
    return {
        **os.environ,
        "LOADER": loader,
        "NUM_WORKERS": "2",
        "PERSISTENT": "1" if persistent else "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def launch_run(ckpt: Path, events: Path, env: dict, pid_file: Path) -> subprocess.Popen:
    """Start ``resilience run -n 2`` of the helper in a session of its own; stdout and stderr together."""
    cmd = [sys.executable, "-m", "resilience", "run", "-n", "2", "--pid-file", str(pid_file), str(HELPER), str(ckpt), str(events)]
    # A session of its own: the test can signal the process group like slurmstepd does.
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    """Wait for ``proc``: (exit code, output); after ``timeout`` s, kill its group and fail."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"the run did not finish in {timeout} s:\n{out}") from None
    return proc.returncode, out


def run_to_end(ckpt: Path, events: Path, env: dict) -> tuple[int, str]:
    """A run left alone until it exits: (exit code, output)."""
    events.mkdir(parents=True)
    return finish(launch_run(ckpt, events, env, events / "pids"))


def signal_while_paused(proc: subprocess.Popen, events: Path, *, rank: int | None = 1, sig: int = signal.SIGUSR1, timeout: float = 90) -> tuple[int, str]:
    """For a ``resilience run -n 2 --pid-file EVENTS/pids`` start whose ranks pause at a step
    (``EVENTS/paused_<r>``, until ``EVENTS/release``): once both wait there, send ``sig`` to rank
    ``rank`` (``None``: to ``resilience run`` itself), let them go on, then :func:`finish` it. The
    process group is killed if anything fails on the way."""
    try:
        deadline = time.monotonic() + timeout
        while not all((events / f"paused_{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, finish(proc)[1]
            time.sleep(0.02)
        ranks = dict(line.split()[1:] for line in (events / "pids").read_text().splitlines() if line.startswith("rank "))
        os.kill(proc.pid if rank is None else int(ranks[str(rank)]), sig)
        time.sleep(0.3)  # the signal is in (and forwarded) before the ranks go on
        (events / "release").touch()
        return finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
