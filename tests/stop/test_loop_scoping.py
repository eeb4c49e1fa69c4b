"""resilient_loop's scope: signal handlers exist only while it runs, earlier handlers keep working,
a preemption signal ends it with a checkpoint of the stop step, and finished runs stay finished."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from resilience import ExitCode, resilient_loop
from resilience.checkpoint.layout import LATEST
from resilience.checkpoint.storage.manifest import validate
from resilience.checkpoint.storage.pointers import read_pointer

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # torchdata's set_vital deprecation
    pytest.mark.usefixtures("no_launcher_environment"),
]

WATCHED = (signal.SIGTERM, signal.SIGUSR1)
DATA = torch.arange(20, dtype=torch.float32).reshape(10, 2)


def config(root: Path, **step_scheduler) -> dict:
    return {"step_scheduler": {"num_epochs": 1, **step_scheduler}, "checkpoint": {"checkpoint_dir": str(root)}}


def make_loop(root: Path, dataloader=None, **step_scheduler):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if dataloader is None:
        dataloader = [DATA[i : i + 2] for i in range(0, 10, 2)]  # a plain list: 5 batches
    loop = resilient_loop(config(root, **step_scheduler), model=model, optimizer=optimizer, dataloader=dataloader)
    return loop, model, optimizer


def train_step(model, optimizer, batch) -> None:
    optimizer.zero_grad()
    model(batch).pow(2).mean().backward()
    optimizer.step()


def dispositions() -> dict:
    return {sig: signal.getsignal(sig) for sig in WATCHED}


@pytest.fixture
def restore_signals():
    saved = dispositions()
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("how", ["finish", "raise", "break"])
def test_signal_dispositions_are_the_same_before_and_after_the_loop(tmp_path, restore_signals, how):
    def earlier_handler(signum, frame):  # a Python handler installed before the loop
        pass

    signal.signal(signal.SIGUSR1, earlier_handler)
    before = dispositions()
    assert before[signal.SIGTERM] == signal.SIG_DFL
    loop, model, optimizer = make_loop(tmp_path / "ck", preemption_signal=["SIGTERM", "SIGUSR1"])
    during = []

    def run():
        with loop:
            for step in loop:
                during.append(dispositions())
                train_step(model, optimizer, step.batch)
                if step.global_step == 2 and how == "raise":
                    raise RuntimeError("boom in the loop body")
                if step.global_step == 2 and how == "break":
                    break

    if how == "raise":
        with pytest.raises(RuntimeError, match="boom"):
            run()
    else:
        run()

    assert during and all(d[sig] != before[sig] for d in during for sig in WATCHED), "the loop installs its handlers"
    assert dispositions() == before
    assert loop.exit_code == (ExitCode.DONE if how == "finish" else ExitCode.FAILED)


def test_earlier_python_handler_still_runs_and_loop_stops_preempted_with_a_checkpoint(tmp_path, restore_signals):
    calls = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    before = dispositions()
    root = tmp_path / "ck"
    loader = StatefulDataLoader(TensorDataset(DATA), batch_size=2)
    loop, model, optimizer = make_loop(root, loader, preemption_signal="SIGUSR1")
    seen = []
    with loop:
        for step in loop:
            seen.append(step.global_step)
            train_step(model, optimizer, step.batch[0])
            if step.global_step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)
    assert calls == [signal.SIGUSR1], "the handler installed before the loop ran once"
    assert seen == [1, 2, 3]
    assert loop.exit_code == ExitCode.PREEMPTED and loop.exit_code.requeue
    assert loop.stop_step == 3
    assert read_pointer(root, LATEST) == root / "epoch_0_step_3"
    validate(root / "epoch_0_step_3")
    assert dispositions() == before

    # The requeued run continues right after the stop step, with the next batch.
    loader2 = StatefulDataLoader(TensorDataset(DATA), batch_size=2)
    resumed, model2, _ = make_loop(root, loader2, preemption_signal="SIGUSR1")
    with resumed:
        steps = [(s.global_step, s.batch_index, s.batch[0]) for s in resumed]
    assert resumed.resumed_from == root / "epoch_0_step_3"
    assert [(g, i) for g, i, _ in steps] == [(4, 3), (5, 4)]
    assert torch.equal(steps[0][2], DATA[6:8])
    assert torch.equal(model2.weight, model.weight), "the resumed model is the one trained before the stop"
    assert resumed.exit_code == ExitCode.DONE


_CHILD = textwrap.dedent(
    """
    import sys, time
    import torch, yaml
    from resilience import resilient_loop

    root, spec = sys.argv[1], yaml.safe_load(sys.argv[2])
    cfg = {"step_scheduler": {"num_epochs": 1, "preemption_signal": spec}, "checkpoint": {"checkpoint_dir": root}}
    model = torch.nn.Linear(2, 1)
    loop = resilient_loop(cfg, model=model, dataloader=[torch.ones(2)] * 100000)
    with loop:
        for step in loop:
            if step.global_step == 1:
                print("ready", flush=True)
            time.sleep(0.005)
    sys.exit(int(loop.exit_code))
    """
)


def _run_child_and_sigterm(tmp_path: Path, spec: str) -> int:
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ck"), spec], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(120)
def test_sigterm_kills_a_run_with_preemption_signal_null(tmp_path):
    assert _run_child_and_sigterm(tmp_path, "null") == -signal.SIGTERM
    assert read_pointer(tmp_path / "ck", LATEST) is None, "nothing was saved"


@pytest.mark.timeout(120)
def test_sigterm_preempts_a_run_with_the_default_preemption_signal(tmp_path):
    # The control for the test above: the same child with the default spec stops and saves.
    assert _run_child_and_sigterm(tmp_path, "SIGTERM") == ExitCode.PREEMPTED
    latest = read_pointer(tmp_path / "ck", LATEST)
    validate(latest)
    assert latest.name.startswith("epoch_0_step_")


def test_finished_run_saves_final_checkpoint_and_a_rerun_yields_nothing(tmp_path):
    root = tmp_path / "ck"
    loop, model, optimizer = make_loop(root, num_epochs=2)
    with loop:
        steps = [s.global_step for s in loop]
    assert steps == list(range(1, 11))
    assert loop.exit_code == ExitCode.DONE
    assert read_pointer(root, LATEST) == root / "epoch_1_step_10"
    validate(root / "epoch_1_step_10")

    again, _, _ = make_loop(root, num_epochs=2)
    with again:
        assert list(again) == []
    assert again.exit_code == ExitCode.DONE
    assert again.resumed_from == root / "epoch_1_step_10"
    assert sorted(p.name for p in root.glob("epoch_*")) == ["epoch_1_step_10"], "no new checkpoint"


def test_log_takes_a_loss_tensor_as_its_item_and_names_the_key_of_a_value_json_cannot_hold(tmp_path):
    root = tmp_path / "ck"
    loop, model, optimizer = make_loop(root, max_steps=1)
    with loop:
        for step in loop:
            loss = model(step.batch).pow(2).mean()
            loop.log(loss=loss.detach())
            with pytest.raises(TypeError, match=r"loop.log\(weights=\.\.\.\)"):
                loop.log(weights=torch.zeros(3))
    rows = [json.loads(line) for line in (root / "training.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] == pytest.approx(loss.item()) and "weights" not in rows[0]


def test_a_break_out_of_the_loop_exits_failed_and_says_so(tmp_path, caplog):
    loop, model, optimizer = make_loop(tmp_path / "ck", num_epochs=2)
    with caplog.at_level(logging.WARNING, logger="resilience"), loop:
        for step in loop:
            train_step(model, optimizer, step.batch)
            if step.global_step == 3:
                break
    assert loop.exit_code == ExitCode.FAILED
    assert "left at step 3 before it ended (break" in caplog.text and "no save" in caplog.text


def test_a_ctrl_c_that_ends_the_steps_is_named_as_such_when_the_loop_is_closed(tmp_path, caplog):
    """Closed in a finally (or after a Ctrl-C held through a save), close() said 'break, an exception, or never iterated'."""
    loop, model, optimizer = make_loop(tmp_path / "ck", num_epochs=2)
    with caplog.at_level(logging.WARNING, logger="resilience"), pytest.raises(KeyboardInterrupt):
        try:
            for step in loop:
                train_step(model, optimizer, step.batch)
                if step.global_step == 2:
                    raise KeyboardInterrupt
        finally:
            loop.close()
    assert loop.exit_code == ExitCode.FAILED
    assert "interrupted by Ctrl-C at step 2 before it ended" in caplog.text, caplog.text


@pytest.mark.parametrize(
    "every, expected",
    [
        (3, ["epoch_0_step_3", "epoch_1_step_10", "epoch_1_step_6", "epoch_1_step_9"]),
        (5, ["epoch_0_step_5", "epoch_1_step_10"]),  # the save at an epoch's last batch keeps its epoch
    ],
)
def test_periodic_saves_produce_the_expected_checkpoint_names(tmp_path, every, expected):
    root = tmp_path / "ck"
    loop, model, optimizer = make_loop(root, num_epochs=2, ckpt_every_steps=every)
    with loop:
        for step in loop:
            train_step(model, optimizer, step.batch)
    assert loop.exit_code == ExitCode.DONE
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("epoch_")) == expected
    assert read_pointer(root, LATEST) == root / "epoch_1_step_10"
