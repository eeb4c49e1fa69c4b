"""Additional state (NeMo's "Save Additional States"): any object with state_dict()/load_state_dict()
registered with the loop comes back after a resume, tensors included, without pickle."""

from __future__ import annotations

import json

import pytest
import torch

from resilience import resilient_loop
from resilience.checkpoint import CheckpointSaveError
from resilience.checkpoint.formats.extra_state import load_extra_state, save_extra_state

pytestmark = pytest.mark.usefixtures("no_launcher_environment")

BATCHES = [torch.full((2, 2), float(i)) for i in range(8)]


class EMA:
    """An exponential moving average of the weights plus bookkeeping of several kinds."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.updates = 0
        self.history: list = []

    def update(self) -> None:
        self.updates += 1
        for k, v in self.model.state_dict().items():
            self.shadow[k].mul_(0.9).add_(v.detach(), alpha=0.1)
        self.history.append((self.updates, float("nan") if self.updates == 2 else 0.5))

    def state_dict(self):
        return {
            "shadow": self.shadow,
            "updates": self.updates,
            "history": self.history,
            "by_step": {self.updates: torch.tensor([self.updates], dtype=torch.int64)},
            "bf16": torch.ones(3, dtype=torch.bfloat16),
        }

    def load_state_dict(self, state):
        self.shadow, self.updates, self.history = state["shadow"], state["updates"], state["history"]
        self.by_step, self.bf16 = state["by_step"], state["bf16"]


def run(root, max_steps):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = EMA(model)
    cfg = {"step_scheduler": {"max_steps": max_steps, "ckpt_every_steps": 1}, "checkpoint": {"checkpoint_dir": str(root)}}
    with resilient_loop(cfg, model=model, optimizer=optimizer, dataloader=BATCHES, extra_state={"ema": ema}) as loop:
        for step in loop:
            optimizer.zero_grad()
            model(step.batch).pow(2).mean().backward()
            optimizer.step()
            ema.update()
    return ema


def test_extra_state_with_tensors_survives_a_resume_bitwise(tmp_path):
    root = tmp_path / "ck"
    straight = run(tmp_path / "straight", 5)
    run(root, 3)
    resumed = run(root, 5)
    assert resumed.updates == straight.updates == 5
    for key in straight.shadow:
        assert torch.equal(resumed.shadow[key], straight.shadow[key])
    assert resumed.history[0] == (1, 0.5)  # tuples stay tuples
    assert str(resumed.history[1][1]) == "nan"  # NaN survives (strict JSON on disk)
    assert list(resumed.by_step) == [3] and torch.equal(resumed.by_step[3], torch.tensor([3]))  # int keys stay ints
    assert resumed.bf16.dtype == torch.bfloat16
    files = json.loads((root / "epoch_0_step_3" / "manifest.json").read_text())["files"]
    assert {"extra/ema.json", "extra/ema.safetensors"} <= set(files)
    assert "NaN" not in (root / "epoch_0_step_3" / "extra" / "ema.json").read_text()


def test_plain_json_extra_state_of_older_checkpoints_still_loads(tmp_path):
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "counter.json").write_text(json.dumps({"n": 4, "names": ["a"]}))
    assert load_extra_state(tmp_path, "counter") == {"n": 4, "names": ["a"]}


def test_an_unsupported_value_names_where_it_is(tmp_path):
    with pytest.raises(TypeError, match=r"extra\.bad\.inner\.fn: function"):
        save_extra_state(tmp_path, "bad", {"inner": {"fn": lambda: 0}})

    class Bad:
        def state_dict(self):
            return {"obj": object()}

        def load_state_dict(self, state):
            pass

    model = torch.nn.Linear(2, 1)
    cfg = {"step_scheduler": {"max_steps": 1}, "checkpoint": {"checkpoint_dir": str(tmp_path / "ck")}}
    with pytest.raises(CheckpointSaveError, match="extra.bad"):
        with resilient_loop(cfg, model=model, dataloader=BATCHES, extra_state={"bad": Bad()}) as loop:
            for _ in loop:
                pass
