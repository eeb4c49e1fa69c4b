"""checkpoint.save_global_layout_cache: the model's save plan and index are reused while the layout
is unchanged, and planned again when it changes (resized parameter), the weights loaded exact."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from resilience.checkpoint import Checkpointer, TrainingState
from resilience.checkpoint.formats.model_io import load_model
from resilience.config import CheckpointConfig, ConfigError
from resilience.distributed import DistContext
from resilience.launch import launch
from resilience.state.step_scheduler import StepScheduler

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


def _checkpointer(root, model, **overrides):
    config = CheckpointConfig(checkpoint_dir=str(root), no_save_optim=True, **overrides)
    return Checkpointer(config, DistContext(), state=TrainingState(model=model), scheduler=StepScheduler(num_epochs=1))


def _save(ck, step):
    ck.scheduler.load_state_dict(StepScheduler(num_epochs=1, batches_in_epoch=step, global_step=step).state_dict())
    return ck.save()


def _model(hidden):
    torch.manual_seed(hidden)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 2))


def test_an_unchanged_layout_is_planned_once_and_a_resized_parameter_is_planned_again_and_loads_exact(tmp_path):
    model = _model(8)
    ck = _checkpointer(tmp_path, model)
    _save(ck, 1)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # new values, same layout
    second = _save(ck, 2)
    assert ck._layout_cache.plans_made == 1, "the second save of an unchanged layout planned again"
    loaded = _model(8)
    load_model(second, loaded)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))

    model[0], model[1] = torch.nn.Linear(4, 16), torch.nn.Linear(16, 2)  # resized between saves
    third = _save(ck, 3)
    assert ck._layout_cache.plans_made == 2
    loaded = _model(16)
    load_model(third, loaded)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_save_global_layout_cache_false_plans_every_save(tmp_path):
    ck = _checkpointer(tmp_path, _model(8), save_global_layout_cache=False)
    for step in (1, 2, 3):
        _save(ck, step)
    assert ck._layout_cache.plans_made == 3


def test_save_global_layout_cache_must_be_a_bool():
    with pytest.raises(ConfigError, match="checkpoint.save_global_layout_cache: expected true or false"):
        CheckpointConfig(checkpoint_dir="/tmp/x", save_global_layout_cache="yes")


def _ranks(tmp_path, *overrides):
    cmd = [sys.executable, str(HELPERS / "layout_cache_ranks.py"), str(tmp_path / "ck"), str(tmp_path / "out.json"), *overrides]
    with launch(cmd, 2, env={"OMP_NUM_THREADS": "1"}, failure_grace_s=30.0) as group:
        while group.poll() is None:
            time.sleep(0.05)
        assert [p.returncode for p in group.procs] == [0, 0]
    return json.loads((tmp_path / "out.json").read_text())


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_a_dtensor_model_resharded_between_saves_is_planned_again_and_loads_exact_on_two_ranks(tmp_path):
    """A rule tensor (Shard over both ranks), a gathered one (a 1-rank submesh per rank) and a plain
    one; the second save of the same layout reuses the plan (and makes no planning gather)."""
    result = _ranks(tmp_path)
    assert result["plans"] == [1, 1, 2], "unchanged layout: planned once; resharded w: planned again"
    assert result["exact"] == {"w": True, "s": True, "b": True}
