"""The optimizer state every rank holds in full, in our own files (``optim/shard-0000K-of-0000N.safetensors``):
split over the ranks, digested as it is read, and checkpoints written with DCP still load."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import torch
from safetensors import safe_open
from test_checkpoint import checkpointer, make_state, save_at

from resilience import ExitCode, resilient_loop
from resilience.checkpoint.formats import optim_files, optim_io
from resilience.checkpoint.layout import DCP_METADATA, OPTIM_DIR, OPTIM_SHARD_GLOB, SKELETON, optim_shard_name
from resilience.checkpoint.storage.content_check import ContentCheck
from resilience.checkpoint.storage.manifest import read_manifest
from runs import latest_name, run

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torchdata's set_vital deprecation


@pytest.fixture
def root(tmp_path):
    return tmp_path / "ckpt"


def assert_same_optimizer(got: torch.optim.Optimizer, want: torch.optim.Optimizer) -> None:
    """Bitwise the same state per parameter, and the same param groups."""
    for p_got, p_want in zip(got.param_groups[0]["params"], want.param_groups[0]["params"]):
        state_got, state_want = got.state[p_got], want.state[p_want]
        assert set(state_got) == set(state_want)
        assert all(torch.equal(state_got[k], state_want[k]) for k in state_want)
    strip = [{k: v for k, v in group.items() if k != "params"} for group in want.param_groups]
    assert [{k: v for k, v in group.items() if k != "params"} for group in got.param_groups] == strip


def test_a_dcp_era_checkpoint_still_loads_exactly_into_a_fresh_optimizer(root, monkeypatch):
    saved_state = make_state(seed=1, train_steps=3)
    with monkeypatch.context() as patch:
        patch.setattr(optim_files, "replicated", lambda *args, **kwargs: False)  # the optimizer's writer before its own files
        save_at(checkpointer(root, saved_state), 3)
    saved = root / "epoch_0_step_3"
    assert (saved / OPTIM_DIR / DCP_METADATA).is_file() and not list((saved / OPTIM_DIR).glob(OPTIM_SHARD_GLOB))
    assert "storage" not in json.loads((saved / SKELETON).read_text()), "the skeleton of the DCP era"

    fresh = make_state(seed=2, train_steps=0)  # no optimizer state yet: built from the skeleton
    assert checkpointer(root, fresh).restore().directory == saved
    assert_same_optimizer(fresh.optimizer, saved_state.optimizer)
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), saved_state.model.parameters()))


def test_a_new_checkpoint_holds_the_optimizer_in_its_own_file_and_resumes_a_fresh_optimizer_exactly(root):
    saved_state = make_state(seed=1, train_steps=3)
    save_at(checkpointer(root, saved_state), 3)
    saved = root / "epoch_0_step_3"
    assert not (saved / OPTIM_DIR / DCP_METADATA).exists()
    skeleton = json.loads((saved / SKELETON).read_text())
    assert skeleton["storage"] == "safetensors" and skeleton["files"] == [optim_shard_name(1, 1)]

    fresh = make_state(seed=2, train_steps=0)
    checkpointer(root, fresh).restore()
    assert_same_optimizer(fresh.optimizer, saved_state.optimizer)


def test_a_flipped_byte_in_an_optim_file_is_caught_while_the_loader_reads_it(root):
    save_at(checkpointer(root, make_state(seed=1, train_steps=2)), 2)
    saved = root / "epoch_0_step_2"
    rel = f"{OPTIM_DIR}/{optim_shard_name(1, 1)}"
    data = bytearray((saved / rel).read_bytes())
    data[-5] ^= 0xFF  # inside the tensor data: same size, the file still parses
    (saved / rel).write_bytes(bytes(data))

    files = read_manifest(saved)["files"]
    check = ContentCheck(saved, files, sorted(files), inline=[rel])  # the thread leaves rel until finish()
    check.start()
    fresh = make_state(seed=2, train_steps=0)
    try:
        optim_io.load_optimizer(saved, fresh.model, fresh.optimizer, group=None, check=check)
        assert check.problem is not None and rel in check.problem and "checksum mismatch" in check.problem, (
            "found as the bytes passed through the loader, before any second read"
        )
    finally:
        check.finish()


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_each_rank_of_a_ddp_run_writes_about_half_of_the_optimizer_bytes(tmp_path):
    done = run(tmp_path, 2, overrides=["step_scheduler.max_steps=3", "step_scheduler.ckpt_every_steps=3"])
    assert done.codes == [ExitCode.DONE] * 2
    saved = tmp_path / latest_name(tmp_path)
    skeleton = json.loads((saved / SKELETON).read_text())
    names = [optim_shard_name(1, 2), optim_shard_name(2, 2)]
    assert skeleton["files"] == names and not (saved / OPTIM_DIR / DCP_METADATA).exists()
    specs = {spec["tensor"]: spec for entries in skeleton["state"].values() for spec in entries.values() if "tensor" in spec}
    stored: dict[str, int] = {}
    for name in names:
        with safe_open(str(saved / OPTIM_DIR / name), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                assert key not in stored, f"{key} written twice"
                assert specs[key]["file"] == name
                stored[key] = fh.get_tensor(key).numel() * 4
    assert set(stored) == set(specs), "every tensor written once"
    share = [sum(n for key, n in stored.items() if specs[key]["file"] == name) for name in names]
    assert abs(share[0] - share[1]) <= max(stored.values()), f"each rank writes about half: {share}"
    assert set(read_manifest(saved)["files"]) >= {f"{OPTIM_DIR}/{name}" for name in names}


class HistorySGD(torch.optim.Optimizer):
    """SGD that steps along the mean of its last two gradients: its state holds a list of tensors
    and a tuple, as LBFGS's (old_dirs) and other optimizers' do."""

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                history = state.setdefault("history", [])
                history.append(p.grad.clone())
                del history[:-2]
                state["shape"] = tuple(p.shape)
                p.add_(torch.stack(history).mean(0), alpha=-group["lr"])


def _optim_run(root, max_steps: int, make_optimizer) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A Linear(3, 1) trained ``max_steps`` steps with ``make_optimizer(params)``, saving every 2."""
    return _optim_loop(root, max_steps, make_optimizer)[:2]


def _optim_loop(root, max_steps: int, make_optimizer, **checkpoint) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, list[int]]:
    """:func:`_optim_run` with more ``checkpoint.*`` keys: (model, optimizer, the loop, the steps that ran)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = make_optimizer(model.parameters())
    batches = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    cfg = {"step_scheduler": {"max_steps": max_steps, "ckpt_every_steps": 2}, "checkpoint": {"checkpoint_dir": str(root), **checkpoint}}
    ran = []
    with resilient_loop(cfg, model=model, optimizer=optimizer, dataloader=batches) as loop:
        for step in loop:
            optimizer.zero_grad()
            model(step.batch).pow(2).mean().backward()
            optimizer.step()
            ran.append(step.global_step)
    return model, optimizer, loop, ran


def _history_run(root, max_steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    return _optim_run(root, max_steps, HistorySGD)


def test_an_optimizer_state_holding_a_list_of_tensors_and_a_tuple_resumes_exactly(tmp_path):
    """A list of tensors in the state failed the first save ('Tensor is not JSON serializable');
    each tensor inside is now an entry of its own, and the tuple stays a tuple."""
    straight_model, straight = _history_run(tmp_path / "straight", 6)
    _history_run(tmp_path / "ck", 4)
    model, resumed = _history_run(tmp_path / "ck", 6)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), straight_model.parameters()))
    for p_got, p_want in zip(resumed.param_groups[0]["params"], straight.param_groups[0]["params"]):
        got, want = resumed.state[p_got], straight.state[p_want]
        assert type(got["history"]) is list and all(torch.equal(a, b) for a, b in zip(got["history"], want["history"], strict=True))
        assert type(got["shape"]) is tuple and got["shape"] == want["shape"]
    skeleton = json.loads((tmp_path / "ck" / "epoch_0_step_4" / SKELETON).read_text())
    entries = skeleton["state"]["weight"]
    assert entries[optim_io.NESTED + "history.1"]["part_of"] == "history" and "tagged" in entries["shape"]


def test_an_optimizer_whose_step_needs_a_closure_is_refused_at_resilient_loop(tmp_path):
    model = torch.nn.Linear(3, 1)
    cfg = {"checkpoint": {"checkpoint_dir": str(tmp_path / "ck")}}
    with pytest.raises(TypeError, match=r"optimizer: LBFGS\.step\(\) needs a closure"):
        resilient_loop(cfg, model=model, optimizer=torch.optim.LBFGS(model.parameters()), dataloader=[0])


def _tensor_lr_run(root, max_steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    return _optim_run(root, max_steps, lambda params: torch.optim.Adam(params, lr=torch.tensor(0.01), betas=(0.8, 0.9)))


def test_an_optimizer_with_a_tensor_lr_saves_and_resumes_exactly(tmp_path):
    """A tensor lr in the param groups (as torch.compile'd and capturable setups use) failed every
    save with 'Tensor is not JSON serializable'; the groups are tagged JSON now."""
    straight_model, straight = _tensor_lr_run(tmp_path / "straight", 6)
    _tensor_lr_run(tmp_path / "ck", 4)
    model, resumed = _tensor_lr_run(tmp_path / "ck", 6)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), straight_model.parameters()))
    group = resumed.param_groups[0]
    assert isinstance(group["lr"], torch.Tensor) and torch.equal(group["lr"], straight.param_groups[0]["lr"])
    assert group["betas"] == (0.8, 0.9) and type(group["betas"]) is tuple
    assert_same_optimizer(resumed, straight)


def _one_group(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _decay_split(params):
    weight, bias = params
    return torch.optim.AdamW([{"params": [weight], "weight_decay": 0.1}, {"params": [bias], "weight_decay": 0.0}], lr=0.01)


def test_param_groups_changed_since_the_save_are_refused_before_any_step_and_no_load_optim_lets_the_weights_through(tmp_path, caplog):
    """Saved with 1 group, resumed with a decay / no-decay split: torch mapped the saved groups onto
    the new ones (group 0 lost lr and betas, group 1 took the saved weight_decay 0.1 over 0.0) and the
    first step failed with KeyError: 'betas'. Refused at the resume (exit 2), naming both sides."""
    root = tmp_path / "ck"
    _optim_loop(root, 4, _one_group)
    with caplog.at_level(logging.ERROR, logger="resilience"):
        _, optimizer, loop, ran = _optim_loop(root, 6, _decay_split)
    assert loop.exit_code == ExitCode.CONFIG_ERROR and ran == []
    message = caplog.text
    assert (
        "optimizer: epoch_0_step_4 was saved with 1 param group(s) of sizes [2], this optimizer has 2 of sizes [1, 1]; "
        "group 0 ['weight']: from saved group 0; group 1 ['bias']: from saved group 0 (weight_decay 0.1 -> 0.0) (saved -> current)"
    ) in message, message
    assert "checkpoint.no_load_optim=true" in message and "checkpoint.restore_from" in message, message
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0], "the user's groups are left as they were"

    _, optimizer, loop, ran = _optim_loop(root, 6, _decay_split, restore_from=str(root / "epoch_0_step_4"), no_load_optim=True)
    assert loop.exit_code == ExitCode.DONE and ran == [1, 2, 3, 4, 5, 6], "the weights only: training starts at step 0"
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
    assert all(group["betas"] == (0.9, 0.999) for group in optimizer.param_groups)


def test_a_hyperparameter_changed_in_the_same_groups_is_restored_from_the_checkpoint_with_a_warning(tmp_path, caplog):
    _optim_loop(tmp_path / "ck", 4, _one_group)
    with caplog.at_level(logging.WARNING, logger="resilience"):
        _, optimizer, loop, ran = _optim_loop(tmp_path / "ck", 6, lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.0))
    assert loop.exit_code == ExitCode.DONE and ran == [5, 6]
    assert "epoch_0_step_4's saved hyperparameters replace this optimizer's: group 0: weight_decay 0.0 -> 0.1" in caplog.text, caplog.text
    assert optimizer.param_groups[0]["weight_decay"] == 0.1


def test_momentum_a_cycling_schedule_moves_is_not_reported_as_replaced_but_other_changes_are():
    """OneCycleLR/CyclicLR move betas/momentum every step (their groups hold max_momentum): a warning at every resume would be noise."""
    from resilience.checkpoint.formats.optim_io import replaced_hyperparameters

    saved = [{"params": ["w"], "lr": 0.1, "betas": (0.86, 0.99), "max_momentum": 0.95, "weight_decay": 0.1}]
    current = [{"params": ["w"], "lr": 0.004, "betas": (0.95, 0.99), "max_momentum": 0.95, "weight_decay": 0.0}]
    assert replaced_hyperparameters(saved, current) == ["group 0: weight_decay 0.0 -> 0.1"]
    plain = [{k: v for k, v in group.items() if k != "max_momentum"} for group in current]
    assert any("betas" in change for change in replaced_hyperparameters([{k: v for k, v in saved[0].items() if k != "max_momentum"}], plain))
