"""``LOWEST_VAL`` (NeMo AutoModel): the pointer names the checkpoint with the lowest validation
metric, NaN/Inf never win, the best survives a resume, and validation.jsonl / losses.json /
the manifest record what was logged."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from resilience import ExitCode, resilient_loop
from resilience.checkpoint.layout import LOWEST_VAL, VALIDATION_LOG
from resilience.checkpoint.storage.manifest import read_manifest
from resilience.checkpoint.storage.pointers import read_pointer
from resilience.config import ConfigError

pytestmark = pytest.mark.usefixtures("no_launcher_environment")

BATCHES = [torch.full((2, 2), float(i)) for i in range(12)]


class Crash(Exception):
    pass


def run(
    root: Path,
    max_steps: int,
    val: dict[int, object],
    *,
    every: int = 1,
    crash_at: int | None = None,
    checkpoint: dict | None = None,
    step_scheduler: dict | None = None,
    seen: list | None = None,
):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = {
        "step_scheduler": {"max_steps": max_steps, "ckpt_every_steps": every, **(step_scheduler or {})},
        "checkpoint": {"checkpoint_dir": str(root), **(checkpoint or {})},
    }
    loop = resilient_loop(cfg, model=model, optimizer=optimizer, dataloader=BATCHES)
    with loop:
        for step in loop:
            if seen is not None:
                seen.append(step)
            optimizer.zero_grad()
            loss = model(step.batch).pow(2).mean()
            loss.backward()
            optimizer.step()
            loop.log(loss=loss.item())
            metrics = val.get(step.global_step)
            if metrics is not None:
                loop.log_validation(**(metrics if isinstance(metrics, dict) else {"val_loss": metrics}))
            if step.global_step == crash_at:
                raise Crash()
    return loop


def lowest(root: Path) -> str | None:
    target = read_pointer(root, LOWEST_VAL)
    return target.name if target is not None else None


def test_lowest_val_names_the_lowest_finite_metric_nan_and_inf_never_win(tmp_path):
    root = tmp_path / "ck"
    vals = {1: float("nan"), 2: 0.5, 3: float("-inf"), 4: torch.tensor(0.3), 5: float("inf"), 6: 0.4, 7: float("nan")}
    run(root, 7, vals)
    assert lowest(root) == "epoch_0_step_4"
    assert read_manifest(root / "epoch_0_step_4")["meta"]["val_metric"] == {"key": "val_loss", "value": pytest.approx(0.3)}
    assert read_manifest(root / "epoch_0_step_3")["meta"]["val_metric"] == {"key": "val_loss", "value": None}
    rows = [json.loads(line) for line in (root / VALIDATION_LOG).read_text().splitlines()]
    assert [r["global_step"] for r in rows] == list(range(1, 8))
    assert [r["val_loss"] for r in rows][:3] == ["nan", 0.5, "-inf"]  # strict JSON: non-finite as strings


def test_a_nan_first_metric_leaves_no_lowest_val_until_a_finite_one(tmp_path):
    root = tmp_path / "ck"
    run(root, 2, {1: float("nan"), 2: float("inf")})
    assert read_pointer(root, LOWEST_VAL) is None
    run(root, 3, {3: 7.0})
    assert lowest(root) == "epoch_0_step_3"


def test_lowest_val_survives_a_resume_and_redone_rows_are_dropped(tmp_path):
    root = tmp_path / "ck"
    with pytest.raises(Crash):  # checkpoints 2 and 4; step 5 validates, then the process dies
        run(root, 8, {2: 0.2, 4: 0.6, 5: 0.05}, every=2, crash_at=5)
    assert lowest(root) == "epoch_0_step_2"
    assert [json.loads(line)["global_step"] for line in (root / VALIDATION_LOG).read_text().splitlines()] == [2, 4, 5]

    loop = run(root, 7, {5: 0.3, 6: 0.25}, every=1)  # resumes at 4
    assert loop.resumed_from == root / "epoch_0_step_4"
    assert loop.exit_code == ExitCode.DONE
    # 0.3 and 0.25 are worse than run 1's 0.2: the best was re-read, not forgotten
    assert lowest(root) == "epoch_0_step_2"
    run(root, 8, {8: 0.1})
    assert lowest(root) == "epoch_0_step_8"
    steps_and_values = [(r["global_step"], r["val_loss"]) for r in map(json.loads, (root / VALIDATION_LOG).read_text().splitlines())]
    assert steps_and_values == [(2, 0.2), (4, 0.6), (5, 0.3), (6, 0.25), (8, 0.1)]  # the crashed step-5 row is gone


def test_resume_keeps_the_pointer_where_the_best_is(tmp_path):
    root = tmp_path / "ck"
    run(root, 3, {1: 1.0, 2: 0.2, 3: 0.5})
    run(root, 5, {4: 0.3, 5: 0.9})
    assert lowest(root) == "epoch_0_step_2"


def test_best_metric_key_picks_among_several_metrics(tmp_path):
    root = tmp_path / "ck"
    vals = {1: {"val_loss": 0.1, "accuracy": 0.2}, 2: {"val_loss": 0.5, "accuracy": 0.9}, 3: {"val_loss": 0.4, "accuracy": 0.05}}
    run(root, 3, vals, checkpoint={"best_metric_key": "accuracy"})
    assert lowest(root) == "epoch_0_step_3"
    losses = json.loads((root / "epoch_0_step_3" / "losses.json").read_text())
    assert losses["val_loss"] == 0.4 and losses["accuracy"] == 0.05  # NeMo: several metrics side by side


def test_several_metrics_without_the_configured_key_is_an_error_at_the_call(tmp_path):
    with pytest.raises(ValueError, match="best_metric_key='default'"):
        run(tmp_path / "ck", 2, {1: {"val_loss": 0.1, "accuracy": 0.2}})


def test_a_validation_without_a_checkpoint_of_its_step_is_no_candidate(tmp_path):
    root = tmp_path / "ck"
    run(root, 4, {1: 5.0, 3: 0.01}, every=2, step_scheduler={"num_epochs": 1})
    assert "val_metric" not in read_manifest(root / "epoch_0_step_4")["meta"]
    assert read_pointer(root, LOWEST_VAL) is None  # step 1 and 3 were never checkpointed


def test_losses_json_holds_train_and_val_loss_and_the_rows_since_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ck"
    run(root, 4, {4: 0.75}, every=2)
    doc = json.loads((root / "epoch_0_step_4" / "losses.json").read_text())
    rows = [json.loads(line) for line in (root / "training.jsonl").read_text().splitlines()]
    assert doc["global_step"] == 4
    assert doc["train_loss"] == rows[3]["loss"]
    assert doc["val_loss"] == 0.75
    assert doc["training"] == rows[2:4]  # steps 3 and 4: since checkpoint 2
    assert json.loads((root / "epoch_0_step_2" / "losses.json").read_text())["training"] == rows[:2]


def test_step_is_val_step_follows_val_every_steps(tmp_path):
    seen: list = []
    run(tmp_path / "ck", 6, {}, step_scheduler={"val_every_steps": 3}, seen=seen)
    assert [s.global_step for s in seen if s.is_val_step] == [3, 6]


def test_log_validation_needs_a_metric_and_val_every_steps_is_validated(tmp_path):
    with pytest.raises(ValueError, match="at least one metric"):
        run(tmp_path / "ck", 1, {1: {}})
    with pytest.raises(ConfigError, match="val_every_steps"):
        run(tmp_path / "ck2", 1, {}, step_scheduler={"val_every_steps": 0})


def test_resaving_the_best_step_with_a_worse_metric_moves_lowest_val_to_the_next_best(tmp_path):
    root = tmp_path / "ck"
    run(root, 4, {1: 0.5, 2: 0.1, 3: 0.3, 4: 0.9})
    assert lowest(root) == "epoch_0_step_2"
    run(root, 2, {2: float("nan")}, checkpoint={"restore_from": "epoch_0_step_1"})  # redo step 2
    assert lowest(root) == "epoch_0_step_3"
    assert math.isclose(read_manifest(root / "epoch_0_step_3")["meta"]["val_metric"]["value"], 0.3)
