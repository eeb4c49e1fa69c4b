"""The Hugging Face ``Trainer`` under ``resilience.integrations.transformers.train``: real processes,
2 gloo ranks under ``resilience run``, ``trainer.train()`` kept.

examples/hf_trainer/train.py as is is the reference (a tiny GPT-2 with dropout, gradient
accumulation 2, an eval every 3 steps, 3 epochs of 4 optimizer steps). Then one chain of starts,
each paused at the end of a step on every rank while a test signal goes out
(tests/helpers/hf_trainer_train.py):

1. USR1 to rank 1 at step 2: both ranks stop after step 3 (mid-epoch, an eval step), save it, exit 75;
2. the same command resumes from ``LATEST`` (mid-epoch), crosses an epoch boundary, and USR1 to
   ``resilience run`` itself at step 7 stops both after step 8, the last of epoch 1;
3. resumed at that epoch boundary, a stop at step 10 whose save is SIGKILLed on rank 0 before
   the manifest: ``LATEST`` still names step 8;
4. resumed from step 8 again, it runs to the end: losses, learning rates, grad norms, eval
   losses, weights, optimizer, scheduler and RNG states equal the reference's, bitwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from resilience import ExitCode
from resilience.checkpoint.layout import LATEST
from resilience.checkpoint.storage.manifest import validate
from resilience.cli import main as cli
from worker_runs import finish, signal_while_paused

pytestmark = pytest.mark.multiproc
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "hf_trainer" / "train.py"
HELPER = REPO / "tests" / "helpers" / "hf_trainer_train.py"
SETTINGS = ["step_scheduler.agreement_every_steps=1"]  # a stop exactly one step after the signal (auto adapts to timings)
TIMED = ("runtime", "per_second")  # log_history keys that measure time


def _start(script: Path, args: list[str], events: Path, env: dict | None = None) -> subprocess.Popen:
    events.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "resilience", "run", "-n", "2", "--pid-file", str(events / "pids"), str(script), *args]
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _preempt(ck: Path, events: Path, pause: int, *, to_launcher: bool = False, env: dict | None = None) -> tuple[int, str]:
    """A start of the helper paused at the end of step ``pause`` on both ranks while USR1 goes to
    rank 1 (or to ``resilience run``, which forwards it to the ranks that are ready), then released."""
    proc = _start(HELPER, [str(events), f"checkpoint.checkpoint_dir={ck}", *SETTINGS], events, {"PAUSE_AT_STEP": str(pause), **(env or {})})
    return signal_while_paused(proc, events, rank=None if to_launcher else 1)


def _meta(directory: Path) -> dict:
    return validate(directory)["meta"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, str]:
    """The example, uninterrupted: (its checkpoint root, its output)."""
    root = tmp_path_factory.mktemp("reference")
    code, out = finish(_start(EXAMPLE, [f"checkpoint.checkpoint_dir={root / 'ck'}", *SETTINGS], root / "events"))
    assert code == ExitCode.DONE, out
    return root / "ck", out


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict:
    """The four starts of the module docstring on one checkpoint root; what each left behind."""
    root = tmp_path_factory.mktemp("chain")
    ck = root / "ck"
    runs: dict = {"ck": ck}
    runs["first"] = _preempt(ck, root / "e1", pause=2)
    runs["first_latest"] = os.readlink(ck / LATEST)
    runs["second"] = _preempt(ck, root / "e2", pause=7, to_launcher=True)
    runs["second_latest"] = os.readlink(ck / LATEST)
    runs["killed"] = _preempt(ck, root / "e3", pause=9, env={"KILL_PHASE": "manifest"})
    runs["killed_entries"] = sorted(p.name for p in ck.iterdir())
    runs["killed_latest"] = os.readlink(ck / LATEST)
    runs["last"] = finish(_start(HELPER, [str(root / "e4"), f"checkpoint.checkpoint_dir={ck}", *SETTINGS], root / "e4"))
    return runs


@pytest.mark.timeout(180)
def test_the_example_trains_to_the_end_and_publishes_a_checkpoint_from_pretrained_loads(reference):
    from transformers import GPT2LMHeadModel

    ck, out = reference
    assert out.count(f"exit {int(ExitCode.DONE)}") == 2, out
    final = ck / os.readlink(ck / LATEST)
    meta = _meta(final)
    assert final.name == "epoch_2_step_12" and meta["reason"] == "final" and meta["producer"] == "transformers.Trainer", meta
    assert meta["val_metric"]["key"] == "eval_loss" and (ck / "LOWEST_VAL").exists(), meta
    model = GPT2LMHeadModel.from_pretrained(final)
    saved = load_file(final / "model.safetensors")
    assert all(torch.equal(model.state_dict()[key], tensor) for key, tensor in saved.items())


@pytest.mark.timeout(360)
def test_usr1_stops_both_ranks_at_one_step_and_the_resumes_end_bitwise_equal_to_an_uninterrupted_run(reference, chain):
    ck = chain["ck"]
    code, out = chain["first"]
    assert code == ExitCode.PREEMPTED and out.count("stop agreed at step 3") == 2 and out.count("exit 75") == 2, out
    assert chain["first_latest"] == "epoch_0_step_3"
    code, out = chain["second"]  # USR1 to the launcher: it reaches ranks that are ready (the integration said so)
    assert code == ExitCode.PREEMPTED and out.count("stop agreed at step 8") == 2, out
    assert chain["second_latest"] == "epoch_1_step_8"
    meta = _meta(ck / "epoch_1_step_8")
    assert meta["reason"] == "preemption" and meta["epoch_complete"] and meta["parent"]["name"] == "epoch_0_step_3", meta
    code, out = chain["last"]
    assert code == ExitCode.DONE and out.count("exit 0") == 2, out
    ours, theirs = ck / os.readlink(ck / LATEST), reference[0] / os.readlink(reference[0] / LATEST)
    assert ours.name == theirs.name == "epoch_2_step_12"
    history = [json.loads((d / "trainer_state.json").read_text())["log_history"] for d in (ours, theirs)]
    untimed = [[{k: v for k, v in row.items() if not k.endswith(TIMED)} for row in rows] for rows in history]
    assert untimed[0] == untimed[1] and sum("eval_loss" in row for row in untimed[0]) == 4, untimed
    assert [row["step"] for row in untimed[0] if "loss" in row] == list(range(1, 13))
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


@pytest.mark.timeout(360)
def test_a_sigkill_during_the_save_leaves_the_previous_latest_and_the_next_start_resumes_from_it(chain):
    code, out = chain["killed"]  # resilience run exits 75 for a rank that died: the next start resumes from LATEST
    assert "rank 0 exited with signal SIGKILL" in out and "its checkpoint is published" not in out and "exit 75" not in out, out
    assert chain["killed_latest"] == "epoch_1_step_8" and ".staging_epoch_2_step_10" in chain["killed_entries"], chain["killed_entries"]
    code, out = chain["last"]
    assert "resuming from" in out and "epoch_1_step_8 (global step 8)" in out, out
    assert not (chain["ck"] / ".staging_epoch_2_step_10").exists()  # removed at that start


@pytest.mark.timeout(120)
def test_status_verify_and_advise_read_the_trainer_checkpoints(chain, capsys, tmp_path):
    ck = chain["ck"]
    assert cli(["status", str(ck)]) == 0
    status = capsys.readouterr().out
    assert "transformers.Trainer" in status and "epoch_2_step_12" in status and "Resume would pick: epoch_2_step_12" in status, status
    assert cli(["verify", str(ck)]) == 0
    verified = capsys.readouterr().out
    assert "epoch_1_step_8: ok" in verified and "transformers.Trainer" in verified, verified
    torn = shutil.copytree(ck / "epoch_1_step_8", tmp_path / "epoch_1_step_8")
    (torn / "optimizer.pt").write_bytes(b"torn")
    assert cli(["verify", str(torn)]) == 1
    assert "optimizer.pt" in capsys.readouterr().out
    assert cli(["advise", str(ck)]) == 0
    assert "--signal=B:USR1@" in capsys.readouterr().out
