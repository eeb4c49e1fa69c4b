"""Gradient accumulation (``step_scheduler.gradient_accumulation_steps``): one Step per
micro-batch, and everything that needs a consistent state (checkpoints, stops, the data
position) only between optimizer steps, so a preempted and resumed run is bitwise exact."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from resilience import ExitCode, resilient_loop
from resilience.checkpoint.storage.manifest import validate
from resilience.launch import launch
from runs import compare, latest_name, run

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torchdata's set_vital deprecation

STOP_HELPER = Path(__file__).resolve().parents[1] / "helpers" / "accumulation_stop_train.py"
_spec = importlib.util.spec_from_file_location("accumulation_stop_train", STOP_HELPER)
stop_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stop_runs)

# 2 ranks x 16 samples: 44 micro-batches per epoch and rank; 3 per step: 14 steps of 3 and one of 2.
ACCUMULATED = ["step_scheduler.num_epochs=2", "step_scheduler.gradient_accumulation_steps=3", "data.global_batch_size=32", "step_scheduler.ckpt_every_steps=20"]


class _NoLength:
    """An iterable of batches without __len__: the last batch is found by drawing the next one ahead."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sized", [True, False], ids=["length", "no-length"])
def test_micro_batches_group_into_optimizer_steps_and_an_epoch_tail_is_a_short_step(tmp_path, sized):
    model = torch.nn.Linear(2, 1)
    batches = [torch.full((1, 2), float(i)) for i in range(7)]
    batches = batches if sized else _NoLength(batches)
    config = {"step_scheduler": {"num_epochs": 2, "gradient_accumulation_steps": 3, "preemption_signal": None}, "checkpoint": {"checkpoint_dir": str(tmp_path)}}
    loop = resilient_loop(config, model=model, dataloader=batches)
    seen = []
    with loop:
        for step in loop:
            seen.append((step.global_step, step.epoch, step.batch_index, step.micro_step, step.is_optimizer_step, int(step.batch[0, 0])))
    assert loop.exit_code == ExitCode.DONE
    epoch = [(1, 0, 0, False), (1, 1, 1, False), (1, 2, 2, True), (2, 3, 0, False), (2, 4, 1, False), (2, 5, 2, True), (3, 6, 0, True)]
    want = [(g, 0, i, m, last, i) for g, i, m, last in epoch] + [(g + 3, 1, i, m, last, i) for g, i, m, last in epoch]
    assert seen == want, "global_step counts optimizer steps; the epoch's 7th batch is a 1-batch step"
    final = validate(tmp_path / latest_name(tmp_path))["meta"]
    assert final["global_step"] == 6
    counters = json.loads((tmp_path / latest_name(tmp_path) / "step_scheduler.json").read_text())
    assert counters == {"epoch": 2, "batches_in_epoch": 0, "global_step": 6}


@pytest.mark.multiproc
@pytest.mark.timeout(400)
@pytest.mark.parametrize("signal_rank", [1])
def test_accumulating_two_rank_run_preempted_through_one_rank_resumes_bitwise_exact(tmp_path, signal_rank):
    reference = tmp_path / "reference"
    assert run(reference, 2, overrides=ACCUMULATED).codes == [ExitCode.DONE] * 2
    steps = [json.loads(line)["global_step"] for line in (reference / "training.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 31)), "one logged row per optimizer step: 15 per epoch"

    resumed = tmp_path / "resumed"
    first = run(resumed, 2, overrides=ACCUMULATED, signal_rank=signal_rank, signal_at_step=8)
    assert first.codes == [ExitCode.PREEMPTED] * 2
    manifest = validate(resumed / latest_name(resumed))
    stop_step = manifest["meta"]["global_step"]
    assert 8 <= stop_step < 30 and manifest["meta"]["reason"] == "preemption"
    counters = json.loads((resumed / latest_name(resumed) / "step_scheduler.json").read_text())
    epoch_steps = stop_step - 15 * counters["epoch"]
    assert counters["batches_in_epoch"] == min(3 * epoch_steps, 44), "the saved data position is an optimizer-step boundary"

    second = run(resumed, 2, overrides=ACCUMULATED)
    assert second.codes == [ExitCode.DONE] * 2
    result = compare(resumed, reference)
    assert result.identical, result.detail
    assert result.steps == 30


def _expected_stop(every: int | None, world: int) -> dict:
    """Where a stop signalled in any micro-batch of step S lands: after S on one process (its
    preemption save replaces the periodic one); on 2 ranks after S + 1 (the agreement reads at
    S + 1 the all-reduce it started at S, k = 1), or after S when S saves (the blocking check
    after that save agrees at once, "during a save")."""
    s = stop_runs.SIGNAL_STEP
    during_a_save = world > 1 and every == s
    step = s if world == 1 or during_a_save else s + 1
    reason = "periodic" if during_a_save else "preemption"
    return {"stop_step": step, "exit_code": int(ExitCode.PREEMPTED), "latest": [step, reason], "batches_in_epoch": stop_runs.ACCUMULATION * step}


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_launcher_environment")
@pytest.mark.parametrize("every, position", stop_runs.CASES)
def test_a_stop_signalled_in_any_micro_batch_of_step_s_stops_one_process_after_s(tmp_path, every, position):
    row = stop_runs.stop_after_signal(tmp_path, position, every=every, signalled=True)
    assert row == _expected_stop(every, 1), f"signal in micro-batch {position} of step {stop_runs.SIGNAL_STEP}"


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_on_two_ranks_the_stop_step_does_not_depend_on_the_micro_batch_the_signal_arrived_in(tmp_path):
    """Every case of the helper in one launch: rank 1 signals itself in micro-batch 0, 1 or 2 of step S."""
    with launch([sys.executable, str(STOP_HELPER), str(tmp_path)], 2, env={"OMP_NUM_THREADS": "1"}) as group:
        assert group.wait(timeout=100) == 0
    for rank in (0, 1):
        rows = [json.loads(line) for line in (tmp_path / f"rank_{rank}.jsonl").read_text().splitlines()]
        assert [(r["every"], r["position"]) for r in rows] == stop_runs.CASES
        for r in rows:
            got = {k: r[k] for k in ("stop_step", "exit_code", "latest", "batches_in_epoch")}
            assert got == _expected_stop(r["every"], 2), f"rank {rank}, ckpt_every_steps={r['every']}, signal in micro-batch {r['position']}"


ACCELERATE_TAIL = """
import sys, torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
from resilience import ConfigError, resilient_loop
acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(7, 2), torch.randn(7, 1)), batch_size=1)
model, opt, loader = acc.prepare(model, opt, loader)
cfg = lambda a: {"checkpoint": {"enabled": False}, "step_scheduler": {"gradient_accumulation_steps": a, "num_epochs": 2, "preemption_signal": None}}
try:
    resilient_loop(cfg(1), model=model, optimizer=opt, dataloader=loader)
    sys.exit("accepted a loop accumulating 1 under an Accelerator accumulating 2")
except ConfigError as exc:
    assert "set step_scheduler.gradient_accumulation_steps to 2" in str(exc), exc
loop = resilient_loop(cfg(2), model=model, optimizer=opt, dataloader=loader)
rows = []
with loop:
    for step in loop:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(step.batch[0]), step.batch[1])); opt.step(); opt.zero_grad()
        rows.append((step.global_step, step.micro_step, step.is_optimizer_step, acc.sync_gradients))
assert len(rows) == 14, rows
bad = [row for row in rows if row[2] != row[3]]
assert not bad, f"the loop's optimizer steps differ from Accelerate's (global_step, micro, loop, accelerate): {bad}"
"""


@pytest.mark.timeout(120)
def test_accelerate_accumulation_agrees_with_the_loop_on_every_optimizer_step_and_another_count_is_refused():
    """Found by a newcomer: the loop drew the epoch's tail batch ahead, so Accelerate's loader ended early,
    accumulate() did not sync on the 1-batch tail step and every later step was off by one (a stop saved
    half an accumulated gradient, exit 0); a loop accumulating 1 under an Accelerator accumulating 2 was accepted."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", ACCELERATE_TAIL], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stdout + out.stderr
