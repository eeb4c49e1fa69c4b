"""``scancel --signal=TERM`` to a job step whose ranks have DataLoader workers, on the real local cluster.

The template with ``slurm.launcher: srun`` runs one task per rank in a job step; ``scancel
--signal=TERM J`` (no ``--batch``) makes slurmstepd signal every process of that step: both ranks
and each rank's 2 DataLoader workers (``tests/helpers/worker_train.py``, paused in step 3 until
the signal is in). The batch shell is not signalled. The ranks must agree on a step, save it,
exit 75; srun passes 75 to the batch script, which requeues the job; the second attempt resumes
from that checkpoint and ends bitwise equal to an uninterrupted local run.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

from resilience import cli
from runs import compare
from slurm_cluster import wait_for
from worker_runs import HELPER, TOTAL_STEPS, finish, launch_run, worker_env

pytestmark = pytest.mark.slurm
LINE_RE = re.compile(r"rank (\d+): exit (\d+), resumed from (\S+), stop step (\S+)")


@pytest.mark.timeout(300)
def test_scancel_signal_term_to_a_job_step_with_dataloader_workers_saves_requeues_and_resumes_exactly(slurm_cluster, tmp_path):
    ckpt, events = tmp_path / "ck", tmp_path / "events"
    events.mkdir()
    config = tmp_path / "job.yaml"
    config.write_text(
        "slurm:\n"
        f"  script: {HELPER}\n"
        f"  script_args: [{ckpt}, {events}]\n"
        f"  python: {sys.executable}\n"
        "  nproc_per_node: 2\n"
        "  cpus_per_task: 1\n"
        "  launcher: srun\n"
        "  time: '10'\n"
        "  signal_lead_s: 60\n"
        f"  output: {tmp_path}/out-%j.txt\n"
    )
    script = tmp_path / "job.sub"
    assert cli.main(["template", "slurm", str(config), "-o", str(script)]) == 0
    env = {**slurm_cluster.env, "LOADER": "plain", "NUM_WORKERS": "2", "PERSISTENT": "1", "PAUSE_AT_STEP": "3", "OMP_NUM_THREADS": "1"}
    # The uninterrupted local run trains while the job waits to start, for its release and for
    # its requeue (~6 s), not after it.
    reference = tmp_path / "reference"
    (reference / "events").mkdir(parents=True)
    uninterrupted = launch_run(reference / "ck", reference / "events", worker_env("plain", True), reference / "events" / "pids")
    try:
        _job_runs(slurm_cluster, script, tmp_path, env, ckpt, events)
    except BaseException:
        os.killpg(uninterrupted.pid, signal.SIGKILL)  # its own session: the ranks and workers too
        uninterrupted.communicate()
        raise
    code, out = finish(uninterrupted)
    assert code == 0, out
    result = compare(ckpt, reference / "ck")
    assert result.identical and result.steps == TOTAL_STEPS, result.detail


def _job_runs(slurm_cluster, script, tmp_path, env, ckpt, events) -> None:
    """Submit the job, stop it with TERM to its step in step 3, and check that it saved, requeued,
    resumed from that step and finished."""
    job = slurm_cluster.sbatch(script, cwd=tmp_path, env=env)

    def log() -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(tmp_path.glob("out-*.txt")))

    try:
        wait_for(lambda: all((events / f"paused_{r}").exists() for r in (0, 1)), 120, "ranks paused in step 3", log)
        assert len(list(events.glob("worker_*"))) == 4, log()
        slurm_cluster.run(["scancel", "--signal=TERM", job])  # the job's steps: ranks and workers, not the batch shell
        time.sleep(1.0)
        (events / "release").touch()
        info = slurm_cluster.wait_state(job, "COMPLETED", timeout=200)
    except BaseException:
        slurm_cluster.run(["scancel", job], check=False)
        raise
    text = log()
    assert "killed by signal" not in text, text
    runs_ = LINE_RE.findall(text)
    first = [r for r in runs_ if r[1] == "75"]
    second = [r for r in runs_ if r[1] == "0"]
    assert sorted(int(r[0]) for r in first) == [0, 1] and len({r[3] for r in first}) == 1, text
    stop_step = int(first[0][3])
    assert 3 <= stop_step < TOTAL_STEPS // 2, text
    # The second attempt resumed from the checkpoint of the agreed step (it was published).
    assert sorted(int(r[0]) for r in second) == [0, 1] and {r[2] for r in second} == {f"epoch_0_step_{stop_step}"}, text
    assert info["Restarts"] == "1", info
    assert "training done; exit 0" in text
