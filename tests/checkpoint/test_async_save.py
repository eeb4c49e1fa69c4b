"""Asynchronous saving: a real snapshot, publication only after durability, failures everywhere."""

import copy
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from resilience import ExitCode
from resilience.checkpoint import Checkpointer, TrainingState, writer
from resilience.checkpoint.formats.model_io import load_model
from resilience.checkpoint.storage.manifest import validate
from resilience.config import CheckpointConfig
from resilience.distributed import DistContext
from resilience.launch import launch
from resilience.state.step_scheduler import StepScheduler
from runs import CONFIG, compare, latest_name, run

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
SHORT = ["step_scheduler.num_epochs=3", "step_scheduler.ckpt_every_steps=20"]
ASYNC = ["checkpoint.is_async=true"]


def _train_step(model, optimizer, seed):
    g = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(16, 8, generator=g)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


@pytest.fixture
def slow_writer():
    """Every file-writing part of a save sleeps 0.3 s: the save stays in flight for seconds."""
    writer.fault_hook = lambda phase: time.sleep(0.3) if phase == "parts" else None
    yield
    writer.fault_hook = None


def test_checkpoint_of_step_n_equals_a_deep_copy_at_n_while_steps_n1_n2_run(tmp_path, slow_writer):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for seed in range(3):
        _train_step(model, optimizer, seed)
    ck = Checkpointer(
        CheckpointConfig(checkpoint_dir=str(tmp_path), is_async=True),
        DistContext(),
        state=TrainingState(model=model, optimizer=optimizer),
        scheduler=StepScheduler(num_epochs=1, global_step=3, batches_in_epoch=3),
    )
    expected_model = copy.deepcopy(model.state_dict())
    expected_optim = copy.deepcopy(optimizer.state_dict())

    started = time.monotonic()
    ck.save()
    blocked = time.monotonic() - started
    assert ck.save_in_flight
    assert not (tmp_path / "LATEST").exists(), "nothing is published before it is durable"
    _train_step(model, optimizer, 3)  # steps N+1 and N+2 change every parameter in place
    _train_step(model, optimizer, 4)
    published = ck.wait()
    total = time.monotonic() - started
    assert blocked < 0.5 < total, f"save() blocked {blocked:.2f} s of a {total:.2f} s save"
    assert latest_name(tmp_path) == published.name == "epoch_0_step_3"
    validate(published)

    restored = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    load_model(published, restored)
    for key, value in restored.state_dict().items():
        assert torch.equal(value, expected_model[key]), key
        assert not torch.equal(value, model.state_dict()[key]), "the live model moved on"
    fresh_opt = torch.optim.AdamW(restored.parameters(), lr=0.05)
    ck.load(published, TrainingState(model=restored, optimizer=fresh_opt))
    for index, state in fresh_opt.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[name], expected_optim["state"][index][name]), (index, name)


def test_at_most_one_save_in_flight_and_the_next_save_waits(tmp_path, slow_writer):
    model = torch.nn.Linear(4, 4)
    scheduler = StepScheduler(num_epochs=1, global_step=1, batches_in_epoch=1)
    ck = Checkpointer(CheckpointConfig(checkpoint_dir=str(tmp_path), is_async=True), DistContext(), state=TrainingState(model=model), scheduler=scheduler)
    ck.save()
    scheduler.finish_step()
    ck.save()  # waits for step 1
    assert validate(tmp_path / "epoch_0_step_1")["meta"]["global_step"] == 1
    ck.close()
    assert latest_name(tmp_path) == "epoch_0_step_2"


def test_a_failed_background_write_raises_at_the_next_wait(tmp_path):
    def fail(phase):
        if phase == "manifest":
            raise OSError(28, "No space left on device")

    ck = Checkpointer(
        CheckpointConfig(checkpoint_dir=str(tmp_path), is_async=True),
        DistContext(),
        state=TrainingState(model=torch.nn.Linear(2, 2)),
        scheduler=StepScheduler(num_epochs=1, global_step=1, batches_in_epoch=1),
    )
    writer.fault_hook = fail
    try:
        ck.save()
        with pytest.raises(Exception, match="No space left on device"):
            ck.wait()
    finally:
        writer.fault_hook = None
    assert not (tmp_path / "LATEST").exists()


# -- real ranks ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("reference")
    assert run(path, 2, overrides=SHORT).codes == [ExitCode.DONE] * 2
    return path


def _digits(ckpt_dir, env, overrides):
    cmd = [sys.executable, str(HELPERS / "kill_at_phase.py"), "--config", str(CONFIG), f"checkpoint.checkpoint_dir={ckpt_dir}", *overrides]
    with launch(cmd, 2, env={"OMP_NUM_THREADS": "1", **env}, failure_grace_s=10.0, kill_grace_s=2.0) as group:
        group.wait(timeout=150)
        return [proc.returncode for proc in group.procs]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_sigkill_during_an_async_write_keeps_latest_prunes_nothing_and_resume_is_exact(tmp_path, reference):
    overrides = [*SHORT, *ASYNC, "checkpoint.max_recent_checkpoints=1"]
    codes = _digits(tmp_path, {"KILL_PHASE": "manifest", "KILL_AT_SAVE": "2", "KILL_RANK": "0"}, overrides)
    assert codes[0] == -signal.SIGKILL
    assert latest_name(tmp_path) == "epoch_0_step_20"
    assert sorted(p.name for p in tmp_path.glob("epoch_*")) == ["epoch_0_step_20"], "nothing published or pruned"
    assert run(tmp_path, 2, overrides=overrides).codes == [ExitCode.DONE] * 2
    result = compare(tmp_path, reference)
    assert result.identical, result.detail


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_writer_error_on_one_rank_raises_on_both_ranks_at_the_next_save(tmp_path, capfd):
    tiny = HELPERS / "tiny_train.py"
    cmd = [sys.executable, str(tiny), str(tmp_path / "ck"), "step_scheduler.ckpt_every_steps=10", "checkpoint.is_async=true"]
    env = {"OMP_NUM_THREADS": "1", "FAIL_PHASE": "parts", "FAIL_RANK": "1", "FAIL_AT_SAVE": "1"}
    started = time.monotonic()
    with launch(cmd, 2, env=env, failure_grace_s=30.0) as group:
        group.wait(timeout=120)
        codes = [proc.returncode for proc in group.procs]
    err = capfd.readouterr().err
    assert codes == [1, 1], err[-3000:]
    assert err.count("CheckpointSaveError") >= 2 and "injected failure at parts on rank 1" in err
    assert time.monotonic() - started < 60
    assert not (tmp_path / "ck" / "LATEST").exists()


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_preemption_during_an_async_save_publishes_it_exits_preempted_and_resumes_exactly(tmp_path, reference):
    overrides = [*SHORT, *ASYNC]
    cmd = [sys.executable, str(HELPERS / "kill_at_phase.py"), "--config", str(CONFIG), f"checkpoint.checkpoint_dir={tmp_path}", *overrides]
    env = {"OMP_NUM_THREADS": "1", "SLOW_PHASE": "manifest", "SLOW_S": "3"}  # each publish takes 3 s
    with launch(cmd, 2, env=env, failure_grace_s=20.0) as group:
        rows = tmp_path / "training.jsonl"
        deadline = time.monotonic() + 120
        while group.poll() is None and time.monotonic() < deadline:
            if rows.exists() and sum(1 for _ in rows.open()) >= 21:  # the step-20 save is in flight
                break
            time.sleep(0.01)
        group.send_signal(signal.SIGUSR1, ranks=[1])
        group.wait(timeout=120)
        codes = [proc.returncode for proc in group.procs]
    assert codes == [ExitCode.PREEMPTED] * 2
    stop = validate(tmp_path / latest_name(tmp_path))["meta"]
    assert stop["reason"] == "preemption" and stop["global_step"] > 20
    validate(tmp_path / "epoch_0_step_20")  # the save that was in flight was published too
    assert run(tmp_path, 2, overrides=overrides).codes == [ExitCode.DONE] * 2
    result = compare(tmp_path, reference)
    assert result.identical, result.detail
