"""Hugging Face Accelerate's prepared objects under ``resilient_loop()``.

``accelerator.prepare(model, optimizer, loader)`` on 2 gloo ranks (``Accelerator(cpu=True)``,
``tests/helpers/accelerate_train.py``): USR1 to rank 1 in step 9 (the second epoch's third), every
rank saves the agreed step and exits 75, and the resumed run ends bitwise equal to an uninterrupted
one (losses with dropout, so the global torch RNG too; final weights). The second epoch: the
sampler's generator has moved on by then, which torchdata's state leaves out under Accelerate. A plain prepared ``DataLoader`` has a
``state_dict()`` that raises (no ``dl_state_dict``): it takes the replay path, and says so; one with
``use_stateful_dataloader=True`` saves its own state.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from resilience import ExitCode
from resilience.checkpoint.storage.manifest import validate
from runs import compare, latest_name
from worker_runs import finish, signal_while_paused

pytestmark = pytest.mark.multiproc
HELPER = Path(__file__).resolve().parents[1] / "helpers" / "accelerate_train.py"
PAUSE_STEP, TOTAL_STEPS = 9, 12


def _start(ckpt: Path, events: Path, stateful: bool, pause: int = 0) -> tuple[subprocess.Popen, Path]:
    """``resilience run -n 2`` of the helper; returns the process and its pid file."""
    events.mkdir(parents=True)
    pid_file = events / "pids"
    env = {**os.environ, "STATEFUL": "1" if stateful else "0", "PAUSE_AT_STEP": str(pause), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "resilience", "run", "-n", "2", "--pid-file", str(pid_file), str(HELPER), str(ckpt), str(events)]
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), pid_file


def _preempt_at_pause(ckpt: Path, events: Path, stateful: bool) -> tuple[int, str]:
    """A run paused in step ``PAUSE_STEP`` on every rank while USR1 goes to rank 1 alone."""
    return signal_while_paused(_start(ckpt, events, stateful, pause=PAUSE_STEP)[0], events)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One uninterrupted run with the plain prepared loader: both modes draw the same order (the
    sampler's synchronized generator), so each must train exactly like it."""
    root = tmp_path_factory.mktemp("reference")
    code, out = finish(_start(root / "ck", root / "events", stateful=False)[0])
    assert code == ExitCode.DONE, out
    return root / "ck"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stateful", [False, True], ids=["prepared-DataLoader", "use_stateful_dataloader"])
def test_accelerate_prepared_objects_are_preempted_and_resume_bitwise_exactly(tmp_path, reference, stateful):
    ckpt = tmp_path / "ck"
    code, out = _preempt_at_pause(ckpt, tmp_path / "events", stateful)
    assert code == ExitCode.PREEMPTED and out.count(f"exit {int(ExitCode.PREEMPTED)}") == 2, out
    mode = "from its state_dict()" if stateful else "by replaying its epoch, not from its own state: its state_dict() raised AttributeError"
    assert out.count(f"dataloader: a DataLoaderShard is resumed {mode}") == 2, out
    meta = validate(ckpt / latest_name(ckpt))["meta"]
    assert meta["reason"] == "preemption" and PAUSE_STEP <= meta["global_step"] < TOTAL_STEPS, meta

    code, out = finish(_start(ckpt, tmp_path / "events2", stateful)[0])
    assert code == ExitCode.DONE and "resumed from epoch_1_step_" in out, out
    result = compare(ckpt, reference)
    assert result.identical and result.steps == TOTAL_STEPS, result.detail
