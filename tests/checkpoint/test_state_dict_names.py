"""Our state-dict helpers (``resilience.checkpoint.formats.state_dicts``) against DCP's own, for every
wrapper they map without DCP: plain, DDP, ``torch.compile``'d, activation-checkpointed, and
combinations. The same keys in the same order, the same tensors, the same optimizer state (also
for a fresh optimizer, which both give state by a zero-gradient step), the same loads; and a
checkpoint written either way has byte-identical weight and optimizer files and resumes to the
same bits. A model DCP must handle (a ``DTensor``, a ``_fqn_modifiers`` hook) goes to DCP.

DCP's own helpers are reached by forcing ``state_dicts.needs_dcp`` to say yes (monkeypatch):
the two paths of one function, nothing else replaced.
"""

from __future__ import annotations

import copy
import importlib
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX, apply_activation_checkpointing, checkpoint_wrapper
from torch.nn.parallel import DistributedDataParallel

from resilience.checkpoint import Checkpointer, TrainingState
from resilience.checkpoint.formats import state_dicts
from resilience.checkpoint.formats.state_dict_names import CHECKPOINT_PREFIX, needs_dcp
from resilience.config import CheckpointConfig
from resilience.distributed import DistContext
from resilience.state.step_scheduler import StepScheduler

DCP = importlib.import_module("torch.distributed.checkpoint.state_dict")
pytestmark = pytest.mark.usefixtures("one_rank_group")  # DDP needs a process group (tests/conftest.py)


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.fc(x)))


class Net(torch.nn.Module):
    """Nested blocks, BatchNorm's buffers, a non-persistent buffer, a frozen parameter and a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.blocks = torch.nn.Sequential(Block(8), Block(8))
        self.bn = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: two names, one tensor
        self.frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.blocks(self.embed(idx)))) + self.frozen.sum()


class WithExtraState(Net):
    """A module with ``get_extra_state`` (its ``_extra_state`` key)."""

    def __init__(self) -> None:
        super().__init__()
        self.counter = 7

    def get_extra_state(self) -> dict:
        return {"counter": self.counter}

    def set_extra_state(self, state: dict) -> None:
        self.counter = state["counter"]


def _checkpointed(model: torch.nn.Module) -> torch.nn.Module:
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: isinstance(m, Block))
    return model


def _compiled(model: torch.nn.Module) -> torch.nn.Module:
    return torch.compile(model, backend="eager")  # dynamo's OptimizedModule, no C++ compiler needed


WRAPPERS = {
    "plain": lambda m: m,
    "ddp": lambda m: DistributedDataParallel(m),
    "compiled": _compiled,
    "checkpointed": _checkpointed,
    "ddp_checkpointed": lambda m: DistributedDataParallel(_checkpointed(m)),
    "compiled_ddp": lambda m: _compiled(DistributedDataParallel(m)),
    "compiled_checkpointed": lambda m: _compiled(_checkpointed(m)),
}


def build(wrapper: str, cls: type = Net, steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A wrapped model (seed 0) and AdamW, trained ``steps`` steps through the wrapper."""
    torch.manual_seed(0)
    model = WRAPPERS[wrapper](cls())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for i in range(steps):
        idx = torch.randint(0, 10, (6,), generator=torch.Generator().manual_seed(i))
        optimizer.zero_grad()
        model(idx).pow(2).mean().backward()
        optimizer.step()
    return model, optimizer


def assert_same(a, b, where: str = "") -> None:
    """Equal nested state: same keys in the same order, tensors bitwise equal (dtype and shape)."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    else:
        assert a == b, where


def test_the_checkpoint_wrapper_prefix_is_torchs():
    assert CHECKPOINT_PREFIX == _CHECKPOINT_PREFIX


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_names_values_and_loads_are_dcps_without_importing_it(wrapper, monkeypatch):
    model, optimizer = build(wrapper, WithExtraState if wrapper == "plain" else Net)
    assert not needs_dcp(model, (optimizer,))
    ours_model, ours_optim = state_dicts.get_state_dict(model, optimizer)
    theirs_model, theirs_optim = DCP.get_state_dict(model, optimizer)
    assert list(ours_model) == list(theirs_model)  # the names, in DCP's order
    assert not any(part in key for key in ours_model for part in ("module.", "_orig_mod.", "_checkpoint_wrapped_module."))
    for key, t in ours_model.items():
        if isinstance(t, torch.Tensor):  # the live tensors, as DCP's
            assert t.data_ptr() == theirs_model[key].data_ptr() and torch.equal(t, theirs_model[key]), key
    assert ours_model.get("_extra_state") == theirs_model.get("_extra_state")
    assert_same(ours_optim, theirs_optim, "optim")
    assert_same(state_dicts.get_model_state_dict(model), DCP.get_model_state_dict(model), "model")
    assert_same(state_dicts.get_optimizer_state_dict(model, optimizer), DCP.get_optimizer_state_dict(model, optimizer), "optim")

    # loads: the trained state into two fresh copies, one each way; then one more step on each is the same
    fresh = [build(wrapper, WithExtraState if wrapper == "plain" else Net, steps=0) for _ in range(2)]
    for (m, o), (set_model, set_optim) in zip(
        fresh, ((state_dicts.set_model_state_dict, state_dicts.set_optimizer_state_dict), (DCP.set_model_state_dict, DCP.set_optimizer_state_dict))
    ):
        keys = set_model(m, dict(theirs_model))
        assert list(keys.missing_keys) == [] and list(keys.unexpected_keys) == []
        set_optim(m, o, copy.deepcopy(DCP.get_optimizer_state_dict(model, optimizer)))  # load_state_dict may keep the tensors given
    for m, o in fresh:
        assert_same(m.state_dict(), model.state_dict(), "loaded model")
        assert_same(o.state_dict(), optimizer.state_dict(), "loaded optimizer")
        o.zero_grad()
        m(torch.arange(6) % 10).pow(2).mean().backward()
        o.step()
    assert_same(fresh[0][0].state_dict(), fresh[1][0].state_dict(), "after a step")
    assert_same(fresh[0][1].state_dict(), fresh[1][1].state_dict(), "after a step")


@pytest.mark.parametrize("wrapper", ["plain", "ddp"])
def test_a_fresh_optimizer_gets_the_same_state_as_from_dcp(wrapper):
    """Both give a fresh optimizer its state with one zero-gradient step at lr 0 (a side effect on
    the live optimizer); the weights do not move."""
    (m1, o1), (m2, o2) = build(wrapper, steps=0), build(wrapper, steps=0)
    assert not o1.state
    assert_same(state_dicts.get_optimizer_state_dict(m1, o1), DCP.get_optimizer_state_dict(m2, o2), "fresh")
    assert_same(o1.state_dict(), o2.state_dict(), "live")
    assert_same(m1.state_dict(), m2.state_dict(), "weights")
    assert all(p.grad is None for p in m1.parameters())


def _save(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    ck = Checkpointer(
        CheckpointConfig(checkpoint_dir=str(root)), DistContext(), state=TrainingState(model=model, optimizer=optimizer), scheduler=StepScheduler(num_epochs=1)
    )
    ck.scheduler.global_step = 2
    return ck.save("periodic")


def _load(directory: Path, wrapper: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optimizer = build(wrapper, steps=0)
    Checkpointer(
        CheckpointConfig(checkpoint_dir=str(directory.parent)),
        DistContext(),
        state=TrainingState(model=model, optimizer=optimizer),
        scheduler=StepScheduler(num_epochs=1),
    ).load(directory, TrainingState(model=model, optimizer=optimizer))
    return model, optimizer


def _files(directory: Path) -> dict[str, bytes]:
    """The weight and optimizer files of a checkpoint (the manifest, RNG and records differ by design)."""
    return {str(p.relative_to(directory)): p.read_bytes() for sub in ("model", "optim") for p in sorted((directory / sub).rglob("*")) if p.is_file()}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_checkpoint_written_either_way_has_the_same_files_and_resumes_the_same(wrapper, tmp_path, monkeypatch):
    model, optimizer = build(wrapper)
    ours = _save(tmp_path / "ours", model, optimizer)
    with monkeypatch.context() as forced:
        forced.setattr(state_dicts, "needs_dcp", lambda *args: True)  # DCP's helpers, as before
        theirs = _save(tmp_path / "theirs", model, optimizer)
        from_ours_by_dcp = _load(ours, wrapper)
    assert _files(ours) == _files(theirs) and _files(ours)
    from_theirs_by_ours = _load(theirs, wrapper)
    for m, o in (from_ours_by_dcp, from_theirs_by_ours):
        assert_same(m.state_dict(), model.state_dict(), "resumed model")
        assert_same(o.state_dict(), optimizer.state_dict(), "resumed optimizer")


def test_models_dcp_must_handle_go_to_dcp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    sharded = torch.nn.Linear(4, 4)
    mesh = init_device_mesh("cpu", (1,))
    sharded.weight = torch.nn.Parameter(distribute_tensor(sharded.weight.detach(), mesh))
    assert needs_dcp(sharded)

    hooked = Net()
    hooked.blocks._fqn_modifiers = lambda: {}  # DCP's renaming hook
    assert needs_dcp(hooked)
    assert not needs_dcp(Net())


def test_importing_the_library_imports_no_dtensor_and_a_plain_models_save_and_resume_no_dcp(tmp_path):
    """In a fresh interpreter: importing the loop and the checkpointer imports neither DTensor nor
    DCP nor sympy; a plain model's save and resume then import no DCP (torch itself imports
    ``torch._dynamo``, and DTensor and sympy with it, when an optimizer is built or stepped)."""
    import subprocess

    code = f"""
import sys, torch
heavy = lambda *names: [m for m in names if m in sys.modules]
from resilience import resilient_loop
from resilience.checkpoint import Checkpointer, TrainingState
from resilience.config import CheckpointConfig
from resilience.distributed import DistContext
from resilience.state.step_scheduler import StepScheduler
print(heavy("torch.distributed.tensor", "torch.distributed.checkpoint", "sympy", "torch.distributed.fsdp"))
model = torch.nn.Linear(3, 2); opt = torch.optim.AdamW(model.parameters())
state = TrainingState(model=model, optimizer=opt)
ck = Checkpointer(CheckpointConfig(checkpoint_dir={str(tmp_path)!r}), DistContext(), state=state, scheduler=StepScheduler(num_epochs=1))
ck.scheduler.global_step = 1
ck.load(ck.save("periodic"), state)
print(heavy("torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-2:] == ["[]", "[]"], out.stdout
