"""Filesystem faults during a save: a full disk, and a failure at each step of rank 0's work.

Every rank must raise the same error within one collective (no rank hangs), LATEST must stay
on the previous complete checkpoint, and a leftover staging directory is removed at the next
start. Real processes (2 ranks, gloo), a real size-limited tmpfs.
"""

import os
import sys
from pathlib import Path

import pytest

from resilience.checkpoint.storage.manifest import validate
from resilience.launch import launch

pytestmark = pytest.mark.multiproc
TINY = Path(__file__).resolve().parents[1] / "helpers" / "tiny_train.py"


def run_tiny(ckpt_dir, nproc=2, env=None, overrides=(), timeout=90):
    cmd = [sys.executable, str(TINY), str(ckpt_dir), *overrides]
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    if nproc == 1:
        env.update(RANK="0", WORLD_SIZE="1")
    with launch(cmd, nproc, env=env, failure_grace_s=30.0) as group:
        code = group.wait(timeout=timeout)
        codes = [p.returncode for p in group.procs]
    return codes, code


@pytest.fixture
def small_fs(tmpfs):
    """A 2 MiB tmpfs: one checkpoint of the tiny model fits, the next does not."""
    return tmpfs("small", "size=2m")


def _latest(ckpt):
    return os.readlink(ckpt / "LATEST")


@pytest.mark.timeout(120)
def test_disk_full_during_a_save_raises_on_every_rank_and_keeps_latest(small_fs, capfd):
    ckpt = small_fs / "ck"
    # the run fills the filesystem right after its first checkpoint: the second one cannot fit
    codes, _ = run_tiny(ckpt, overrides=["step_scheduler.ckpt_every_steps=10"], env={"FILL_AFTER_FIRST_SAVE": "1"})
    err = capfd.readouterr().err
    assert codes == [1, 1], (codes, err[-3000:])
    assert err.count("CheckpointSaveError") >= 2, "both ranks must raise the save error"
    assert "No space left on device" in err
    first = _latest(ckpt)
    validate(ckpt / first)

    # free space and run again: it resumes from the intact LATEST and removes any leftover staging
    (small_fs / "filler").unlink()
    codes, _ = run_tiny(ckpt, overrides=["step_scheduler.ckpt_every_steps=10"])
    assert codes == [0, 0]
    assert not list(ckpt.glob(".staging_*"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", ["staging", "parts", "manifest", "rename", "pointer", "after_publish"])
def test_a_rank0_only_failure_at_each_filesystem_step_raises_on_every_rank(tmp_path, capfd, phase):
    ckpt = tmp_path / "ck"
    codes, _ = run_tiny(
        ckpt,
        overrides=["step_scheduler.ckpt_every_steps=10"],
        env={"FAIL_PHASE": phase, "FAIL_RANK": "0", "FAIL_AT_SAVE": "2"},
    )
    err = capfd.readouterr().err
    assert codes == [1, 1], (codes, err[-3000:])
    assert err.count("CheckpointSaveError") >= 2, err[-3000:]
    assert f"injected failure at {phase} on rank 0" in err
    if phase == "after_publish":
        assert _latest(ckpt) == "epoch_0_step_20", "the checkpoint itself was published before the failure"
    else:
        assert _latest(ckpt) == "epoch_0_step_10", "LATEST must stay on the previous checkpoint"
    validate(ckpt / _latest(ckpt))
