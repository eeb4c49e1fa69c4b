"""examples/accelerate/train.py as a user runs it: ``resilience run -n 2`` (gloo), USR1 to the
launcher once the first periodic checkpoint is published, exit 75 on both ranks, the same command
again resumes from ``LATEST`` and ends with weights bitwise equal to an uninterrupted run's (the
example prints their digest), in both of Accelerate's loader modes. The loaders' exactness step by
step is ``tests/state/test_accelerate_loaders.py``'s."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilience import ExitCode
from resilience.checkpoint.layout import LATEST

pytestmark = pytest.mark.multiproc
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "accelerate" / "train.py"
LONG = "step_scheduler.num_epochs=10"  # 40 optimizer steps: the signal (after step 6's save) lands well before the end


def _run(ck: Path, stateful: bool, *, stop_after_first_save: bool = False) -> tuple[int, str]:
    """One ``resilience run -n 2`` of the example; with ``stop_after_first_save`` USR1 goes to the
    launcher as soon as ``LATEST`` exists. Returns the exit code and the output."""
    cmd = [sys.executable, "-m", "resilience", "run", "-n", "2", str(EXAMPLE), f"checkpoint.checkpoint_dir={ck}", LONG]
    cmd.append(f"accelerate.use_stateful_dataloader={str(stateful).lower()}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        if stop_after_first_save:
            deadline = time.monotonic() + 90
            while not os.path.lexists(ck / LATEST) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out


def _weights(out: str, code: ExitCode) -> str:
    found = re.findall(rf"^rank 0: exit {int(code)}, weights ([0-9a-f]+)$", out, re.MULTILINE)
    assert len(found) == 1, out[-3000:]
    return found[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """The uninterrupted run's weights digest, with the plain loader: both modes draw the same order
    (the sampler's synchronized generator), so each must end bitwise equal to it."""
    code, out = _run(tmp_path_factory.mktemp("reference"), stateful=False)
    assert code == ExitCode.DONE, out[-3000:]
    return _weights(out, ExitCode.DONE)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stateful", [True, False], ids=["stateful-loader", "plain-loader"])
def test_the_example_preempted_through_the_launcher_resumes_to_the_uninterrupted_weights(tmp_path, reference, stateful):

    ck = tmp_path / "preempted"
    code, out = _run(ck, stateful, stop_after_first_save=True)
    assert code == ExitCode.PREEMPTED, out[-3000:]  # not 0: the signal came before the end
    stopped = os.readlink(ck / LATEST)  # the agreed step's checkpoint (a periodic save the stop fell on, or its own)
    assert out.count("exiting for requeue") == 2 and not stopped.endswith("_step_40"), out[-3000:]
    code, out = _run(ck, stateful)
    assert code == ExitCode.DONE and f"resumed from {ck / stopped}" in out, out[-3000:]
    assert _weights(out, ExitCode.DONE) == reference
