"""Additional state (NeMo's "Save Additional States"): any object with state_dict()/load_state_dict()
registered with the loop comes back after a resume, tensors included, without pickle."""

from __future__ import annotations

import collections
import json

import numpy as np
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


def train(root, max_steps, *, lr, objects, after_step):
    """A Linear(2, 1) with SGD trained on BATCHES, saving every step; ``objects(model, optimizer)``
    gives resilient_loop's other keyword arguments, ``after_step(kw, optimizer, loss)`` runs after
    each optimizer step. Returns those keyword arguments."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    kw = objects(model, optimizer)
    cfg = {"step_scheduler": {"max_steps": max_steps, "ckpt_every_steps": 1}, "checkpoint": {"checkpoint_dir": str(root)}}
    with resilient_loop(cfg, model=model, optimizer=optimizer, dataloader=BATCHES, **kw) as loop:
        for step in loop:
            optimizer.zero_grad()
            loss = model(step.batch).pow(2).mean()
            loss.backward()
            optimizer.step()
            after_step(kw, optimizer, loss)
    return kw


def _update_ema(kw, *_):
    kw["extra_state"]["ema"].update()


def run(root, max_steps):
    kw = train(root, max_steps, lr=0.1, objects=lambda model, _: {"extra_state": {"ema": EMA(model)}}, after_step=_update_ema)
    return kw["extra_state"]["ema"]


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


class Bad:
    """An extra state that holds what cannot be saved once ``bad`` is set (an object, by default)."""

    def __init__(self, bad=None):
        self.bad = object() if bad is None else bad

    def state_dict(self):
        return {"inner": {"value": self.bad}}

    def load_state_dict(self, state):
        pass


def _loop(tmp_path, **kw):
    cfg = {"step_scheduler": {"max_steps": 1}, "checkpoint": {"checkpoint_dir": str(tmp_path / "ck")}}
    return resilient_loop(cfg, model=torch.nn.Linear(2, 1), dataloader=BATCHES, **kw)


def test_an_unsupported_value_names_where_it_is_at_resilient_loop_before_any_training(tmp_path):
    with pytest.raises(TypeError, match=r"extra\.bad\.inner\.fn: function"):
        save_extra_state(tmp_path, "bad", {"inner": {"fn": lambda: 0}})
    with pytest.raises(TypeError, match=r"extra\.bad\.inner\.value: object cannot be checkpointed"):
        _loop(tmp_path, extra_state={"bad": Bad()})
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").glob("epoch_*"))


def test_state_that_turns_unsavable_later_fails_its_save_naming_it(tmp_path):
    bad = Bad(bad=1)
    with pytest.raises(CheckpointSaveError, match=r"extra\.bad\.inner\.value: set"):
        with _loop(tmp_path, extra_state={"bad": bad}) as loop:
            for _ in loop:
                bad.bad = {1, 2}


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"extra_state": {"ema/1": Bad(1)}}, ValueError, r"extra_state: the name 'ema/1' cannot be a file name"),
        ({"extra_state": {".hidden": Bad(1)}}, ValueError, r"'\.hidden' cannot be a file name"),
        ({"extra_state": {"counter": 3}}, TypeError, r"extra_state\['counter'\]: a int has no state_dict\(\)"),
        ({"lr_scheduler": object()}, TypeError, r"lr_scheduler: a object has no state_dict\(\)"),
        ({"optimizer": "sgd"}, TypeError, r"optimizer: a str has no state_dict\(\)"),
    ],
)
def test_objects_that_cannot_be_checkpointed_are_refused_at_resilient_loop(tmp_path, kw, error, match):
    with pytest.raises(error, match=match):
        _loop(tmp_path, **kw)


def test_an_lr_scheduler_whose_state_cannot_be_saved_is_refused_at_resilient_loop(tmp_path):
    class Scheduler:
        def state_dict(self):
            return {"lr": torch.tensor(0.1), "seen": {1, 2}}

        def load_state_dict(self, state):
            pass

    with pytest.raises(TypeError, match=r"lr_scheduler\.state_dict\(\)\.seen: set cannot be checkpointed"):
        _loop(tmp_path, lr_scheduler=Scheduler())


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("multistep", lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 5, 5], gamma=0.1)),
        (
            "sequential",
            lambda opt: torch.optim.lr_scheduler.SequentialLR(
                opt,
                [torch.optim.lr_scheduler.LinearLR(opt, 0.5, total_iters=2), torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4])],
                milestones=[2],
            ),
        ),
        ("plateau", lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)),
    ],
)
def test_lr_schedulers_resume_on_the_same_schedule(tmp_path, name, make):
    """MultiStepLR's milestones are a Counter keyed by step: JSON made the keys strings and the
    schedule stopped decaying after a resume. ReduceLROnPlateau's best starts at inf."""

    def run(root, max_steps):
        lrs = []

        def after_step(kw, optimizer, loss):
            kw["lr_scheduler"].step(loss.item()) if name == "plateau" else kw["lr_scheduler"].step()
            lrs.append(optimizer.param_groups[0]["lr"])

        kw = train(root, max_steps, lr=1.0, objects=lambda _, optimizer: {"lr_scheduler": make(optimizer)}, after_step=after_step)
        return lrs, kw["lr_scheduler"].state_dict()

    straight, straight_state = run(tmp_path / "straight", 7)
    first, _ = run(tmp_path / "ck", 2)
    resumed, resumed_state = run(tmp_path / "ck", 7)
    assert first + resumed == straight
    assert len(set(straight)) > 1  # the schedule did change the lr
    assert json.dumps(resumed_state, default=repr, sort_keys=True) == json.dumps(straight_state, default=repr, sort_keys=True)
    if name == "multistep":
        assert type(resumed_state["milestones"]) is collections.Counter


class NumpyStats:
    """Running statistics kept in NumPy, as many training scripts keep them."""

    def __init__(self):
        self.count = np.int64(0)
        self.mean = np.float32(0.0)
        self.seen = np.bool_(False)
        self.hist = np.zeros((2, 3), dtype=np.float32)

    def update(self, batch: torch.Tensor) -> None:
        self.count += np.int64(1)
        self.mean = np.float32(self.mean + (np.float32(batch.mean().item()) - self.mean) / np.float32(self.count))
        self.seen = np.bool_(True)
        self.hist = (self.hist * np.float32(0.7) + np.float32(self.count)).T.copy().T  # an F-ordered array

    def state_dict(self):
        return {"count": self.count, "mean": self.mean, "seen": self.seen, "hist": self.hist, "pair": (np.float64(0.1), np.nan)}

    def load_state_dict(self, state):
        self.count, self.mean, self.seen, self.hist = state["count"], state["mean"], state["seen"], state["hist"]


def _numpy_run(root, max_steps):
    stats = NumpyStats()
    cfg = {"step_scheduler": {"max_steps": max_steps, "ckpt_every_steps": 1}, "checkpoint": {"checkpoint_dir": str(root)}}
    with resilient_loop(cfg, model=torch.nn.Linear(2, 1), dataloader=BATCHES, extra_state={"stats": stats}) as loop:
        for step in loop:
            stats.update(step.batch)
    return stats


def test_numpy_scalars_and_arrays_come_back_with_their_dtypes_and_values(tmp_path):
    straight = _numpy_run(tmp_path / "straight", 5)
    _numpy_run(tmp_path / "ck", 3)
    resumed = _numpy_run(tmp_path / "ck", 5)
    for name in ("count", "mean", "seen"):
        got, want = getattr(resumed, name), getattr(straight, name)
        assert type(got) is type(want) and got == want, name
    assert isinstance(resumed.hist, np.ndarray) and resumed.hist.dtype == np.float32
    assert np.array_equal(resumed.hist, straight.hist)
    saved = load_extra_state(tmp_path / "ck" / "epoch_0_step_3", "stats")
    assert type(saved["pair"][0]) is np.float64 and saved["pair"][0] == 0.1 and np.isnan(saved["pair"][1])


def test_numpy_edge_values_round_trip_or_are_refused_naming_them(tmp_path):
    state = {
        "zero_d": np.array(1.5),
        "c64": np.complex64(1 + 2j),
        "py_complex": 3 - 1j,
        "text": np.str_("abc"),
        "counts": collections.Counter({4: 2, 7: 1}),
    }
    save_extra_state(tmp_path, "edge", state)
    back = load_extra_state(tmp_path, "edge")
    assert back["zero_d"].shape == () and back["zero_d"].dtype == np.float64 and back["zero_d"] == 1.5
    assert type(back["c64"]) is np.complex64 and back["c64"] == np.complex64(1 + 2j)
    assert back["py_complex"] == 3 - 1j and type(back["text"]) is np.str_
    assert back["counts"] == state["counts"] and type(back["counts"]) is collections.Counter
    with pytest.raises(TypeError, match=r"extra\.edge\.x: a NumPy float128 scalar cannot be checkpointed exactly"):
        save_extra_state(tmp_path, "edge", {"x": np.longdouble(1)})


def test_an_extra_state_name_too_long_for_a_file_is_refused_at_resilient_loop(tmp_path):
    with pytest.raises(ValueError, match=r"at most 243 characters"):
        _loop(tmp_path, extra_state={"x" * 244: Bad(1)})

    class Weights:
        def state_dict(self):
            return {"w": torch.ones(2)}

        def load_state_dict(self, state):
            pass

    with _loop(tmp_path, extra_state={"x" * 243: Weights()}) as loop:
        for _ in loop:
            pass
    assert (tmp_path / "ck" / "epoch_0_step_1" / "extra" / ("x" * 243 + ".safetensors")).exists()


def test_an_older_checkpoints_plain_json_multisteplr_milestones_load_with_int_keys(tmp_path):
    """Before the LR scheduler's state was tagged, plain JSON wrote milestones {"3": 1, "5": 2}."""
    from resilience.checkpoint.formats.optim_io import load_lr_scheduler
    from resilience.checkpoint.layout import LR_SCHEDULER

    def scheduler():
        return torch.optim.lr_scheduler.MultiStepLR(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0), milestones=[3, 5, 5])

    saved = scheduler()
    for _ in range(2):
        saved.optimizer.step()
        saved.step()
    (tmp_path / LR_SCHEDULER).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / LR_SCHEDULER).write_text(json.dumps(saved.state_dict()))  # what the old code wrote
    assert '"3": 1' in (tmp_path / LR_SCHEDULER).read_text()
    resumed = scheduler()
    load_lr_scheduler(tmp_path, resumed)
    assert resumed.milestones == collections.Counter({3: 1, 5: 2}) and type(resumed.milestones) is collections.Counter
    lrs = []
    for _ in range(4):
        resumed.optimizer.step()
        resumed.step()
        lrs.append(resumed.get_last_lr()[0])
    assert lrs == pytest.approx([0.1, 0.1, 0.001, 0.001])
