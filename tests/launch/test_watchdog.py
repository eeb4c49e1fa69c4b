"""``resilience run``'s progress watchdog and in-job restarts, with real ranks and real faults.

Two ranks of ``helpers/tiny_train.py`` (40 steps, a checkpoint every 5) under ``resilience run``:
a rank that sleeps forever inside a step, one that SIGKILLs itself and one that SIGSTOPs itself are
detected, the ranks restart from LATEST and finish with the weights of an uninterrupted run.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import socket
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
    return run_launchers(ckpt, [["-n", "2", *launcher_args]], env=env, overrides=overrides, timeout=timeout)[0]


def run_launchers(
    ckpt: Path, launchers: list[list[str]], *, env: dict | None = None, overrides: tuple[str, ...] = (), timeout: float = 240
) -> list[tuple[int, str, float]]:
    """One ``resilience run <args> tiny_train.py ckpt`` per entry of ``launchers``, all at once, to
    their end: (exit code, its output, seconds from the start to its exit) per launcher."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "", **(env or {})}
    started = time.monotonic()
    procs, logs, ended = [], [], {}
    for index, args in enumerate(launchers):
        logs.append(ckpt.parent / f"launcher{index}-{int(started * 1000)}.log")
        cmd = [sys.executable, "-m", "resilience", "run", "--kill-grace", str(KILL_GRACE_S), *args, str(TINY), str(ckpt), EVERY_5, *overrides]
        with open(logs[-1], "w") as out:
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        while len(ended) < len(procs) and time.monotonic() - started < timeout:
            for index, proc in enumerate(procs):
                if index not in ended and proc.poll() is not None:
                    ended[index] = time.monotonic() - started
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:  # a failed test must not leave its launcher or ranks behind
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return [(proc.returncode, log.read_text(), ended.get(index, timeout)) for index, (proc, log) in enumerate(zip(procs, logs))]


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
def uninterrupted(tmp_path_factory):
    """``uninterrupted()``: the final weights of a fault-free run. The run starts in a thread when
    the first test asks for it and trains while that test's ranks sit out their stalls (~12 s of
    --progress-timeout), instead of ~5 s before it."""
    ckpt = tmp_path_factory.mktemp("uninterrupted") / "ck"
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(run, ckpt)

        def weights() -> dict:
            code, stderr, _ = future.result(timeout=240)
            assert code == 0, stderr
            return final_weights(ckpt)

        yield weights


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
    assert_bitwise_equal(final_weights(ckpt), uninterrupted())


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
    assert_bitwise_equal(final_weights(ckpt), uninterrupted())


SHORT_S = 4  # --progress-timeout of the tests of how the job is judged: cheap, far above a tiny step


def silence(text: str) -> float:
    """The seconds of the watchdog's first "made no progress for S s" in ``text``."""
    return float(re.search(r"made no progress for ([\d.]+) s", text).group(1))


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_a_rank_evaluating_alone_for_3x_the_timeout_keeps_its_waiting_peer_alive_and_a_later_hang_is_still_caught(tmp_path):
    """Rank 0 evaluates alone in step 12 for 3x --progress-timeout, calling loop.heartbeat(), while
    rank 1 waits in the next all-reduce: waiting, not hung, so training goes on (LATEST reaches step
    20). Rank 0's hang in step 23 (rank 1 waits in the next all-reduce again) is caught right after
    the timeout."""
    ckpt = tmp_path / "ck"
    env = {"FAULTS": "eval@12,hang@23", "FAULT_RANK": "0", "FAULT_DIR": str(tmp_path), "EVAL_S": str(3 * SHORT_S)}
    code, out, _ = run(ckpt, "--progress-timeout", str(SHORT_S), env=env)
    assert code == ExitCode.PREEMPTED, out
    assert {p.name for p in tmp_path.glob("fault_*")} == {"fault_eval", "fault_hang"}
    assert out.count("resilience run: watchdog:") == 1 and SHORT_S <= silence(out) < SHORT_S + 2, out
    assert f'tiny_train.py", line {HANG_LINE} in fault' in out, out
    assert os.readlink(ckpt / LATEST) == "epoch_0_step_20", out


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_a_rank_conditional_all_reduce_in_the_first_step_after_an_in_job_restart_is_caught_within_the_timeout(tmp_path):
    """After a kill in step 6 the ranks resume epoch_0_step_5, and rank 1 calls an all-reduce rank 0
    never joins in step 6 again: every rank ends up stuck in a collective. It is caught right after
    --progress-timeout, not after the start-up limit (600 s) that the resume's record asked for until
    a step report replaced it (steps of a few ms were reported only 0.5 s after it)."""
    ckpt = tmp_path / "ck"
    env = {"FAULTS": "kill@6,collective@6", "FAULT_RANK": "1", "FAULT_DIR": str(tmp_path)}
    code, out, _ = run(ckpt, "--max-restarts", "1", "--progress-timeout", str(SHORT_S), env=env, timeout=150)
    assert code == ExitCode.PREEMPTED, out
    assert "rank 1 exited with signal SIGKILL; restarting every local rank from LATEST (in-job restart 1 of 1)" in out, out
    stall = re.search(r"resilience run: (.*); no in-job restart left", out)
    assert stall is not None and SHORT_S <= silence(stall.group(1)) < SHORT_S + 2, out
    assert 'tiny_train.py", line' in out and " in fault" in out and "all_reduce" in out, out  # rank 1's stack
    assert "rank 0: resumed from epoch_0_step_5" in out and os.readlink(ckpt / LATEST) == "epoch_0_step_5", out


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


def two_nodes(ckpt: Path, *launcher_args: str, env: dict | None = None, attempt: int = 0) -> list[tuple[int, str, float]]:
    """Two launchers of one rank each, as the two nodes of one job sharing a fault file, a new one
    per attempt (as the multi-node Slurm template starts them): (exit code, output, seconds) per node."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    shared = ["-n", "1", "--nnodes", "2", "--master-port", port, "--fault-file", str(ckpt.parent / f"{attempt}.faults"), *launcher_args]
    return run_launchers(ckpt, [["--node-rank", str(node), *shared] for node in (0, 1)], env=env)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_two_nodes_a_rank_killed_on_the_second_node_restarts_both_nodes_together_and_finishes_exactly(tmp_path, uninterrupted):
    ckpt = tmp_path / "ck"
    env = {"FAULTS": "kill@12", "FAULT_RANK": "1", "FAULT_DIR": str(tmp_path)}
    (code0, log0, _), (code1, log1, _) = two_nodes(ckpt, "--max-restarts", "1", env=env)
    assert (code0, code1) == (0, 0), log0 + log1
    assert "rank 1 exited with signal SIGKILL; restarting every local rank from LATEST (in-job restart 1 of 1)" in log1, log1
    assert "told the other nodes' launchers" in log1
    # node 0's rank is ended by node 1's record, or fails in its next collective first: either way it restarts too
    assert "restarting every local rank from LATEST (in-job restart 1 of 1)" in log0, log0
    assert "rank 0: resumed from epoch_0_step_10" in log0
    assert_bitwise_equal(final_weights(ckpt), uninterrupted())


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_two_nodes_without_restarts_a_kill_on_one_node_ends_both_launchers_with_75_at_once_and_the_next_start_resumes_exactly(tmp_path, uninterrupted):
    ckpt = tmp_path / "ck"
    env = {"FAULTS": "kill@12", "FAULT_RANK": "1", "FAULT_DIR": str(tmp_path)}
    (code0, log0, seconds0), (code1, log1, seconds1) = two_nodes(ckpt, env=env)
    assert (code0, code1) == (ExitCode.PREEMPTED, ExitCode.PREEMPTED), log0 + log1
    assert "rank 1 exited with signal SIGKILL" in log1 and "exit code 75" in log1, log1
    # node 0 ends within moments, not after a collective timeout (120 s and more here): its rank is
    # ended by node 1's record, or fails in its next collective and the kill on node 1 counts as the cause
    assert "node 1's launcher: rank 1 exited with signal SIGKILL" in log0 and "exit code 75" in log0, log0
    assert abs(seconds0 - seconds1) < 10, (seconds0, seconds1)
    assert os.readlink(ckpt / LATEST) == "epoch_0_step_10"

    (code0, log0, _), (code1, _, _) = two_nodes(ckpt, attempt=1)  # the requeued job
    assert (code0, code1) == (0, 0), log0
    assert "rank 0: resumed from epoch_0_step_10" in log0
    assert_bitwise_equal(final_weights(ckpt), uninterrupted())


@pytest.mark.timeout(120)
def test_a_stop_signal_after_the_training_loop_ended_is_not_sent_and_the_job_ends_done(tmp_path):
    """SIGUSR1 reaches the launcher while both ranks work after their finished loop (the loop has
    put the default handlers back, so the signal would kill them: exit 138, a finished job counted
    as failed): the launcher sends it to no rank, their work completes, and the job exits 0."""
    ckpt, after = tmp_path / "ck", tmp_path / "after"
    after.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "", "AFTER_LOOP_DIR": str(after), "AFTER_LOOP_S": "1.5"}
    cmd = [sys.executable, "-m", "resilience", "run", "-n", "2", str(TINY), str(ckpt), EVERY_5, "step_scheduler.max_steps=10"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not all((after / f"started_{rank}").exists() for rank in (0, 1)) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == ExitCode.DONE, out
    assert "have finished their training loop: SIGUSR1 not sent to them" in out, out
    assert all((after / f"finished_{rank}").exists() for rank in (0, 1)), out
