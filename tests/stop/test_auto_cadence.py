"""``agreement_every_steps: auto`` in a real 2-rank run: the cadence follows the measured step
time on both ranks alike, and a signal to one rank still stops both at one step, soon."""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from resilience.exit_codes import ExitCode
from resilience.launch import launch

TINY = Path(__file__).resolve().parents[1] / "helpers" / "tiny_train.py"

pytestmark = pytest.mark.multiproc


def _rows(ckpt: Path) -> list[dict]:
    log = ckpt / "training.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []


@pytest.mark.timeout(120)
def test_auto_cadence_adapts_and_a_signal_to_one_rank_stops_both(tmp_path, capfd):
    ckpt = tmp_path / "ck"
    cmd = [
        sys.executable,
        str(TINY),
        str(ckpt),
        "step_scheduler.num_epochs=10",
        "step_scheduler.agreement_every_steps=auto",
        "step_scheduler.agreement_interval_s=0.05",
    ]
    env = {"OMP_NUM_THREADS": "1", "SLEEP_PER_STEP_S": "0.005"}  # ~6 ms steps: auto picks k of about 8
    with launch(cmd, 2, env=env, failure_grace_s=30.0) as group:
        deadline = time.monotonic() + 60
        while len(_rows(ckpt)) < 60 and time.monotonic() < deadline:
            time.sleep(0.02)
        signalled_after = len(_rows(ckpt))
        assert signalled_after >= 60, "training did not get going"
        group.procs[1].send_signal(signal.SIGUSR1)  # one rank only
        group.wait(timeout=60)
        codes = [p.returncode for p in group.procs]
    assert codes == [ExitCode.PREEMPTED] * 2
    err = capfd.readouterr().err
    stops = re.findall(r"rank (\d): stop agreed at step (\d+) \(agreement every (\d+) step", err)
    assert len(stops) == 2, err[-3000:]
    (_, step0, k0), (_, step1, k1) = stops
    assert step0 == step1 and k0 == k1, stops  # one stop step, one cadence, on both ranks
    step, k = int(step0), int(k0)
    print(f"signalled after step {signalled_after}, stopped at {step}, auto cadence {k}")
    assert 3 <= k <= 30, f"auto cadence {k} for ~6 ms steps and a 0.05 s interval"
    assert step < 400, "stopped before the end of training"
    # the signal reached rank 1 after its step `signalled_after` (rank 0 logs a little behind)
    assert signalled_after < step <= signalled_after + 2 * k + 5
