"""The requeue-loop guard on the real local Slurm cluster: a job that keeps being stopped before
it can save anything new ends with NO_PROGRESS (76) instead of requeueing forever
(checkpoint.max_preemptions_without_progress: clean preemptions are bounded apart from failed starts)."""

import pytest

from resilience import ExitCode
from test_slurm_e2e import attempts, submit

pytestmark = pytest.mark.slurm


@pytest.mark.timeout(240)
def test_a_job_that_makes_no_progress_stops_requeueing_with_76(slurm_cluster, tmp_path):
    # Each attempt holds its launch for a few seconds; a signal then stops the ranks before their
    # first step (no checkpoint), the job requeues, and the next start trips the guard.
    job = submit(
        slurm_cluster,
        tmp_path / "guard",
        "checkpoint.max_preemptions_without_progress=1",
        "slurm.max_restarts=5",
        env={"RESILIENCE_TEST_PRELAUNCH_SLEEP": "5"},
    )
    job.wait_log(r"^resilience: trap installed", 90)
    job.scancel_usr1()
    info = job.wait_end(state="FAILED", timeout=200)
    log = job.log()
    assert info.get("ExitCode", "").startswith(f"{int(ExitCode.NO_PROGRESS)}:"), (info, log)
    assert info.get("Restarts") == "1", info
    assert len(attempts(log)) == 2, log
    assert "NO_PROGRESS" in log and "not requeued" in log
    assert not list(job.ckpt.glob("epoch_*")), "no attempt saved a checkpoint"
