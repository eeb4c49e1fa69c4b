"""Lightning's ``Trainer`` under ``resilience.integrations.lightning.fit``: real processes, 2 gloo
ranks (DDP) under ``resilience run``, ``trainer.fit()`` kept.

The reference is examples/lightning/train.py uninterrupted (an MLP with dropout on sklearn's
digits, a shuffling ``StatefulDataLoader``, gradient accumulation 2, a per-step LR schedule,
validations every 6 batches, 3 epochs of 4 optimizer steps), through tests/helpers/lightning_train.py,
which records every batch's loss. Then one chain of starts, each paused at a step's end on every
rank while a signal goes out:

1. USR1 to rank 1 at step 5: both ranks stop after step 6 (mid-epoch 1, a step with a validation
   due), save it, exit 75;
2. the same command resumes from ``LATEST`` mid-epoch, and USR1 to ``resilience run`` at step 7
   stops both after step 8, the last of epoch 1 (saved at the epoch's end);
3. resumed at that epoch boundary, it runs to the end: every batch's loss on both ranks, the
   weights, optimizer, LR scheduler and loop states and both ranks' RNG states equal the
   reference's, bitwise.

Lightning's own signal handlers are never installed: both ranks report the integration's recorder
for USR1 and TERM during training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from resilience import ExitCode
from resilience.checkpoint.layout import LATEST, rank_state_file
from resilience.checkpoint.storage.manifest import validate
from worker_runs import finish, signal_while_paused

pytestmark = pytest.mark.multiproc
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "lightning" / "train.py"
HELPER = REPO / "tests" / "helpers" / "lightning_train.py"
SETTINGS = ["step_scheduler.agreement_every_steps=1"]  # a stop exactly one step after the signal (auto adapts to timings)


def _start(args: list[str], events: Path, env: dict | None = None) -> subprocess.Popen:
    events.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "resilience", "run", "-n", "2", "--pid-file", str(events / "pids"), str(HELPER), str(events), *args, *SETTINGS]
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _preempt(ck: Path, events: Path, pause: int, *, to_launcher: bool = False) -> tuple[int, str]:
    proc = _start([f"checkpoint.checkpoint_dir={ck}"], events, {"PAUSE_AT_STEP": str(pause)})
    return signal_while_paused(proc, events, rank=None if to_launcher else 1)


def _losses(*events: Path, rank: int) -> list:
    return [json.loads(line) for e in events for line in (e / f"losses_{rank}.jsonl").read_text().splitlines()]


def _rank_state(directory: Path, rank: int) -> tuple[dict, dict]:
    path = directory / rank_state_file(rank)
    with safe_open(str(path), framework="pt") as fh:
        meta = {key: json.loads(value) for key, value in fh.metadata().items()}  # the header's key order is not fixed
    return load_file(str(path)), meta


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The reference and the chain of the module docstring; what each left behind."""
    root = tmp_path_factory.mktemp("lightning")
    runs: dict = {"ref": root / "ref", "ck": root / "ck", "events": [root / "e1", root / "e2", root / "e3"]}
    runs["reference"] = finish(_start([f"checkpoint.checkpoint_dir={runs['ref']}"], root / "eref"))
    runs["ref_events"] = root / "eref"
    runs["first"] = _preempt(runs["ck"], root / "e1", pause=5)
    runs["first_latest"] = os.readlink(runs["ck"] / LATEST)
    runs["second"] = _preempt(runs["ck"], root / "e2", pause=7, to_launcher=True)
    runs["second_latest"] = os.readlink(runs["ck"] / LATEST)
    runs["last"] = finish(_start([f"checkpoint.checkpoint_dir={runs['ck']}"], root / "e3"))
    return runs


@pytest.mark.timeout(240)
def test_usr1_stops_both_ranks_at_one_step_and_the_resumes_end_bitwise_equal_to_an_uninterrupted_run(runs):
    code, out = runs["reference"]
    assert code == ExitCode.DONE and out.count("exit 0") == 2, out
    code, out = runs["first"]
    assert code == ExitCode.PREEMPTED and out.count("stop agreed at step 6") == 2 and out.count("exit 75") == 2, out
    assert runs["first_latest"] == "epoch_1_step_6" and not validate(runs["ck"] / "epoch_1_step_6")["meta"]["epoch_complete"]
    code, out = runs["second"]  # USR1 to the launcher: it reaches ranks that are ready
    assert code == ExitCode.PREEMPTED and out.count("stop agreed at step 8") == 2 and "resuming from" in out, out
    meta = validate(runs["ck"] / "epoch_1_step_8")["meta"]
    assert runs["second_latest"] == "epoch_1_step_8" and meta["epoch_complete"] and meta["reason"] == "preemption", meta
    assert meta["parent"]["name"] == "epoch_1_step_6" and meta["producer"] == "lightning.Trainer", meta
    code, out = runs["last"]
    assert code == ExitCode.DONE and out.count("exit 0") == 2 and "epoch_1_step_8 (global step 8)" in out, out
    for rank in (0, 1):
        ours, theirs = _losses(*runs["events"], rank=rank), _losses(runs["ref_events"], rank=rank)
        assert ours == theirs and len(ours) == 24 and ours[-1][0] == 12, (ours, theirs)
    ours, theirs = runs["ck"] / os.readlink(runs["ck"] / LATEST), runs["ref"] / os.readlink(runs["ref"] / LATEST)
    assert ours.name == theirs.name == "epoch_2_step_12"
    a, b = (torch.load(d / "checkpoint.ckpt", weights_only=False) for d in (ours, theirs))
    assert a["state_dict"].keys() == b["state_dict"].keys() and all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    (oa,), (ob,) = a["optimizer_states"], b["optimizer_states"]
    assert oa["param_groups"] == ob["param_groups"] and oa["state"].keys() == ob["state"].keys()
    assert all(torch.equal(oa["state"][i][k], ob["state"][i][k]) for i in oa["state"] for k in oa["state"][i])
    assert a["lr_schedulers"] == b["lr_schedulers"] and a["loops"] == b["loops"] and a["global_step"] == 12
    for rank in (0, 1):
        (ta, ma), (tb, mb) = _rank_state(ours, rank), _rank_state(theirs, rank)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta) and ma == mb, rank


@pytest.mark.timeout(240)
def test_lightnings_own_signal_handling_is_off_and_the_launcher_default_checkpoint_writes_nothing(runs):
    for key in ("reference", "first", "second", "last"):
        out = runs[key][1]
        assert out.count("handlers 0: SignalRecorder SignalRecorder") == out.count("handlers 1: SignalRecorder SignalRecorder") == 1, out
    assert "Trainer's default ModelCheckpoint is off" in runs["reference"][1]
    files = [p.relative_to(runs["ck"]) for p in runs["ck"].rglob("*.ckpt")]  # default_root_dir is the root: no checkpoints/, no hpc_ckpt_N.ckpt
    assert files and all(p.name == "checkpoint.ckpt" and p.parent.name.startswith("epoch_") for p in files), files
    kept = sorted(p.name for p in runs["ck"].iterdir() if p.name.startswith("epoch_"))
    assert kept == ["epoch_1_step_6", "epoch_1_step_8", "epoch_2_step_12"], kept  # max_recent_checkpoints: 3


@pytest.mark.timeout(120)
def test_the_example_runs_as_is_on_one_process_and_its_checkpoint_loads_into_the_module(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for name in [n for n in env if n.startswith(("RESILIENCE_", "SLURM_"))]:
        del env[name]
    overrides = [f"checkpoint.checkpoint_dir={tmp_path / 'ck'}", "training.max_epochs=1", "data.train_samples=64"]
    proc = subprocess.run([sys.executable, str(EXAMPLE), *overrides], env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == ExitCode.DONE and "rank 0: exit 0" in proc.stdout, proc.stdout + proc.stderr
    final = tmp_path / "ck" / os.readlink(tmp_path / "ck" / LATEST)
    assert final.name == "epoch_0_step_2" and validate(final)["meta"]["reason"] == "final"  # 64 samples: 4 batches, 2 steps
    import importlib.util

    spec = importlib.util.spec_from_file_location("lightning_example_train", EXAMPLE)  # not 'train': another example's may be imported already
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.DigitsMLP.load_from_checkpoint(final / "checkpoint.ckpt", hidden=64, dropout=0.2, lr=0.01, weights_only=False)
    saved = torch.load(final / "checkpoint.ckpt", weights_only=False)["state_dict"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
