"""Retention (NeMo ``max_recent_checkpoints``, MindSpore ``save_max``): a recent window by step,
pointer targets kept in addition, only ``epoch_<E>_step_<S>`` directories removed, nothing
removed before the new checkpoint is published, and ``save_max`` touching only this run's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from resilience.checkpoint import Checkpointer, CheckpointSaveError, TrainingState, writer
from resilience.checkpoint.layout import LATEST, LOWEST_VAL, PRUNING_PREFIX
from resilience.checkpoint.policy.retention import plan_prune, prune
from resilience.checkpoint.storage.manifest import validate
from resilience.checkpoint.storage.pointers import read_pointer
from resilience.config import CheckpointConfig, ConfigError, config_from_dict
from resilience.distributed import DistContext
from resilience.state.step_scheduler import StepScheduler
from tiny_runs import train_linear

pytestmark = pytest.mark.usefixtures("no_launcher_environment")

BATCHES = [torch.full((2, 2), float(i)) for i in range(12)]


def run(root: Path, max_steps: int, *, checkpoint: dict | None = None, val: dict[int, float] | None = None) -> None:
    """A real single-process run: Linear + SGD, a checkpoint every step, validation at ``val`` steps."""
    cfg = {
        "step_scheduler": {"max_steps": max_steps, "ckpt_every_steps": 1},
        "checkpoint": {"checkpoint_dir": str(root), **(checkpoint or {})},
    }
    train_linear(cfg, BATCHES, val=val)


def checkpoint_dirs(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.name.startswith("epoch_")}


def test_seed_example_keeps_exactly_the_two_newest_plus_the_lowest_val_target(tmp_path):
    root = tmp_path / "ck"
    run(root, 6, checkpoint={"max_recent_checkpoints": 2}, val={1: 0.9, 2: 0.1, 3: 0.5, 4: 0.6, 5: 0.7, 6: 0.8})
    assert read_pointer(root, LOWEST_VAL) == root / "epoch_0_step_2"  # older than the window
    assert read_pointer(root, LATEST) == root / "epoch_0_step_6"
    assert checkpoint_dirs(root) == {"epoch_0_step_5", "epoch_0_step_6", "epoch_0_step_2"}
    for name in checkpoint_dirs(root):
        validate(root / name)  # what is kept is whole
    assert not [p for p in root.iterdir() if p.name.startswith((PRUNING_PREFIX, ".staging_", ".trash_"))]


def test_null_keeps_every_checkpoint(tmp_path):
    root = tmp_path / "ck"
    run(root, 5)
    assert checkpoint_dirs(root) == {f"epoch_0_step_{s}" for s in range(1, 6)}


def test_other_symlinks_and_txt_pointers_protect_their_targets_and_other_entries_are_untouched(tmp_path):
    root = tmp_path / "ck"
    run(root, 3)
    os.symlink("epoch_0_step_1/model", root / "best_model")  # a link *into* a checkpoint protects it
    (root / "pinned.txt").write_text("epoch_0_step_2\n")  # a LATEST.txt-style pointer file
    (root / "notes").mkdir()
    (root / "epoch_0_step_3_backup").mkdir()  # not an epoch_<E>_step_<S> name
    (root / "epoch_0_step_99.tar").write_bytes(b"x")
    (root / "training_summary.txt").write_text("this file names no checkpoint\n")
    (root / f"{PRUNING_PREFIX}epoch_0_step_0").mkdir()  # left by an interrupted prune

    run(root, 6, checkpoint={"max_recent_checkpoints": 1})  # resumes at step 3, saves 4, 5, 6

    assert checkpoint_dirs(root) >= {"epoch_0_step_6", "epoch_0_step_1", "epoch_0_step_2"}
    assert {"epoch_0_step_3", "epoch_0_step_4", "epoch_0_step_5"}.isdisjoint(checkpoint_dirs(root))
    for name in ("notes", "epoch_0_step_3_backup", "epoch_0_step_99.tar", "training_summary.txt", "pinned.txt"):
        assert (root / name).exists(), name
    assert (root / "best_model").resolve() == (root / "epoch_0_step_1" / "model").resolve()
    assert not (root / f"{PRUNING_PREFIX}epoch_0_step_0").exists()


def make_state() -> TrainingState:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return TrainingState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def at(ck: Checkpointer, step: int) -> Checkpointer:
    """``ck`` with its registered scheduler advanced to ``step`` (as training does)."""
    ck.scheduler.load_state_dict({"epoch": 0, "batches_in_epoch": step, "global_step": step})
    return ck


@pytest.mark.parametrize("phase", ["parts", "manifest", "rename", "pointer"])
def test_a_failed_save_prunes_nothing(tmp_path, phase):
    root = tmp_path / "ck"
    ck = Checkpointer(
        CheckpointConfig(checkpoint_dir=str(root), max_recent_checkpoints=2), DistContext(), state=make_state(), scheduler=StepScheduler(num_epochs=1)
    )
    at(ck, 1).save()
    at(ck, 2).save()

    def fail(name: str) -> None:
        if name == phase:
            raise OSError(28, "No space left on device")

    writer.fault_hook = fail
    try:
        with pytest.raises(CheckpointSaveError):
            at(ck, 3).save()
    finally:
        writer.fault_hook = None
    assert {"epoch_0_step_1", "epoch_0_step_2"} <= checkpoint_dirs(root)  # step 1 would leave the window
    assert read_pointer(root, LATEST) == root / "epoch_0_step_2"


def test_pruning_starts_only_once_latest_names_the_new_checkpoint(tmp_path):
    root = tmp_path / "ck"
    ck = Checkpointer(
        CheckpointConfig(checkpoint_dir=str(root), max_recent_checkpoints=1), DistContext(), state=make_state(), scheduler=StepScheduler(num_epochs=1)
    )
    at(ck, 1).save()
    seen = {}

    def observe(name: str) -> None:
        if name == "after_publish":
            seen["latest"] = read_pointer(root, LATEST)
            seen["old_still_there"] = (root / "epoch_0_step_1").is_dir()

    writer.fault_hook = observe
    try:
        at(ck, 2).save()
    finally:
        writer.fault_hook = None
    assert seen == {"latest": root / "epoch_0_step_2", "old_still_there": True}
    assert checkpoint_dirs(root) == {"epoch_0_step_2"}


def test_save_max_removes_only_checkpoints_of_the_current_run(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    monkeypatch.setenv("RESILIENCE_RUN_ID", "run-a")
    run(root, 3)
    monkeypatch.setenv("RESILIENCE_RUN_ID", "run-b")  # another job resumes run a's checkpoints
    run(root, 7, checkpoint={"save_max": 2})  # saves 4, 5, 6, 7
    assert checkpoint_dirs(root) == {"epoch_0_step_1", "epoch_0_step_2", "epoch_0_step_3", "epoch_0_step_6", "epoch_0_step_7"}
    # max_recent_checkpoints, by contrast, counts every checkpoint whoever saved it
    run(root, 8, checkpoint={"max_recent_checkpoints": 2})
    assert checkpoint_dirs(root) == {"epoch_0_step_7", "epoch_0_step_8"}


def test_plan_orders_by_step_not_by_name_or_time(tmp_path):
    root = tmp_path / "ck"
    for name in ("epoch_0_step_9", "epoch_1_step_10", "epoch_0_step_2"):
        (root / name).mkdir(parents=True)
    os.utime(root / "epoch_0_step_2", (4e9, 4e9))  # newest mtime, oldest step
    assert [p.name for p in plan_prune(root, 1)] == ["epoch_0_step_2", "epoch_0_step_9"]
    assert [p.name for p in prune(root, 1)] == ["epoch_0_step_2", "epoch_0_step_9"]
    assert checkpoint_dirs(root) == {"epoch_1_step_10"}


@pytest.mark.parametrize("url", ["gs://bucket/ck", "hdfs://nn/ck", "az://container/ck"])
@pytest.mark.parametrize("key", ["max_recent_checkpoints", "save_max"])
def test_remote_checkpoint_dir_without_a_backend_is_a_config_error_with_or_without_retention(url, key):
    with pytest.raises(ConfigError, match=r"checkpoint\.checkpoint_dir=.*URLs are not supported"):
        config_from_dict({"checkpoint": {"checkpoint_dir": url, key: 3}})
    with pytest.raises(ConfigError, match=r"checkpoint\.checkpoint_dir=.*URLs are not supported"):
        config_from_dict({"checkpoint": {"checkpoint_dir": url}})


@pytest.mark.parametrize("url", ["s3://bucket/ck", "msc://profile/ck"])
def test_retention_is_accepted_on_object_storage_unlike_nemo_on_msc(url):
    # retention on a bucket itself: tests/checkpoint/test_object_store.py
    assert config_from_dict({"checkpoint": {"checkpoint_dir": url, "max_recent_checkpoints": 3}}).checkpoint.max_recent_checkpoints == 3


@pytest.mark.parametrize("value", [0, -1, True, "2", 1.5])
def test_retention_window_must_be_a_positive_integer(value):
    with pytest.raises(ConfigError, match="max_recent_checkpoints"):
        config_from_dict({"checkpoint": {"max_recent_checkpoints": value}})


def test_max_recent_checkpoints_and_save_max_together_is_an_error():
    with pytest.raises(ConfigError, match="max_recent_checkpoints and checkpoint.save_max"):
        config_from_dict({"checkpoint": {"max_recent_checkpoints": 2, "save_max": 2}})
