"""Detection latency of ``resilience run``'s watchdog, per fault kind, against its configured limit.

``resilience run -n N --max-restarts 2 --progress-timeout T`` runs :mod:`bench.watchdog_worker`
(N = 2; ``--quick``: 1, half the start-up cost, which is most of this section's time), whose last
rank hangs inside a step, then SIGKILLs itself, then SIGSTOPs itself (each once, the ranks
restarting from ``LATEST`` in between; after the third fault no restart is left and the launcher
exits 75, which saves a fourth start of the ranks). The fault's time is what the rank wrote just
before it; the detection's is when the launcher's line saying so reached this process (``made no
progress`` for a hang or a stop, ``exited with signal SIGKILL`` for the kill); the recovery's is
its next line once the ranks are ended and reaped (stacks printed): ``restarting every local
rank`` or ``no in-job restart left``. One clock (``time.monotonic``) for every process of the
machine.

The limit a detection is judged against: ``T + 1 s`` for a hang and a stop (the watchdog counts
the silence from the rank's last report, at most ``progress.MIN_INTERVAL_S`` before the fault, and
reads the records every ``watchdog.CHECK_INTERVAL_S``), ``1 s`` for a kill (the launcher polls its
ranks every ``POLL_INTERVAL_S``; no timeout is involved).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import remove
from bench.ddp import rank_env
from resilience.exit_codes import ExitCode

KINDS = ("hang", "kill", "stop")
FAULTS = "hang@8,kill@17,stop@26"
KILL_LIMIT_S = 1.0
SLACK_S = 1.0
_DETECTED = {
    # any rank: the hung rank's peers wait for it in a collective, as silent as it is, and the
    # launcher names the one silent longest (the stacks it prints show which one hangs)
    "hang": r"watchdog: rank \d+ \(pid \d+\) made no progress for ([\d.]+) s",
    "kill": r"rank {rank} exited with signal SIGKILL",
    "stop": r"watchdog: rank {rank} \(pid \d+\) made no progress for ([\d.]+) s.*is stopped",
}
_ENDED = re.compile(r"restarting every local rank from LATEST \(in-job restart \d+ of|no in-job restart left")


def limit_s(kind: str, timeout_s: float) -> float:
    """The detection latency a fault of ``kind`` is judged against (see the module docstring)."""
    return KILL_LIMIT_S if kind == "kill" else timeout_s + SLACK_S


def one_run(work: Path, timeout_s: float, run_timeout_s: float, nproc: int = 2) -> dict[str, Any]:
    """One launcher run with the three faults; per kind the fault-to-detection and fault-to-recovery
    seconds (and, for a stall, the silence the launcher reported)."""
    root = work / "watchdog"
    remove(root)
    faults = root / "faults"
    faults.mkdir(parents=True)
    cmd = [sys.executable, "-m", "resilience", "run", "-n", str(nproc), "--max-restarts", "2", "--progress-timeout", f"{timeout_s:g}", "--kill-grace", "1"]
    cmd += ["-m", "bench.watchdog_worker", str(root / "ck"), str(faults)]
    env = {**os.environ, **rank_env(), "BENCH_FAULTS": FAULTS, "BENCH_FAULT_RANK": str(nproc - 1), "SLURM_JOB_ID": ""}
    detected_re = {kind: re.compile(pattern.format(rank=nproc - 1)) for kind, pattern in _DETECTED.items()}
    lines: list[tuple[float, str]] = []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=run_timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        raise RuntimeError(f"the watchdog run did not finish within {run_timeout_s:g} s") from None
    finally:
        reader.join(timeout=10)
    text = "".join(line for _, line in lines)
    if code != int(ExitCode.PREEMPTED):  # the third fault, with no restart left
        raise RuntimeError(f"the watchdog run exited {code}, not {int(ExitCode.PREEMPTED)}:\n{text[-3000:]}")
    restarts = [t for t, line in lines if _ENDED.search(line)]
    detected: dict[str, Any] = {}
    for index, kind in enumerate(KINDS):
        fault_at = float((faults / kind).read_text())
        found = next(((t, detected_re[kind].search(line)) for t, line in lines if t >= fault_at and detected_re[kind].search(line)), None)
        if found is None or index >= len(restarts):
            raise RuntimeError(f"the {kind} fault was not detected and its ranks ended:\n{text[-3000:]}")
        (seen_at, match), restart_at = found, restarts[index]
        detected[kind] = {
            "detect_s": seen_at - fault_at,
            "recover_s": restart_at - fault_at,
            "silence_s": float(match.group(1)) if match.groups() else None,
        }
    remove(root)
    return detected


def bench_watchdog(work: Path, *, timeout_s: float, trials: int, run_timeout_s: float, log: Callable[[str], None], nproc: int = 2) -> dict[str, Any]:
    """``trials`` runs of :func:`one_run` with ``nproc`` ranks: every trial's figures per kind,
    the progress timeout and the limits."""
    runs = []
    for trial in range(trials):
        got = one_run(work, timeout_s, run_timeout_s, nproc)
        runs.append(got)
        log(
            f"watchdog trial {trial + 1}/{trials} ({nproc} ranks, --progress-timeout {timeout_s:g} s): "
            + ", ".join(f"{kind} detected {row['detect_s']:.2f} s, ranks ended {row['recover_s']:.2f} s after the fault" for kind, row in got.items())
        )
    return {"timeout_s": timeout_s, "nproc": nproc, "limits_s": {kind: limit_s(kind, timeout_s) for kind in KINDS}, "trials": runs}
