"""resilience.checkpoint, single process: round trip, on-disk layout, atomic publish, validated
resume with fallback, pointer safety. Real files throughout; faults are real filesystem damage or
the writer's own ``fault_hook``."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from resilience.checkpoint import (
    CheckpointCorrupted,
    Checkpointer,
    CheckpointInvalid,
    CheckpointNotFound,
    CheckpointSaveError,
    TrainingState,
    writer,
)
from resilience.checkpoint.formats.model_io import model_file
from resilience.checkpoint.layout import BAD_MARKER, LATEST, MANIFEST, OPTIM_DIR, optim_shard_name, rank_manifest_file, rank_state_file
from resilience.checkpoint.storage.durable import DIGEST, file_digest
from resilience.checkpoint.storage.manifest import all_files, validate
from resilience.checkpoint.storage.pointers import read_pointer, write_pointer
from resilience.config import CheckpointConfig, ConfigError
from resilience.distributed import DistContext
from resilience.state.step_scheduler import StepScheduler

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torchdata's set_vital deprecation

PHASES = ["staging", "parts", "manifest", "rename", "pointer"]


class Counter:
    """A user object checkpointed through ``TrainingState.extra``."""

    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def make_state(seed: int, train_steps: int = 2) -> TrainingState:
    """A tiny MLP + AdamW + LambdaLR + StatefulDataLoader, trained ``train_steps`` steps."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.99))
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.5**epoch)
    data = TensorDataset(torch.arange(40, dtype=torch.float32).reshape(10, 4))
    loader = StatefulDataLoader(data, batch_size=2)
    batches = iter(loader)
    for _ in range(train_steps):
        (x,) = next(batches)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        lr_scheduler.step()
    return TrainingState(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, dataloader=loader, extra={"counter": Counter(seed)})


def scheduler_at(step: int, epoch: int = 0) -> StepScheduler:
    return StepScheduler(num_epochs=3, epoch=epoch, batches_in_epoch=step, global_step=step)


def checkpointer(root: Path, state: TrainingState | None = None, scheduler: StepScheduler | None = None, **overrides) -> Checkpointer:
    """A checkpointer of ``state`` (default: ``make_state(seed=1)``) at ``scheduler`` (default: step 0)."""
    return Checkpointer(
        CheckpointConfig(checkpoint_dir=str(root), **overrides),
        DistContext(),
        state=state if state is not None else make_state(seed=1),
        scheduler=scheduler or scheduler_at(0),
    )


def save_at(ck: Checkpointer, step: int, reason: str = "periodic") -> Path | None:
    """Advance the registered scheduler to ``step`` (as training does), then save."""
    ck.scheduler.load_state_dict(scheduler_at(step).state_dict())
    return ck.save(reason)


def save_steps(root: Path, *steps: int) -> Checkpointer:
    """Save one checkpoint per step (same state object); LATEST ends at the last one."""
    ck = checkpointer(root)
    for step in steps:
        assert save_at(ck, step) == root / f"epoch_0_step_{step}"
    return ck


def latest_name(root: Path) -> str:
    return read_pointer(root, LATEST).name


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture
def no_fault_hook():
    yield
    writer.fault_hook = None


# -- round trip ------------------------------------------------------------------------------


def test_round_trip_restores_model_optimizer_schedulers_data_position_and_rng(root):
    saved = make_state(seed=1)
    saved_sched = scheduler_at(2)
    ck = checkpointer(root, saved, saved_sched)
    directory = ck.save("periodic")
    # What the RNG streams give right after the save...
    expected_draws = (torch.rand(3), random.random(), np.random.rand(2))
    expected_next_batch = saved.dataloader.dataset.tensors[0][4:6]  # two batches of 2 were drawn

    fresh = make_state(seed=2, train_steps=3)  # different weights, optimizer state, LR and counter
    assert not torch.equal(fresh.model[0].weight, saved.model[0].weight)
    assert ck.find_resume_point() == directory
    restored = ck.load(directory, fresh)

    for (name, a), (_, b) in zip(saved.model.state_dict().items(), fresh.model.state_dict().items()):
        assert torch.equal(a, b), name
    want, got = saved.optimizer.state_dict(), fresh.optimizer.state_dict()
    assert got["param_groups"] == want["param_groups"]  # includes betas as a tuple, lr, initial_lr
    assert got["state"].keys() == want["state"].keys()
    for index, entries in want["state"].items():
        assert set(entries) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in entries.items():
            assert torch.equal(got["state"][index][key], value), (index, key)
    assert fresh.lr_scheduler.state_dict() == saved.lr_scheduler.state_dict()
    assert fresh.extra["counter"].value == 1
    assert restored.step_scheduler == saved_sched.state_dict()
    assert restored.meta["global_step"] == 2 and restored.meta["world_size"] == 1 and restored.meta["reason"] == "periodic"
    assert ck.last_saved_step == 2

    # Data position: a fresh loader given the saved state continues where the saved one was.
    assert restored.data_position["batches_in_epoch"] == 2
    fresh.dataloader.load_state_dict(restored.data_position["loader"])
    assert torch.equal(next(iter(fresh.dataloader))[0], expected_next_batch)

    # RNG: applied separately (the loop does it at the point the save captured it).
    torch.rand(5), random.random(), np.random.rand(7)  # move every stream on
    Checkpointer.restore_rng(restored)
    draws = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(draws[0], expected_draws[0])
    assert draws[1] == expected_draws[1]
    assert np.array_equal(draws[2], expected_draws[2])


def test_shuffled_stateful_dataloader_resumes_the_same_remaining_batches(root):
    """Its state holds the sampler's generator state (a tensor): stored as JSON, not pickled."""
    torch.manual_seed(0)
    loader = StatefulDataLoader(TensorDataset(torch.arange(20.0)), batch_size=2, shuffle=True)
    batches = iter(loader)
    next(batches)
    next(batches)
    state = TrainingState(model=torch.nn.Linear(1, 1), dataloader=loader)
    saved = checkpointer(root, state, StepScheduler(num_epochs=1, batches_in_epoch=2, global_step=2)).save()
    expected = [b[0].tolist() for b in batches]

    fresh = StatefulDataLoader(TensorDataset(torch.arange(20.0)), batch_size=2, shuffle=True)
    restored = checkpointer(root).load(saved, TrainingState(model=torch.nn.Linear(1, 1), dataloader=fresh))
    from resilience.state.data_position import resume_iterator

    assert [b[0].tolist() for b in resume_iterator(fresh, restored.data_position)] == expected


def test_checkpoint_named_after_epoch_of_the_step_after_an_epoch_ends(root):
    state = TrainingState(model=torch.nn.Linear(2, 2))
    # After the last batch of epoch 1 the scheduler already points at epoch 2, batch 0.
    sched = StepScheduler(num_epochs=5, epoch=2, batches_in_epoch=0, global_step=10)
    assert checkpointer(root, state, sched).save().name == "epoch_1_step_10"


def test_load_refuses_a_checkpoint_of_another_world_size(root):
    ck = save_steps(root, 2)
    directory = root / "epoch_0_step_2"
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["meta"]["world_size"] = 4
    (directory / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="world size 4"):
        ck.load(directory, make_state(seed=3))


def test_disabled_checkpointing_writes_and_resumes_nothing(root):
    save_steps(root, 2)
    ck = checkpointer(root, enabled=False)
    assert save_at(ck, 4) is None
    assert not (root / "epoch_0_step_4").exists()
    assert ck.find_resume_point() is None


def test_no_checkpoint_means_fresh_start(root):
    assert checkpointer(root).find_resume_point() is None
    root.mkdir()
    assert checkpointer(root).find_resume_point() is None


def test_a_checkpointer_over_a_module_without_state_only_finds_resume_points(root):
    """A placeholder model (nothing to save, as the bench's resume-point finder uses) is not refused
    at construction: DCP's get_model_state_dict raises for an empty model, outside a process group."""
    save_steps(root, 2)
    finder = Checkpointer(
        CheckpointConfig(checkpoint_dir=str(root)), DistContext(), state=TrainingState(model=torch.nn.Identity()), scheduler=StepScheduler(num_epochs=1)
    )
    assert finder.find_resume_point().name == "epoch_0_step_2"


def test_restore_without_a_registered_state_says_so_instead_of_failing_inside_the_load(root):
    """A trainer integration's checkpointer (state=None) finds resume points; restore() refuses with
    the reason (it once raised AttributeError on None from inside the load, after choosing)."""
    save_steps(root, 2)
    finder = Checkpointer(CheckpointConfig(checkpoint_dir=str(root)), DistContext(), state=None, scheduler=StepScheduler(num_epochs=1))
    assert finder.find_resume_point().name == "epoch_0_step_2"
    with pytest.raises(ValueError, match=r"restore\(\): no state registered \(state=None\)"):
        finder.restore()


def test_resume_false_ignores_latest(root):
    save_steps(root, 2)
    assert checkpointer(root, resume=False).find_resume_point() is None


# -- layout ----------------------------------------------------------------------------------


def test_layout_manifest_lists_exactly_the_files_on_disk_and_latest_is_relative(root):
    save_steps(root, 3, 6)
    assert sorted(p.name for p in root.iterdir()) == [LATEST, "epoch_0_step_3", "epoch_0_step_6"]
    latest = root / LATEST
    assert latest.is_symlink() and os.readlink(latest) == "epoch_0_step_6"  # relative, same directory
    assert not list(root.glob(".staging_*")) and not list(root.glob(".trash_*"))

    for step in (3, 6):
        directory = root / f"epoch_0_step_{step}"
        manifest = json.loads((directory / MANIFEST).read_text())
        on_disk = {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()} - {MANIFEST}
        listed = all_files(directory, manifest)  # the manifest's list and the rank manifest's own files
        assert set(listed) == on_disk
        # the rank's own file is in its rank manifest, which the manifest lists; not in the manifest itself
        assert "rank_manifests/ranks_00000-00000.json" in manifest["files"] and "rank_state/rank_00000.safetensors" not in manifest["files"]
        assert manifest["rank_blocks"] == {"world_size": 1, "block": 64}
        for rel, entry in listed.items():
            assert entry["size"] == (directory / rel).stat().st_size
            assert entry[DIGEST] == file_digest(directory / rel)
        assert {
            model_file(),
            f"{OPTIM_DIR}/{optim_shard_name(1, 1)}",
            "optim/skeleton.json",
            "optim/lr_scheduler.json",
            "step_scheduler.json",
            "config.yaml",
            "rank_state/rank_00000.safetensors",  # RNG and data position: one file per rank
            "extra/counter.json",
        } <= on_disk
        assert not any(rel.startswith(("rng/", "dataloader/")) for rel in on_disk)
        assert manifest["meta"]["global_step"] == step
        validate(directory)


def test_every_directory_of_a_checkpoint_is_fsynced_after_its_entries_and_none_is_listed(root, monkeypatch):
    # the publish fsyncs the directories of its files by their paths (no readdir of a directory of
    # a file per rank); the block's leader those of its members' own files (rank_state/ here)
    synced, listed = [], []
    monkeypatch.setattr(writer, "fsync_dir", lambda path: synced.append(Path(path)))
    real_scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path=".": listed.append(str(path)) or real_scandir(path))
    directory = save_steps(root, 3).root / "epoch_0_step_3"
    staging = root / ".staging_epoch_0_step_3"
    want = {staging} | {staging / p.relative_to(directory) for p in directory.rglob("*") if p.is_dir()}
    assert want <= set(synced), sorted(map(str, want - set(synced)))
    assert not [p for p in listed if ".staging_" in p], listed


# -- atomic publish --------------------------------------------------------------------------


@pytest.mark.parametrize("phase", PHASES)
def test_failed_save_at_any_phase_leaves_latest_on_the_previous_valid_checkpoint(root, phase, no_fault_hook):
    ck = save_steps(root, 2)
    before = (root / "epoch_0_step_2" / MANIFEST).read_bytes()

    def fail(name):
        if name == phase:
            raise OSError(28, f"injected failure at {name}")

    writer.fault_hook = fail
    with pytest.raises(CheckpointSaveError, match="epoch_0_step_4.*injected failure"):
        save_at(ck, 4)
    writer.fault_hook = None

    assert latest_name(root) == "epoch_0_step_2"
    validate(root / "epoch_0_step_2")
    assert (root / "epoch_0_step_2" / MANIFEST).read_bytes() == before
    assert not list(root.glob(".staging_*")), "a failed save does not leave its staging directory behind"
    assert ck.find_resume_point() == root / "epoch_0_step_2"  # never the unpointed step 4
    if phase != "pointer":
        assert not (root / "epoch_0_step_4").exists()
    # The next save works normally.
    save_at(ck, 6)
    assert latest_name(root) == "epoch_0_step_6"


def test_a_save_whose_parts_fail_their_deferred_fsync_leaves_latest_on_the_previous_checkpoint(root, monkeypatch):
    from resilience.checkpoint.storage import durable

    ck = save_steps(root, 2)
    real = durable._fsync_and_close

    def full_disk(fds, *, fsync):  # the batch's fsync at the end of the parts fails, as on a full disk
        if fsync and fds:
            real(fds, fsync=False)
            raise OSError(28, "No space left on device")
        real(fds, fsync=fsync)

    monkeypatch.setattr(durable, "_fsync_and_close", full_disk)
    with pytest.raises(CheckpointSaveError, match="epoch_0_step_4.*fsync of the parts' files.*No space left"):
        save_at(ck, 4)
    monkeypatch.setattr(durable, "_fsync_and_close", real)
    assert latest_name(root) == "epoch_0_step_2"
    validate(root / "epoch_0_step_2")
    assert not (root / "epoch_0_step_4").exists() and not list(root.glob(".staging_*"))
    save_at(ck, 6)
    assert latest_name(root) == "epoch_0_step_6"


def test_resave_of_same_step_whose_rename_fails_keeps_the_previous_save(root, no_fault_hook):
    ck = save_steps(root, 4)
    old_weights = (root / "epoch_0_step_4" / model_file()).read_bytes()
    elsewhere = root.parent / "moved_away"

    def remove_staging(name):
        if name == "rename":  # a real failure: the staging directory is gone when it is renamed
            shutil.move(str(root / ".staging_epoch_0_step_4"), elsewhere)

    writer.fault_hook = remove_staging
    with pytest.raises(CheckpointSaveError):
        save_at(ck, 4)
    writer.fault_hook = None
    assert elsewhere.is_dir()
    assert latest_name(root) == "epoch_0_step_4"
    validate(root / "epoch_0_step_4")
    assert (root / "epoch_0_step_4" / model_file()).read_bytes() == old_weights
    assert not list(root.glob(".trash_*"))


def test_resave_of_same_step_replaces_it_atomically(root):
    ck = save_steps(root, 4)
    with torch.no_grad():
        ck.state.model[0].weight.fill_(3.25)  # trained on since
    ck.state.extra["counter"].value = 7
    save_at(ck, 4)
    assert not list(root.glob(".trash_*")) and not list(root.glob(".staging_*"))
    assert latest_name(root) == "epoch_0_step_4"
    validate(root / "epoch_0_step_4")
    fresh = make_state(seed=8)
    ck.load(ck.find_resume_point(), fresh)
    assert torch.all(fresh.model[0].weight == 3.25)
    assert fresh.extra["counter"].value == 7


# -- resume: validation and fallback ---------------------------------------------------------


def _truncate(directory: Path) -> None:
    shard = directory / model_file()
    shard.write_bytes(shard.read_bytes()[:-16])


def _flip_byte(directory: Path) -> None:
    shard = directory / model_file()
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # inside the tensor data: same size, different content
    shard.write_bytes(bytes(data))


def _drop_manifest(directory: Path) -> None:
    (directory / MANIFEST).unlink()


def _delete(directory: Path) -> None:
    shutil.rmtree(directory)


def _malformed_manifest(directory: Path) -> None:
    (directory / MANIFEST).write_text(json.dumps({"format_version": 1, "files": ["model"]}))


def _flip_rank_manifest(directory: Path) -> None:
    path = directory / rank_manifest_file(0, 0)
    path.write_bytes(path.read_bytes().replace(b'"size": ', b'"size":0', 1))  # same length, another size


def _drop_own_file(directory: Path) -> None:
    (directory / rank_state_file(0)).unlink()  # listed in the rank manifest, not in manifest.json


@pytest.mark.parametrize(
    "damage, why",
    [
        (_truncate, "truncated"),
        (_flip_byte, "checksum mismatch"),
        (_drop_manifest, "no manifest.json"),
        (_malformed_manifest, "not a manifest of format 1 or 2"),
        (_delete, "no such checkpoint directory"),
        (_flip_rank_manifest, "ranks_00000-00000.json: checksum mismatch"),
        (_drop_own_file, "rank_00000.safetensors: missing"),
    ],
    ids=["truncated-shard", "flipped-bytes", "missing-manifest", "malformed-manifest", "deleted-directory", "corrupt-rank-manifest", "missing-own-file"],
)
def test_invalid_latest_falls_back_to_newest_older_valid_checkpoint(root, caplog, damage, why):
    save_steps(root, 2, 4, 6)
    damage(root / "epoch_0_step_6")
    ck = checkpointer(root, make_state(seed=2))
    with caplog.at_level(logging.WARNING, logger="resilience.checkpoint"):
        # structural damage is seen when choosing, flipped bytes while loading: either way the
        # restore ends on the older checkpoint
        assert ck.restore().directory == root / "epoch_0_step_4"
    assert (root / "epoch_0_step_6" / BAD_MARKER).exists() or damage is _delete
    text = caplog.text
    assert "epoch_0_step_6" in text and why in text and "falling back to epoch_0_step_4" in text
    assert latest_name(root) == "epoch_0_step_6", "resume does not move LATEST"


def test_invalid_checkpoint_is_marked_bad_and_skipped_next_time(root, caplog):
    save_steps(root, 2, 4)
    shard = root / "epoch_0_step_4" / model_file()
    original = shard.read_bytes()
    _truncate(root / "epoch_0_step_4")
    ck = checkpointer(root)
    assert ck.find_resume_point() == root / "epoch_0_step_2"
    assert "truncated" in (root / "epoch_0_step_4" / BAD_MARKER).read_text()

    # Even with its bytes back, a checkpoint marked bad is not tried again.
    shard.write_bytes(original)
    validate(root / "epoch_0_step_4")
    assert ck.find_resume_point() == root / "epoch_0_step_2"


def test_a_corrupt_latest_saved_again_after_the_fallback_is_named_as_marked_bad_not_as_another_timeline(root, caplog):
    save_steps(root, 2, 4, 6)
    _flip_byte(root / "epoch_0_step_6")  # found while loading: marked bad, then the fallback
    ck = checkpointer(root, make_state(seed=2))
    with caplog.at_level(logging.WARNING, logger="resilience.checkpoint"):
        assert ck.restore().directory == root / "epoch_0_step_4"
        assert save_at(ck, 6) == root / "epoch_0_step_6"  # trained 5 and 6 again
    text = caplog.text
    assert "epoch_0_step_6 already held a checkpoint marked bad" in text and "another timeline" not in text, text
    assert "at an earlier start" not in text
    (aside,) = [p for p in root.iterdir() if p.name.startswith("epoch_0_step_6.abandoned-")]
    assert (aside / BAD_MARKER).exists() and not (root / "epoch_0_step_6" / BAD_MARKER).exists()
    validate(root / "epoch_0_step_6")
    from resilience.cli.status import inspect_root

    (entry,) = [e for e in inspect_root(root)["checkpoints"] if e["name"] == aside.name]
    assert entry["state"] == "marked bad" and entry["kind"] == "abandoned" and "marked bad, moved aside" in entry["problem"]


def test_all_checkpoints_invalid_means_fresh_start_with_warnings(root, caplog):
    save_steps(root, 2, 4)
    _truncate(root / "epoch_0_step_2")
    _truncate(root / "epoch_0_step_4")
    with caplog.at_level(logging.WARNING, logger="resilience.checkpoint"):
        assert checkpointer(root, make_state(seed=2)).restore() is None
    assert caplog.text.count("truncated") == 2


def test_all_checkpoints_corrupt_inside_stops_the_run_then_the_next_start_is_fresh(root, caplog):
    # Flipped bytes are found while loading: the model is partly overwritten by then, so the run
    # must not train on; started again, it starts from scratch.
    save_steps(root, 2, 4)
    _flip_byte(root / "epoch_0_step_2")
    _flip_byte(root / "epoch_0_step_4")
    with caplog.at_level(logging.WARNING, logger="resilience.checkpoint"):
        with pytest.raises(CheckpointCorrupted, match="run again to start from scratch"):
            checkpointer(root, make_state(seed=2)).restore()
    assert caplog.text.count("checksum mismatch") == 2
    assert (root / "epoch_0_step_2" / BAD_MARKER).exists() and (root / "epoch_0_step_4" / BAD_MARKER).exists()
    assert checkpointer(root, make_state(seed=2)).restore() is None


def test_corrupt_optimizer_bytes_fall_back_to_an_exact_older_state(root):
    older, newer = make_state(seed=1, train_steps=2), make_state(seed=1, train_steps=4)
    save_at(checkpointer(root, older), 2)
    save_at(checkpointer(root, newer), 4)
    optim = root / "epoch_0_step_4" / OPTIM_DIR / optim_shard_name(1, 1)  # digested as the loader reads it
    data = bytearray(optim.read_bytes())
    data[len(data) // 2] ^= 0x01
    optim.write_bytes(bytes(data))
    fresh = make_state(seed=3)
    assert checkpointer(root, fresh).restore().directory == root / "epoch_0_step_2"
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), older.model.parameters()))
    for p_fresh, p_old in zip(fresh.model.parameters(), older.model.parameters()):
        got, want = fresh.optimizer.state[p_fresh], older.optimizer.state[p_old]
        assert all(torch.equal(got[k], want[k]) for k in ("exp_avg", "exp_avg_sq", "step"))


def test_a_corrupt_restore_from_is_an_error_not_a_fallback(root):
    save_steps(root, 2, 4)
    _flip_byte(root / "epoch_0_step_2")
    with pytest.raises(CheckpointNotFound, match="checkpoint.restore_from: .*checksum mismatch"):
        checkpointer(root, make_state(seed=2), restore_from="epoch_0_step_2").restore()


def test_checkpoints_newer_than_latest_are_not_resumed(root):
    # LATEST is the publication point: a complete directory it does not name (a save that failed
    # to move LATEST) is not trusted.
    save_steps(root, 2, 4)
    write_pointer(root, LATEST, root / "epoch_0_step_2")
    assert checkpointer(root).find_resume_point() == root / "epoch_0_step_2"


def test_missing_latest_resumes_newest_valid_checkpoint(root):
    save_steps(root, 2, 4)
    (root / LATEST).unlink()
    assert checkpointer(root).find_resume_point() == root / "epoch_0_step_4"


@pytest.mark.parametrize("target_kind", ["absolute", "dotdot", "nested-symlink"])
def test_latest_pointing_outside_checkpoint_dir_is_refused(root, tmp_path, caplog, target_kind):
    save_steps(root, 2)
    # A valid checkpoint outside the root: following the pointer would resume from it.
    outside = tmp_path / "elsewhere" / "epoch_0_step_9"
    save_steps(outside.parent, 9)
    validate(outside)
    (root / LATEST).unlink()
    if target_kind == "absolute":
        os.symlink(str(outside), root / LATEST)
    elif target_kind == "dotdot":
        os.symlink("../elsewhere/epoch_0_step_9", root / LATEST)
    else:  # LATEST -> epoch_0_step_9 (in root), itself a symlink to the outside checkpoint
        os.symlink(str(outside), root / "epoch_0_step_9")
        os.symlink("epoch_0_step_9", root / LATEST)
    with caplog.at_level(logging.WARNING, logger="resilience.checkpoint"):
        assert checkpointer(root).find_resume_point() == root / "epoch_0_step_2"
    assert "refusing to follow" in caplog.text
    assert not (outside / BAD_MARKER).exists(), "nothing is written outside checkpoint_dir"


# -- restore_from ----------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["name", "absolute"])
def test_restore_from_missing_checkpoint_is_a_config_error_before_training(root, form):
    save_steps(root, 2)
    target = "epoch_0_step_8" if form == "name" else str(root / "epoch_0_step_8")
    with pytest.raises(ConfigError, match="checkpoint.restore_from=.*epoch_0_step_8.*no such checkpoint directory"):
        checkpointer(root, restore_from=target)  # at construction, i.e. at resilient_loop()


def test_restore_from_invalid_checkpoint_raises_not_found_without_fallback(root):
    save_steps(root, 2, 4)
    _truncate(root / "epoch_0_step_2")
    with pytest.raises(CheckpointNotFound, match="truncated"):
        checkpointer(root, restore_from="epoch_0_step_2").find_resume_point()


@pytest.mark.parametrize("form", ["name", "absolute"])
def test_restore_from_valid_checkpoint_overrides_latest(root, form):
    save_steps(root, 2, 4)
    target = "epoch_0_step_2" if form == "name" else str(root / "epoch_0_step_2")
    # resume=false does not turn an explicit restore_from off.
    assert checkpointer(root, restore_from=target, resume=False).find_resume_point() == root / "epoch_0_step_2"


def test_checkpoint_not_found_is_a_file_not_found_error():
    assert issubclass(CheckpointNotFound, FileNotFoundError)
    assert not issubclass(CheckpointInvalid, FileNotFoundError)


# -- leftovers -------------------------------------------------------------------------------


def test_staging_and_trash_leftovers_are_removed_at_resume(root):
    save_steps(root, 2)
    staging = root / ".staging_epoch_0_step_5"
    (staging / "model").mkdir(parents=True)
    (staging / "model" / "partial.safetensors").write_bytes(b"\0" * 100)
    trash = root / ".trash_epoch_0_step_2"  # its checkpoint exists: a finished re-save's leftover
    trash.mkdir()
    assert checkpointer(root).find_resume_point() == root / "epoch_0_step_2"
    assert not staging.exists() and not trash.exists()


def test_trash_without_its_checkpoint_is_put_back_at_resume(root):
    # A crash between the two renames of a re-save: the old copy is in trash, the new one in staging.
    save_steps(root, 2, 4)
    os.rename(root / "epoch_0_step_4", root / ".trash_epoch_0_step_4")
    shutil.copytree(root / ".trash_epoch_0_step_4", root / ".staging_epoch_0_step_4")
    assert checkpointer(root).find_resume_point() == root / "epoch_0_step_4"
    assert not list(root.glob(".trash_*")) and not list(root.glob(".staging_*"))


# -- pointers --------------------------------------------------------------------------------


def _no_symlinks(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(1, "Operation not permitted (symlinks unsupported here)")

    monkeypatch.setattr(os, "symlink", refuse)


def test_latest_txt_is_written_and_followed_where_symlinks_fail(root, monkeypatch):
    root.mkdir()
    (root / "epoch_0_step_2").mkdir()
    _no_symlinks(monkeypatch)
    write_pointer(root, LATEST, root / "epoch_0_step_2")
    assert (root / "LATEST.txt").read_text() == "epoch_0_step_2\n"
    assert not (root / LATEST).is_symlink()
    assert read_pointer(root, LATEST) == root / "epoch_0_step_2"
    assert sorted(p.name for p in root.iterdir()) == ["LATEST.txt", "epoch_0_step_2"], "no temporary files left"


def test_pointer_forms_never_disagree_when_symlink_support_changes(root, monkeypatch):
    ck = save_steps(root, 2)
    assert (root / LATEST).is_symlink()
    _no_symlinks(monkeypatch)
    save_at(ck, 4)
    assert not (root / LATEST).is_symlink(), "a stale symlink would win over LATEST.txt"
    assert read_pointer(root, LATEST) == root / "epoch_0_step_4"
    assert ck.find_resume_point() == root / "epoch_0_step_4"
    monkeypatch.undo()
    save_at(ck, 6)
    assert (root / LATEST).is_symlink() and not (root / "LATEST.txt").exists()
    assert read_pointer(root, LATEST) == root / "epoch_0_step_6"


def test_read_pointer_absent_is_none(root):
    root.mkdir()
    assert read_pointer(root, LATEST) is None
