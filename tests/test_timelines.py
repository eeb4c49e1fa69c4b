"""Stale timelines: a run resumed from an older checkpoint (``LATEST`` rolled back, or
``restore_from``) that reaches a step directory of the abandoned run moves it aside with a
warning naming it (never overwrites it silently), retention keeps the newest checkpoints of the
timeline being trained, and a later start without ``LATEST`` resumes the new timeline — each
step seeing the samples and losses of an uninterrupted run.

Real processes (``helpers/sample_train.py`` on one rank: 48 samples, batch 4, 12 steps an epoch).
"""

from __future__ import annotations

import pytest
from sample_runs import run, steps

from resilience import ExitCode
from resilience.checkpoint.layout import LATEST
from resilience.checkpoint.manifest import validate
from resilience.checkpoint.pointers import write_pointer

pytestmark = pytest.mark.multiproc
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


@pytest.mark.timeout(300)
def test_after_rolling_latest_back_the_new_timeline_keeps_its_checkpoints_and_a_start_without_latest_resumes_it(tmp_path, capfd, reference):
    ckpt, abandoned = train_to_30(tmp_path)
    write_pointer(ckpt, LATEST, ckpt / "epoch_0_step_10")  # roll back

    assert run(ckpt, tmp_path / "b.rec", overrides=[EPOCHS, EVERY_10, "step_scheduler.max_steps=25",
                                                   "checkpoint.max_recent_checkpoints=2"]) == [ExitCode.DONE]
    err = capfd.readouterr().err
    kept = names(ckpt)
    aside = [name for name in kept if name.startswith("epoch_1_step_20.abandoned-")]
    assert kept == ["epoch_1_step_20", *aside, "epoch_2_step_25"] and len(aside) == 1, kept
    assert f"moved it aside to {aside[0]}" in err  # the replaced checkpoint is named
    assert validate(ckpt / aside[0])["meta"]["checkpoint_id"] == abandoned["epoch_1_step_20"]  # kept aside, intact
    new_20 = validate(ckpt / "epoch_1_step_20")["meta"]
    assert new_20["parent"] == {"name": "epoch_0_step_10", "checkpoint_id": abandoned["epoch_0_step_10"]}
    assert validate(ckpt / "epoch_2_step_25")["meta"]["parent"]["checkpoint_id"] == new_20["checkpoint_id"]

    (ckpt / LATEST).unlink()  # a later start without LATEST
    assert run(ckpt, tmp_path / "c.rec", overrides=[EPOCHS, EVERY_10, "step_scheduler.max_steps=30"]) == [ExitCode.DONE]
    third = steps(tmp_path / "c.rec")
    assert list(third) == [26, 27, 28, 29, 30], "resumed the new timeline's step 25, not the abandoned step 30"
    same_as_uninterrupted(tmp_path, reference, steps(tmp_path / "a.rec"), steps(tmp_path / "b.rec"), third)


@pytest.mark.timeout(300)
def test_after_restore_from_an_older_checkpoint_a_start_without_latest_resumes_the_new_timeline_not_the_higher_abandoned_step(tmp_path, reference):
    ckpt, abandoned = train_to_30(tmp_path)
    assert run(ckpt, tmp_path / "b.rec", overrides=[EPOCHS, EVERY_10, "step_scheduler.max_steps=25",
                                                   "checkpoint.restore_from=epoch_0_step_10"]) == [ExitCode.DONE]
    assert validate(ckpt / "epoch_2_step_30")["meta"].get("checkpoint_id") == abandoned["epoch_2_step_30"]  # nothing deleted

    (ckpt / LATEST).unlink()
    assert run(ckpt, tmp_path / "c.rec", overrides=[EPOCHS, EVERY_10, "step_scheduler.max_steps=30"]) == [ExitCode.DONE]
    third = steps(tmp_path / "c.rec")
    assert list(third) == [26, 27, 28, 29, 30]
    same_as_uninterrupted(tmp_path, reference, steps(tmp_path / "a.rec"), steps(tmp_path / "b.rec"), third)
