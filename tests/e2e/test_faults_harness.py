"""The fault-injection harness (``bench/faults.py``) on a small sample: real forked ranks, real
SIGKILL, real files; it must report zero torn checkpoints and exact resumes, and its checker must
catch a checkpoint torn on purpose."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multiproc


def _counts(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^([a-zA-Z][^:\n]*): (.*)$", stdout, re.MULTILINE))


def _leading_int(text: str) -> int:
    return int(text.split()[0])


def _harness(tmp_path: Path, *argv: str, timeout: int = 230, script: str = "-m bench.faults") -> subprocess.CompletedProcess:
    """``python -m bench.faults ARGV --dir tmp_path`` (or the script form), its output captured."""
    return subprocess.run([sys.executable, *script.split(), *argv, "--dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _failure(proc: subprocess.CompletedProcess) -> str:
    return f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"


@pytest.mark.timeout(240)
def test_three_random_kills_leave_no_torn_checkpoint_and_every_resume_is_exact(tmp_path):
    proc = _harness(tmp_path, "--trials", "3", "--seed", "1")
    assert proc.returncode == 0, _failure(proc)
    counts = _counts(proc.stdout)
    assert counts["trials"] == "3" and counts["result"] == "PASS"
    assert counts["torn checkpoints"] == "0"
    assert counts["resumed exact"] == "3" and counts["resumed not exact"] == "0" and counts["resume failed"] == "0"
    outcomes = ("killed before first save", "killed during a save", "killed between saves", "killed after training", "finished before the kill")
    landed = sum(_leading_int(counts[k]) for k in outcomes)
    assert landed == 3, counts
    assert counts["modes"] == "sync 2, async 1"
    assert "reference (sync)" in proc.stderr and "two runs bitwise equal" in proc.stderr


@pytest.mark.timeout(240)
def test_the_checker_counts_a_checkpoint_torn_on_purpose_and_exits_non_zero(tmp_path):
    # the script form; --tear truncates a file of LATEST's checkpoint after the kill
    proc = _harness(tmp_path, "--trials", "1", "--kill-window", "0.9,0.95", "--tear", script="bench/faults.py")
    counts = _counts(proc.stdout)
    assert proc.returncode == 1, _failure(proc)
    assert counts["torn checkpoints"] == "1" and counts["result"] == "FAIL"
    assert re.search(r"^FAILURE trial 0: torn .*self-test tore .*(truncated|checksum)", proc.stdout, re.MULTILINE), proc.stdout
    # the resume falls back to the previous valid checkpoint and is still exact
    assert counts["resumed exact"] == "1"


def test_bad_arguments_name_the_option():
    proc = subprocess.run([sys.executable, "-m", "bench.faults", "--trials", "0"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--trials: must be >= 1" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "bench.faults", "--kill-window", "0.5"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--kill-window" in proc.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["safetensors"])  # the default; torch_save (DCP) under FSDP2: tests/e2e/test_sharded_e2e.py
def test_sigkill_of_a_rank_while_fsdp2_ranks_write_their_shards_leaves_the_previous_latest_valid(tmp_path, fmt):
    # FSDP2 over 2 ranks: each rank writes only its own shards; the kill lands in the second save's
    # "parts" phase (the ranks writing their files), so a previous LATEST exists and must survive.
    argv = ["--model", "fsdp2", "--model-save-format", fmt, "--modes", "sync", "--kill-at-phase", "parts", "--every", "10"]
    proc = _harness(tmp_path, "--trials", "2", "--seed", "3", *argv, timeout=280)
    assert proc.returncode == 0, _failure(proc)
    counts = _counts(proc.stdout)
    assert counts["model"] == f"fsdp2 ({fmt})"
    assert counts["killed during a save"] == "2 (parts 2)", counts
    assert counts["LATEST after the kill"] == "none 0, valid 2, torn 0"
    assert counts["torn checkpoints"] == "0" and counts["resumed exact"] == "2" and counts["result"] == "PASS"


@pytest.mark.timeout(240)
def test_kills_during_uploads_to_an_s3_endpoint_leave_no_torn_checkpoint_and_resume_exactly(tmp_path):
    # checkpoint_dir on moto's S3 server (started and stopped by the harness); each kill lands while a
    # rank uploads its files of the second save, sync then async: LATEST stays on the first save (or none)
    argv = ["--store", "s3", "--kill-at-phase", "upload", "--every", "10"]
    proc = _harness(tmp_path, "--trials", "2", "--seed", "1", *argv)
    assert proc.returncode == 0, _failure(proc)
    counts = _counts(proc.stdout)
    assert counts["store"] == "s3" and counts["modes"] == "sync 1, async 1"
    assert counts["killed during a save"] == "2 (upload 2)", counts
    assert counts["torn checkpoints"] == "0" and counts["resumed exact"] == "2" and counts["result"] == "PASS"
