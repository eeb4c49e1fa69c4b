"""The local Slurm cluster from slurm/ behaves like the real thing the library relies on.

Each test drives real daemons with real jobs: signal delivery to the batch shell, self-requeue with
a restart count, two-node placement, partition preemption, sacct without slurmdbd, clean teardown.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slurm_cluster import (  # noqa: E402
    SlurmCluster,
    cluster_or_skip,
    pid_alive,
    slurm_cluster,
    slurm_cluster_2nodes,
)

__all__ = ["slurm_cluster", "slurm_cluster_2nodes"]  # fixtures, used by name below

pytestmark = pytest.mark.slurm

# A batch shell that traps USR1 without forking (a fork in a trap can lose signals), says when
# the trap is installed (USR1 kills an untrapped shell), and waits for its worker with `&` +
# `wait` so the trap runs at once instead of after the foreground command.
TRAP_SCRIPT = r"""#!/bin/bash
d=$1
got=0
trap 'got=1; echo "usr1 $EPOCHREALTIME" >> "$d/trap"' USR1
sleep 120 &
worker=$!
echo "$worker" > "$d/worker.pid"
echo "$EPOCHREALTIME" > "$d/ready"
while [ "$got" -eq 0 ] && kill -0 "$worker" 2>/dev/null; do wait "$worker"; done
kill "$worker" 2>/dev/null
wait "$worker" 2>/dev/null
echo "exiting got=$got" >> "$d/trap"
[ "$got" -eq 1 ] && exit 0
exit 9
"""

REQUEUE_SCRIPT = r"""#!/bin/bash
d=$1
echo "start restart=${SLURM_RESTART_COUNT:-unset}"
if [ -z "${SLURM_RESTART_COUNT:-}" ]; then
    sleep 120 &
    echo $! > "$d/first_run_worker.pid"
    scontrol requeue "$SLURM_JOB_ID" || { echo "requeue failed"; exit 3; }
    wait          # Slurm kills this first run
    echo "first run survived its requeue"
    exit 4
fi
echo "end restart=$SLURM_RESTART_COUNT"
"""


def _write_script(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    p.chmod(0o755)
    return p


def _wait_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} not written within {timeout} s")
        time.sleep(0.05)


def _read_pid(path: Path) -> int:
    _wait_file(path, 10)
    for _ in range(50):  # the file may exist a moment before its content
        text = path.read_text().strip()
        if text:
            return int(text)
        time.sleep(0.02)
    raise AssertionError(f"{path} stayed empty")


def _wait_dead(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.timeout(120)
def test_scancel_batch_usr1_reaches_the_batch_shell_trap(slurm_cluster: SlurmCluster, tmp_path):
    script = _write_script(tmp_path, "trap.sh", TRAP_SCRIPT)
    # The job also asks for the time-limit warning as real jobs do; with --time=5 it would come
    # only after ~4 minutes, so the USR1 seen here is scancel's.
    job = slurm_cluster.sbatch(
        script,
        "--time=5",
        "--signal=B:USR1@10",
        "-o",
        str(tmp_path / "out"),
        script_args=[str(tmp_path)],
    )
    slurm_cluster.wait_state(job, "RUNNING", timeout=20)
    _wait_file(tmp_path / "ready", 20)
    worker = _read_pid(tmp_path / "worker.pid")

    sent = time.time()
    slurm_cluster.run(["scancel", "--batch", "--signal=USR1", job])
    info = slurm_cluster.wait_state(job, "COMPLETED", timeout=20)

    trap_lines = (tmp_path / "trap").read_text().splitlines()
    assert trap_lines[0].startswith("usr1 "), trap_lines
    assert trap_lines[-1] == "exiting got=1", trap_lines
    assert float(trap_lines[0].split()[1]) - sent < 5, "USR1 took over 5 s to reach the trap"
    assert info["ExitCode"] == "0:0", info
    assert _wait_dead(worker, 5), f"worker {worker} outlived its job"


@pytest.mark.timeout(120)
def test_self_requeue_restarts_job_with_restart_count_and_appended_output(slurm_cluster: SlurmCluster, tmp_path):
    script = _write_script(tmp_path, "requeue.sh", REQUEUE_SCRIPT)
    out = tmp_path / "out"
    job = slurm_cluster.sbatch(script, "--requeue", "--open-mode=append", "-o", str(out), script_args=[str(tmp_path)])
    # cred_expire=5 makes the requeued job eligible after ~6 s instead of ~121 s.
    info = slurm_cluster.wait_state(job, "COMPLETED", timeout=45)

    assert info["Restarts"] == "1", info
    # slurmstepd appends its own "CANCELLED ... DUE TO JOB REQUEUE" line; the job's lines are these.
    lines = [x for x in out.read_text().splitlines() if not x.startswith("slurmstepd")]
    assert lines == [
        "start restart=unset",
        "start restart=1",
        "end restart=1",
    ]
    worker = _read_pid(tmp_path / "first_run_worker.pid")
    assert _wait_dead(worker, 5), f"first run's worker {worker} outlived the requeue"


@pytest.mark.timeout(120)
def test_sacct_on_path_reports_finished_job_without_slurmdbd(slurm_cluster: SlurmCluster, tmp_path):
    script = _write_script(tmp_path, "true.sh", "#!/bin/bash\ntrue\n")
    job = slurm_cluster.sbatch(script, "-o", str(tmp_path / "out"))
    slurm_cluster.wait_state(job, "COMPLETED", timeout=20)
    # submitit's call: plain `sacct`, which the wrapper first on PATH turns into --completion.
    proc = slurm_cluster.run(["sacct", "-o", "JobID,State", "--parsable2", "-j", job])
    assert f"{job}|COMPLETED" in proc.stdout.splitlines(), proc.stdout


@pytest.mark.timeout(120)
def test_high_partition_job_preempts_debug_job_with_its_own_signal(slurm_cluster: SlurmCluster, tmp_path):
    script = _write_script(tmp_path, "trap.sh", TRAP_SCRIPT)
    short = _write_script(tmp_path, "short.sh", "#!/bin/bash\nsleep 1\n")
    # Both jobs take all 8 advertised CPUs, so the high job can only run by preempting.
    low = slurm_cluster.sbatch(
        script,
        "-p",
        "debug",
        "-c",
        "8",
        "--time=5",
        "--signal=B:USR1@10",
        "-o",
        str(tmp_path / "low.out"),
        script_args=[str(tmp_path)],
    )
    try:
        slurm_cluster.wait_state(low, "RUNNING", timeout=20)
        _wait_file(tmp_path / "ready", 20)
        submitted = time.time()
        high = slurm_cluster.sbatch(short, "-p", "high", "-c", "8", "-o", str(tmp_path / "high.out"))
        _wait_file(tmp_path / "trap", 10)
        first = (tmp_path / "trap").read_text().splitlines()[0]
        assert first.startswith("usr1 "), first
        assert float(first.split()[1]) - submitted < 5, "preemption signal took over 5 s"
        slurm_cluster.wait_state(high, "COMPLETED", timeout=30)
    finally:
        slurm_cluster.run(["scancel", low], check=False)


@pytest.mark.timeout(120)
def test_two_node_job_runs_one_task_per_node_on_two_live_slurmds(slurm_cluster_2nodes: SlurmCluster, tmp_path):
    c = slurm_cluster_2nodes
    assert c.nodes == ["n1", "n2"]
    script = _write_script(
        tmp_path,
        "two.sh",
        "#!/bin/bash\nsrun bash -c 'echo \"$SLURM_PROCID $SLURM_NODEID $SLURMD_NODENAME\"'\n",
    )
    out = tmp_path / "out"
    job = c.sbatch(script, "-N", "2", "--ntasks-per-node=1", "-o", str(out))
    info = c.wait_state(job, "COMPLETED", timeout=30)

    rows = sorted(line.split() for line in out.read_text().splitlines())
    assert rows == [["0", "0", "n1"], ["1", "1", "n2"]], rows
    assert info["NumNodes"] == "2", info
    pids = c.daemon_pids()
    slurmds = [pids["slurmd-n1"], pids["slurmd-n2"]]
    assert slurmds[0] != slurmds[1]
    # With a port clash the second slurmd dies while sinfo still shows its node idle.
    assert all(pid_alive(p) for p in slurmds), pids


@pytest.mark.timeout(120)
def test_down_leaves_no_daemon_or_job_process_alive(tmp_path):
    cluster = cluster_or_skip(1)
    try:
        script = _write_script(tmp_path, "trap.sh", TRAP_SCRIPT)
        job = cluster.sbatch(script, "-o", str(tmp_path / "out"), script_args=[str(tmp_path)])
        cluster.wait_state(job, "RUNNING", timeout=20)
        worker = _read_pid(tmp_path / "worker.pid")
        pids = cluster.daemon_pids()
        assert set(pids) == {"munged", "slurmctld", "slurmd-localhost"}, pids
        assert all(pid_alive(p) for p in pids.values()), pids
    finally:
        cluster.stop()

    alive = {name: p for name, p in pids.items() if pid_alive(p)}
    assert not alive, f"daemons alive after down.sh: {alive}"
    assert not pid_alive(worker), f"job worker {worker} alive after down.sh"
    assert not cluster.dir.exists()
