"""Retention on 2 real gloo ranks: deletion runs after the save's last collective, in the
background, each rank deleting its own files; a kill mid-delete leaves only whole checkpoints
under checkpoint names, and the next run cleans up what it left."""

import os
import sys
import time
from pathlib import Path

import pytest

from resilience.checkpoint.layout import PRUNING_PREFIX
from resilience.checkpoint.storage.manifest import validate
from resilience.launch import launch

pytestmark = pytest.mark.multiproc
TINY = Path(__file__).resolve().parents[1] / "helpers" / "tiny_train.py"
KEEP_LAST = ["step_scheduler.ckpt_every_steps=10", "step_scheduler.max_steps=25", "checkpoint.max_recent_checkpoints=1"]  # saves at 10, 20, 25


def tiny(ckpt: Path, env: dict | None = None):
    cmd = [sys.executable, str(TINY), str(ckpt), *KEEP_LAST]
    return launch(cmd, 2, env={"OMP_NUM_THREADS": "1", **(env or {})}, failure_grace_s=30.0)


def wait_for(*paths: Path, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"never appeared: {[p.name for p in paths if not p.exists()]}"
        time.sleep(0.05)


def names(ckpt: Path) -> set[str]:
    return {p.name for p in ckpt.iterdir() if p.name.startswith(("epoch_", PRUNING_PREFIX))}


@pytest.mark.timeout(180)
def test_a_blocked_delete_does_not_hold_up_training_and_the_victims_end_deleted(tmp_path):
    ckpt, events = tmp_path / "ck", tmp_path / "events"
    events.mkdir()
    with tiny(ckpt, {"DELETE_EVENTS": str(events), "DELETE_MODE": "block"}) as group:
        # the delete after the save at step 20 blocks on both ranks; training runs on to the end
        wait_for(*(events / f"step_{r}_25" for r in range(2)))
        assert all((events / f"delete_started_{r}").exists() for r in range(2))
        assert not list(events.glob("deleted_*")), "no deletion finished: every save returned before its delete"
        assert f"{PRUNING_PREFIX}epoch_0_step_10" in names(ckpt)  # set aside at once, not under its name
        (events / "release").touch()
        assert group.wait(timeout=90) == 0
    assert names(ckpt) == {"epoch_0_step_25"}, names(ckpt)  # close waited for the deletes and removed the rest
    validate(ckpt / "epoch_0_step_25")


@pytest.mark.timeout(240)
def test_a_kill_mid_delete_leaves_whole_checkpoints_and_the_next_run_cleans_up(tmp_path):
    ckpt, events = tmp_path / "ck", tmp_path / "events"
    events.mkdir()
    with tiny(ckpt, {"DELETE_EVENTS": str(events), "DELETE_MODE": "kill"}) as group:
        assert group.wait(timeout=120) != 0  # rank 0 killed itself in the delete after the save at 20
    aside = ckpt / f"{PRUNING_PREFIX}epoch_0_step_10"
    assert aside.is_dir() and not (ckpt / "epoch_0_step_10").exists()
    # rank 1 deleted the files it wrote, rank 0 (killed first) not its own
    assert not list(aside.rglob("rank_00001*")), sorted(str(p.relative_to(aside)) for p in aside.rglob("*"))
    assert list(aside.rglob("rank_00000*"))
    for name in names(ckpt) - {aside.name}:
        validate(ckpt / name)  # every directory under a checkpoint name is whole
    assert os.readlink(ckpt / "LATEST") == "epoch_0_step_20"

    with tiny(ckpt) as group:  # resumes from step 20; its first save removes what the kill left
        assert group.wait(timeout=120) == 0
    assert names(ckpt) == {"epoch_0_step_25"}, names(ckpt)
