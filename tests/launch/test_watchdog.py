"""``resilience run``'s progress watchdog and in-job restarts, with real ranks and real faults.

Two ranks of ``helpers/tiny_train.py`` (40 steps, a checkpoint every 5) under ``resilience run``:
a rank that sleeps forever inside a step, one that SIGKILLs itself and one that SIGSTOPs itself are
detected, the ranks restart from LATEST and finish with the weights of an uninterrupted run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from resilience.checkpoint.layout import LATEST, MODEL_DIR, MODEL_SHARD_GLOB
from resilience.exit_codes import ExitCode

TINY = Path(__file__).resolve().parents[1] / "helpers" / "tiny_train.py"
HANG_LINE = next(number for number, line in enumerate(TINY.read_text().splitlines(), 1) if "time.sleep(3600)" in line)
TIMEOUT_S = 6  # --progress-timeout: well above a tiny step's time even on a loaded machine
KILL_GRACE_S = 1
EVERY_5 = "step_scheduler.ckpt_every_steps=5"


def run(ckpt: Path, *launcher_args: str, env: dict | None = None, overrides: tuple[str, ...] = (), timeout: float = 240) -> tuple[int, str, float]:
    """``resilience run -n 2 ... tiny_train.py ckpt`` to its end: (exit code, its output, seconds)."""
    cmd = [sys.executable, "-m", "resilience", "run", "-n", "2", "--kill-grace", str(KILL_GRACE_S), *launcher_args, str(TINY), str(ckpt), EVERY_5, *overrides]
    started = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "", **(env or {})}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        stderr, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:  # a failed test must not leave its launcher or ranks behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, stderr, time.monotonic() - started


def final_weights(ckpt: Path) -> dict:
    """The tensors of LATEST's model shards, by name."""
    tensors = {}
    for shard in sorted((ckpt / LATEST / MODEL_DIR).glob(MODEL_SHARD_GLOB)):
        tensors.update(load_file(shard))
    assert tensors, f"no model shard under {ckpt / LATEST / MODEL_DIR}"
    return tensors


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape and bool((a[name] == b[name]).all()), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    ckpt = tmp_path_factory.mktemp("uninterrupted") / "ck"
    code, stderr, _ = run(ckpt)
    assert code == 0, stderr
    return final_weights(ckpt)


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_a_hang_a_sigkill_and_a_sigstop_each_restart_in_job_from_latest_and_finish_exactly(tmp_path, uninterrupted):
    ckpt = tmp_path / "ck"
    env = {"FAULTS": "hang@8,kill@17,stop@26", "FAULT_RANK": "1", "FAULT_DIR": str(tmp_path)}
    code, stderr, _ = run(ckpt, "--max-restarts", "3", "--progress-timeout", str(TIMEOUT_S), env=env)
    assert code == 0, stderr
    assert {p.name for p in tmp_path.glob("fault_*")} == {"fault_hang", "fault_kill", "fault_stop"}
    restarts = re.findall(r"resilience run: (.*); restarting every local rank from LATEST \(in-job restart (\d) of 3\)", stderr)
    assert [number for _, number in restarts] == ["1", "2", "3"], stderr
    hang, kill, stop = (why for why, _ in restarts)
    for stall in (hang, stop):  # detected right after the timeout (printed to 0.1 s)
        assert TIMEOUT_S <= float(re.search(r"made no progress for ([\d.]+) s", stall).group(1)) < TIMEOUT_S + 2, stall
    assert "rank 1 exited with signal SIGKILL" in kill, kill
    assert "rank 1" in stop and "is stopped" in stop, stop
    # the hung rank's stacks name the line it was stuck in
    assert f'tiny_train.py", line {HANG_LINE} in fault' in stderr, stderr
    assert "its Python stacks follow" in stderr
    # each restart resumed LATEST (the stopped rank runs for a moment to print its stacks: its group
    # may pass another checkpoint before it is stopped again and ended)
    resumed = [int(step) for step in re.findall(r"rank 0: resumed from epoch_0_step_(\d+)", stderr)]
    assert resumed[:2] == [5, 15] and len(resumed) == 3 and resumed[2] >= 25, resumed
    assert_bitwise_equal(final_weights(ckpt), uninterrupted)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_without_restarts_a_hang_exits_75_within_the_timeout_and_the_next_start_resumes_exactly(tmp_path, uninterrupted):
    ckpt = tmp_path / "ck"
    env = {"FAULTS": "hang@12", "FAULT_RANK": "0", "FAULT_DIR": str(tmp_path)}
    code, stderr, seconds = run(ckpt, "--progress-timeout", str(TIMEOUT_S), env=env)
    assert code == ExitCode.PREEMPTED, stderr
    assert "no in-job restarts (--max-restarts 0)" in stderr and "exit code 75" in stderr, stderr
    assert f'tiny_train.py", line {HANG_LINE} in fault' in stderr, stderr
    silent = float(re.search(r"rank \d \(pid \d+\) made no progress for ([\d.]+) s", stderr).group(1))
    assert TIMEOUT_S <= silent < TIMEOUT_S + 2, stderr  # detected right after the timeout (printed to 0.1 s)
    assert seconds < 90, f"{seconds:.1f} s: start-up, 12 steps, the timeout, the dumps and the kill grace"
    assert os.readlink(ckpt / LATEST) == "epoch_0_step_10"

    code, stderr, _ = run(ckpt, env=env)  # the requeued start
    assert code == 0, stderr
    assert "rank 0: resumed from epoch_0_step_10" in stderr
    assert_bitwise_equal(final_weights(ckpt), uninterrupted)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_crash_at_the_same_step_on_every_start_ends_with_76_after_the_no_progress_limit(tmp_path):
    ckpt = tmp_path / "ck"
    env = {"RAISE_AT_STEP": "8", "RAISE_RANK": "1"}
    code, stderr, _ = run(ckpt, "--max-restarts", "5", "--progress-timeout", str(TIMEOUT_S), env=env, overrides=("checkpoint.max_restarts_without_progress=1",))
    assert code == ExitCode.NO_PROGRESS, stderr
    assert not ExitCode(code).requeue
    assert stderr.count("restarting every local rank from LATEST") == 2, stderr  # 3 starts from scratch, 5, 5
    assert "rank 1 exited with code 1" in stderr
    assert "the ranks exited 76 (NO_PROGRESS) after 2 in-job restart(s)" in stderr, stderr
    assert "checkpoint.max_restarts_without_progress" in stderr
