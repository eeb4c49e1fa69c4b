"""Stale timelines: a run resumed from an older checkpoint (``LATEST`` rolled back, or
``restore_from``) that reaches a step directory of the abandoned run moves it aside with a
warning naming it (never overwrites it silently), retention keeps the newest checkpoints of the
timeline being trained, and a later start without ``LATEST`` resumes the new timeline — each
step seeing the samples and losses of an uninterrupted run.

Real processes (``helpers/sample_train.py`` on one rank: 48 samples, batch 4, 12 steps an epoch).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from resilience import ExitCode, resilient_loop
from resilience.checkpoint.layout import LATEST
from resilience.checkpoint.storage.manifest import validate
from resilience.checkpoint.storage.pointers import write_pointer
from resilience.cli.status import inspect_root
from sample_runs import run, steps

EPOCHS = "step_scheduler.num_epochs=3"
EVERY_10 = "step_scheduler.ckpt_every_steps=10"


def names(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.is_symlink())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, dict]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    assert run(tmp / "ck", tmp / "ref.rec", overrides=[EPOCHS, "step_scheduler.max_steps=30"]) == [ExitCode.DONE]
    return steps(tmp / "ref.rec")


def train_to_30(tmp_path):
    ckpt = tmp_path / "ck"
    assert run(ckpt, tmp_path / "a.rec", overrides=[EPOCHS, EVERY_10, "step_scheduler.max_steps=30"]) == [ExitCode.DONE]
    assert names(ckpt) == ["epoch_0_step_10", "epoch_1_step_20", "epoch_2_step_30"]
    return ckpt, {name: validate(ckpt / name)["meta"].get("checkpoint_id") for name in names(ckpt)}


def same_as_uninterrupted(tmp_path, reference, first: dict, second: dict, third: dict) -> None:
    seen = {**{s: r for s, r in first.items() if s <= 10}, **second, **third}
    assert list(seen) == list(range(1, 31))
    assert [(r["ids"], r["loss"]) for r in seen.values()] == [(r["ids"], r["loss"]) for r in reference.values()]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_after_rolling_latest_back_the_new_timeline_keeps_its_checkpoints_and_a_start_without_latest_resumes_it(tmp_path, capfd, reference):
    ckpt, abandoned = train_to_30(tmp_path)
    write_pointer(ckpt, LATEST, ckpt / "epoch_0_step_10")  # roll back

    assert run(ckpt, tmp_path / "b.rec", overrides=[EPOCHS, EVERY_10, "step_scheduler.max_steps=25", "checkpoint.max_recent_checkpoints=2"]) == [ExitCode.DONE]
    err = capfd.readouterr().err
    kept = names(ckpt)
    aside = [name for name in kept if name.startswith("epoch_1_step_20.abandoned-")]
    # step 10 left the window of 2 of the new lineage; the abandoned timeline's 30 is neither counted nor removed
    assert kept == ["epoch_1_step_20", *aside, "epoch_2_step_25", "epoch_2_step_30"] and len(aside) == 1, kept
    assert validate(ckpt / "epoch_2_step_30")["meta"]["checkpoint_id"] == abandoned["epoch_2_step_30"]
    assert f"moved it aside to {aside[0]}" in err  # the replaced checkpoint is named
    assert validate(ckpt / aside[0])["meta"]["checkpoint_id"] == abandoned["epoch_1_step_20"]  # kept aside, intact
    listed = {e["name"]: e for e in inspect_root(ckpt)["checkpoints"]}  # resilience status shows what was set aside
    assert listed[aside[0]]["state"] == "abandoned" and listed[aside[0]]["global_step"] == 20
    new_20 = validate(ckpt / "epoch_1_step_20")["meta"]
    assert new_20["parent"] == {"name": "epoch_0_step_10", "checkpoint_id": abandoned["epoch_0_step_10"]}
    assert validate(ckpt / "epoch_2_step_25")["meta"]["parent"]["checkpoint_id"] == new_20["checkpoint_id"]

    (ckpt / LATEST).unlink()  # a later start without LATEST
    assert run(ckpt, tmp_path / "c.rec", overrides=[EPOCHS, EVERY_10, "step_scheduler.max_steps=30"]) == [ExitCode.DONE]
    third = steps(tmp_path / "c.rec")
    assert list(third) == [26, 27, 28, 29, 30], "resumed the new timeline's step 25, not the abandoned step 30"
    same_as_uninterrupted(tmp_path, reference, steps(tmp_path / "a.rec"), steps(tmp_path / "b.rec"), third)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_after_restore_from_an_older_checkpoint_a_start_without_latest_resumes_the_new_timeline_not_the_higher_abandoned_step(tmp_path, reference):
    ckpt, abandoned = train_to_30(tmp_path)
    assert run(ckpt, tmp_path / "b.rec", overrides=[EPOCHS, EVERY_10, "step_scheduler.max_steps=25", "checkpoint.restore_from=epoch_0_step_10"]) == [
        ExitCode.DONE
    ]
    assert validate(ckpt / "epoch_2_step_30")["meta"].get("checkpoint_id") == abandoned["epoch_2_step_30"]  # nothing deleted

    (ckpt / LATEST).unlink()
    assert run(ckpt, tmp_path / "c.rec", overrides=[EPOCHS, EVERY_10, "step_scheduler.max_steps=30"]) == [ExitCode.DONE]
    third = steps(tmp_path / "c.rec")
    assert list(third) == [26, 27, 28, 29, 30]
    same_as_uninterrupted(tmp_path, reference, steps(tmp_path / "a.rec"), steps(tmp_path / "b.rec"), third)


def train_in_process(root, max_steps: int, **checkpoint) -> list[int]:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"step_scheduler": {"max_steps": max_steps, "ckpt_every_steps": 2}, "checkpoint": {"checkpoint_dir": str(root), **checkpoint}}
    seen = []
    with resilient_loop(cfg, model=model, optimizer=optimizer, dataloader=[torch.full((2, 2), float(i)) for i in range(12)]) as loop:
        for step in loop:
            seen.append(step.global_step)
            optimizer.zero_grad()
            model(step.batch).pow(2).mean().backward()
            optimizer.step()
    assert loop.exit_code == ExitCode.DONE
    return seen


def test_checkpoints_without_lineage_metadata_still_load_and_are_set_aside_when_a_rollback_reaches_them(tmp_path, monkeypatch):
    for name in [n for n in os.environ if n.startswith(("RESILIENCE_", "SLURM_"))]:
        monkeypatch.delenv(name)
    root = tmp_path / "ck"
    train_in_process(root, 6)
    for path in root.glob("epoch_*"):  # as written before checkpoint_id / parent existed
        doc = json.loads((path / "manifest.json").read_text())
        for key in ("checkpoint_id", "parent", "epoch_complete"):
            doc["meta"].pop(key, None)
        (path / "manifest.json").write_text(json.dumps(doc))
    assert train_in_process(root, 8) == [7, 8]  # an old-format LATEST resumes as before
    assert train_in_process(root, 6, restore_from="epoch_0_step_2") == [3, 4, 5, 6]
    aside = sorted(p.name for p in root.glob("*.abandoned-*"))
    assert [name.split(".")[0] for name in aside] == ["epoch_0_step_4", "epoch_0_step_6"]
    (root / LATEST).unlink()
    assert train_in_process(root, 8) == [7, 8]  # the new step 6, not the old-format step 8
    assert validate(root / "epoch_0_step_8")["meta"]["parent"]["name"] == "epoch_0_step_6"


def test_lowest_val_naming_a_checkpoint_set_aside_follows_it_and_is_put_back_if_the_rename_fails(tmp_path):
    """LOWEST_VAL names a checkpoint by name: when another timeline's checkpoint is set aside for a
    new one of the same name, the pointer must keep naming the checkpoint whose metric it records."""
    from resilience.checkpoint.policy.lowest_val import LOWEST_VAL
    from resilience.checkpoint.storage.pointers import read_pointer, write_pointer
    from resilience.checkpoint.writer import _rename_into_place

    root = tmp_path / "ck"
    old = root / "epoch_0_step_20"
    old.mkdir(parents=True)
    (old / "marker").write_text("old timeline")
    write_pointer(root, LOWEST_VAL, old)
    staging = root / ".staging_epoch_0_step_20"
    staging.mkdir()
    (staging / "marker").write_text("new timeline")
    _rename_into_place(root, staging, old, parent=None)
    best = read_pointer(root, LOWEST_VAL)
    assert best.name.startswith("epoch_0_step_20.abandoned-") and (best / "marker").read_text() == "old timeline"
    assert (old / "marker").read_text() == "new timeline"

    # a failed rename puts the old checkpoint and the pointer back
    write_pointer(root, LOWEST_VAL, old)
    (root / "epoch_0_step_30").mkdir()
    write_pointer(root, LOWEST_VAL, root / "epoch_0_step_30")
    missing = root / ".staging_gone"
    with pytest.raises(OSError):
        _rename_into_place(root, missing, root / "epoch_0_step_30", parent=None)
    assert read_pointer(root, LOWEST_VAL).name == "epoch_0_step_30" and (root / "epoch_0_step_30").is_dir()


def test_a_requeued_run_with_restore_from_resumes_its_own_latest_and_a_new_run_goes_back(tmp_path, monkeypatch):
    """Found by a newcomer: under Slurm every requeue repeats the command line, so a job started
    with checkpoint.restore_from went back to it at every attempt and set its own progress aside
    as "another timeline". A start whose LATEST was saved under the same run id (the Slurm job's,
    kept across requeues; here RESILIENCE_RUN_ID) and continues restore_from resumes LATEST; a run
    of another id, or without one, still starts from restore_from."""
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    root = tmp_path / "ck"
    monkeypatch.setenv("RESILIENCE_RUN_ID", "job-a")
    assert train_in_process(root, 6) == [1, 2, 3, 4, 5, 6]
    monkeypatch.setenv("RESILIENCE_RUN_ID", "job-b")
    assert train_in_process(root, 4, restore_from="epoch_0_step_2") == [3, 4]  # the rollback
    assert train_in_process(root, 6, restore_from="epoch_0_step_2") == [5, 6]  # job-b requeued: its own LATEST
    assert not [n for n in names(root) if n.startswith("epoch_0_step_4.abandoned") and validate(root / n)["meta"]["run_id"] == "job-b"]
    monkeypatch.setenv("RESILIENCE_RUN_ID", "job-c")
    assert train_in_process(root, 6, restore_from="epoch_0_step_2") == [3, 4, 5, 6]  # a new job goes back
    monkeypatch.delenv("RESILIENCE_RUN_ID")
    assert train_in_process(root, 6, restore_from="epoch_0_step_2") == [3, 4, 5, 6]  # no run id: as written
