"""End to end on the digits example: real ranks, real signals, real kill -9, bitwise comparison."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from resilience import ExitCode
from resilience.checkpoint.storage.manifest import all_files, validate
from resilience.launch import launch
from runs import CONFIG, compare, final_weights, latest_name, run

pytestmark = pytest.mark.multiproc
SHORT = ["step_scheduler.num_epochs=3", "step_scheduler.ckpt_every_steps=20"]  # 22 steps per epoch, 66 in all
KILL_SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "kill_at_phase.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs with 1 and 2 ranks, shared by the tests below."""
    out = {}
    for nproc in (1, 2):
        path = tmp_path_factory.mktemp(f"reference{nproc}")
        assert run(path, nproc, overrides=SHORT).codes == [ExitCode.DONE] * nproc
        out[nproc] = path
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc,signal_rank", [(1, 0), (2, 0), (2, 1)])
def test_signal_on_one_rank_stops_all_at_one_step_and_resume_is_bitwise_exact(tmp_path, reference, nproc, signal_rank):
    first = run(tmp_path, nproc, overrides=SHORT, signal_rank=signal_rank, signal_at_step=30)
    assert first.codes == [ExitCode.PREEMPTED] * nproc
    saved = latest_name(tmp_path)
    manifest = validate(tmp_path / saved)
    stop_step = manifest["meta"]["global_step"]
    assert 30 <= stop_step < 66 and manifest["meta"]["reason"] == "preemption"
    assert stop_step % 22 != 0, "the stop should land mid-epoch"
    # every rank contributed its RNG and data position to that one step's checkpoint
    assert {f"rank_state/rank_{r:05d}.safetensors" for r in range(nproc)} <= set(all_files(tmp_path / saved, manifest))

    second = run(tmp_path, nproc, overrides=SHORT)
    assert second.codes == [ExitCode.DONE] * nproc
    result = compare(tmp_path, reference[nproc])
    assert result.identical, result.detail
    assert result.steps == 66


def _run_killed(ckpt_dir, nproc, phase, kill_rank, *, at_save=2, overrides=()):
    cmd = [sys.executable, str(KILL_SCRIPT), "--config", str(CONFIG), f"checkpoint.checkpoint_dir={ckpt_dir}", *SHORT, *overrides]
    env = {"KILL_PHASE": phase, "KILL_AT_SAVE": str(at_save), "KILL_RANK": str(kill_rank), "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        env.update(RANK="0", WORLD_SIZE="1")
    with launch(cmd, nproc, env=env, failure_grace_s=5.0, kill_grace_s=2.0) as group:
        group.wait(timeout=120)
        return [proc.returncode for proc in group.procs]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "nproc,phase",
    [(1, "parts"), (1, "manifest"), (1, "rename"), (2, "parts"), (2, "pointer")],
)
def test_sigkill_during_a_save_leaves_latest_on_the_previous_checkpoint_and_resume_is_exact(tmp_path, reference, nproc, phase):
    codes = _run_killed(tmp_path, nproc, phase, kill_rank=0)
    assert codes[0] == -signal.SIGKILL
    assert latest_name(tmp_path) == "epoch_0_step_20", "LATEST must not move before the second save is published"
    validate(tmp_path / "epoch_0_step_20")
    rows = [json.loads(line) for line in (tmp_path / "training.jsonl").read_text().splitlines()]
    assert rows[-1]["global_step"] == 40, "the run died in the save after step 40"

    again = run(tmp_path, nproc, overrides=SHORT)
    assert again.codes == [ExitCode.DONE] * nproc
    assert not list(tmp_path.glob(".staging_*")), "the leftover staging directory is removed at the next start"
    result = compare(tmp_path, reference[nproc])
    assert result.identical, result.detail


@pytest.mark.timeout(240)
def test_on_msc_a_run_preempted_through_one_rank_resumes_bitwise(tmp_path, reference, msc_posix):
    # checkpoint_dir on multi-storage-client (its POSIX profile): the same run as on S3, without the kill
    from object_stores import MSC_PROFILE, latest, object_final_weights, orphans

    url = f"msc://{MSC_PROFILE}/digits"
    local = tmp_path / "local"
    on_msc = [f"checkpoint.checkpoint_dir={url}", f"checkpoint.local_dir={local}"]
    first = run(local, 2, overrides=[*SHORT, *on_msc], signal_rank=1, signal_at_step=30)
    assert first.codes == [ExitCode.PREEMPTED] * 2
    assert 30 <= int(latest(url).rsplit("_", 1)[1]) < 40
    second = run(local, 2, overrides=[*SHORT, *on_msc])
    assert second.codes == [ExitCode.DONE] * 2 and orphans(url) == []
    result = compare(local, reference[2], weights=lambda d: object_final_weights(url) if d == local else final_weights(d))
    assert result.identical, result.detail
    assert result.steps == 66


@pytest.mark.timeout(300)
def test_on_s3_a_run_preempted_then_killed_mid_upload_resumes_bitwise_and_the_cli_reads_the_bucket(tmp_path, reference, s3_endpoint):
    # checkpoint_dir on the local S3 endpoint (moto); the logs, staging and downloads in local_dir
    from object_stores import latest, object_final_weights, orphans

    url = f"s3://{s3_endpoint.bucket()}/digits"
    local = tmp_path / "local"
    on_s3 = [f"checkpoint.checkpoint_dir={url}", f"checkpoint.local_dir={local}"]
    first = run(local, 2, overrides=[*SHORT, *on_s3], signal_rank=1, signal_at_step=30)
    assert first.codes == [ExitCode.PREEMPTED] * 2
    stopped = latest(url)
    assert 30 <= int(stopped.rsplit("_", 1)[1]) < 40
    # kill -9 of rank 0 as the first save after the resume (step 40) starts uploading
    codes = _run_killed(url, 2, "upload", kill_rank=0, at_save=1, overrides=[f"checkpoint.local_dir={local}"])
    assert codes[0] == -signal.SIGKILL
    assert latest(url) == stopped, "LATEST must not move before the save is committed"
    assert not [k for k in orphans(url) if not k.startswith("epoch_1_step_40/")], "only the killed save's objects are orphans"

    second = run(local, 2, overrides=[*SHORT, *on_s3])
    assert second.codes == [ExitCode.DONE] * 2
    assert orphans(url) == [], "the killed save's objects are removed at the next start"
    result = compare(local, reference[2], weights=lambda d: object_final_weights(url) if d == local else final_weights(d))
    assert result.identical, result.detail
    assert result.steps == 66

    # resilience status and verify read the bucket
    status = subprocess.run([sys.executable, "-m", "resilience", "status", url, "--json", "--deep"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    assert doc["resume"]["checkpoint"] == latest(url) == "epoch_2_step_66" and doc["pointers"]["LATEST"]["form"] == "object"
    states = {e["name"]: e["state"] for e in doc["checkpoints"]}
    assert states[stopped] == states["epoch_2_step_66"] == "complete" and "epoch_1_step_40" in states  # committed at the rerun
    assert {e["name"]: e["model_format"] for e in doc["checkpoints"]}["epoch_2_step_66"] == "safetensors"
    verify = subprocess.run([sys.executable, "-m", "resilience", "verify", url, "--json", "--no-progress"], capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert json.loads(verify.stdout)["ok"] and len(json.loads(verify.stdout)["checkpoints"]) == len(states)
