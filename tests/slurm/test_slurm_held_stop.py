"""A program without ``resilient_loop()`` under the rendered template, on the real local cluster
(issue 23 item 2).

The rank (a stand-in for a Hugging Face ``Trainer`` script, no torch) never handles SIGUSR1 and
never reads the stop file. ``scancel --batch --signal=USR1`` reaches the batch shell, which used to
wait for every rank to handle the signal before passing it to ``resilience run``: the rank trained
to its end and the job completed without ever being stopped. Now the launcher gets it at once,
holds it ``slurm.signal_hold_timeout`` (5 s), delivers it (the default action ends the rank), exits
75 and the script requeues; the second attempt finishes. ``resilience status`` shows the delivery.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from resilience import cli
from slurm_cluster import pid_alive, wait_for

pytestmark = pytest.mark.slurm

TRAIN_S = 60  # what the first attempt would train without the stop (the job's test timeout is shorter)
HOLD_S = 5

# A first attempt "trains" TRAIN_S seconds; a requeued one (SLURM_RESTART_COUNT set) finishes at once.
PROGRAM = f"""
import os, sys, time
attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
open(os.path.join(sys.argv[1], "started.%d" % attempt), "w").close()
if attempt == 0:
    time.sleep({TRAIN_S})
    print("no-loop rank: trained to the end", flush=True)
else:
    print("no-loop rank: attempt %d finished" % (attempt + 1), flush=True)
"""


@pytest.mark.timeout(150)
def test_a_program_without_resilient_loop_gets_the_held_signal_after_the_hold_and_the_job_requeues(slurm_cluster, tmp_path: Path, capsys) -> None:
    program, ckpt = tmp_path / "no_loop.py", tmp_path / "ck"
    program.write_text(PROGRAM)
    config = tmp_path / "job.yaml"
    config.write_text(
        "step_scheduler:\n"
        "  preemption_signal: SIGUSR1\n"
        "checkpoint:\n"
        f"  checkpoint_dir: {ckpt}\n"
        "slurm:\n"
        f"  script: {program}\n"
        f"  script_args: [{tmp_path}]\n"
        f"  python: {sys.executable}\n"
        "  cpus_per_task: 1\n"
        "  time: '10'\n"
        "  signal_lead_s: 60\n"
        f"  signal_hold_timeout: {HOLD_S}\n"
        f"  output: {tmp_path}/out-%j.txt\n"
    )
    script = tmp_path / "job.sub"
    assert cli.main(["template", "slurm", str(config), "-o", str(script)]) == 0
    started = time.monotonic()
    job = slurm_cluster.sbatch(script, cwd=tmp_path)

    def log() -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(tmp_path.glob("out-*.txt")))

    try:
        wait_for(lambda: (tmp_path / "started.0").exists() and "trap installed" in log(), 60, "the rank's start", log)
        slurm_cluster.run(["scancel", "--batch", "--signal=USR1", job])
        signalled = time.monotonic()
        info = slurm_cluster.wait_state(job, "COMPLETED", timeout=90)
    except BaseException:
        slurm_cluster.run(["scancel", job], check=False)
        raise
    text = log()
    print(f"\njob {job}: signalled {signalled - started:.1f} s after sbatch, done {time.monotonic() - signalled:.1f} s later")
    assert "trained to the end" not in text, text
    assert "forwarded to resilience run (pid" in text, text
    assert "warning: ranks [0] never became ready" in text and f"in the {HOLD_S} s the stop was held" in text, text
    assert "preempted (exit 75); requeueing" in text and "attempt 2 finished" in text and "training done; exit 0" in text, text
    assert info["Restarts"] == "1", info
    pids = [int(line.split()[-1]) for f in (tmp_path / ".resilience").glob("*.pids") for line in f.read_text().splitlines() if line.split()]
    assert pids and not [pid for pid in pids if pid_alive(pid) and f"SLURM_JOB_ID={job}".encode() in _environ(pid)], text
    capsys.readouterr()
    assert cli.main(["status", str(ckpt)]) == 0
    status = capsys.readouterr().out
    assert f"Stop signal held by resilience run: SIGUSR1 held {HOLD_S}" in status and "ranks [0]" in status, status


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""
