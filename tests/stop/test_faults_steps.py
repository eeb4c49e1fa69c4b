"""An exception in the middle of a step (after backward, before the optimizer step) on one rank:
no checkpoint of that step (or any later one) is published, every rank exits FAILED (1) within
a bound, the next start resumes from the last complete checkpoint exactly, and the Slurm
template does not requeue a job whose ranks exited 1.

Real processes (2 ranks, gloo, DDP) through ``resilience.launch.launch``; the template's exit
code ``case`` statement is run by bash with ``scontrol``/``sbatch`` replaced by recorders.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilience import ExitCode
from resilience.checkpoint.storage.manifest import validate
from resilience.config import load_config
from resilience.launch import launch
from runs import compare

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "phase_train.py"  # 20 steps, a save every 4
EXIT_BOUND_S = 20.0  # the last rank exits at most this long after the first (no rank hangs)


def run_ranks(ckpt: Path, env: dict[str, str] | None = None, timeout: float = 90.0) -> tuple[list[int], float]:
    """Run the helper on 2 ranks; returns their codes and the seconds between the first and the
    last exit. The launcher's failure grace is long, so a hung rank shows as a hang, not a kill."""
    cmd = [sys.executable, str(HELPER), str(ckpt), str(ckpt.parent / f"events-{time.monotonic_ns()}")]
    exited: dict[int, float] = {}
    with launch(cmd, 2, env={"OMP_NUM_THREADS": "1", **(env or {})}, failure_grace_s=120.0) as group:
        deadline = time.monotonic() + timeout
        while len(exited) < 2:
            for rank, code in enumerate(group.returncodes):
                if code is not None and rank not in exited:
                    exited[rank] = time.monotonic()
            assert time.monotonic() < deadline, f"ranks still running after {timeout} s (exited: {sorted(exited)})"
            time.sleep(0.01)
        codes = [proc.returncode for proc in group.procs]
    return codes, max(exited.values()) - min(exited.values())


def steps(ckpt: Path) -> list[int]:
    return sorted(int(p.name.rsplit("_", 1)[1]) for p in ckpt.glob("epoch_*_step_*") if p.is_dir())


def logged_steps(ckpt: Path) -> list[int]:
    return [json.loads(line)["global_step"] for line in (ckpt / "training.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("reference") / "ck"
    codes, _ = run_ranks(ckpt)
    assert codes == [ExitCode.DONE] * 2
    assert steps(ckpt) == [4, 8, 12, 16, 20]
    return ckpt


@pytest.mark.multiproc
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "rank,step,published", [(0, 8, [4]), (1, 8, [4]), (1, 10, [4, 8])], ids=["rank0-at-a-save-step", "rank1-at-a-save-step", "rank1-between-saves"]
)
def test_an_exception_mid_step_publishes_nothing_of_it_and_every_rank_exits_failed(tmp_path, capfd, reference, rank, step, published):
    ckpt = tmp_path / "ck"
    codes, spread = run_ranks(ckpt, env={"RAISE_AT_STEP": str(step), "RAISE_RANK": str(rank)})
    err = capfd.readouterr().err
    assert codes == [ExitCode.FAILED] * 2, (codes, err[-3000:])
    assert spread < EXIT_BOUND_S, f"one rank exited {spread:.1f} s after the other"
    assert f"injected exception in step {step} on rank {rank}" in err
    # nothing of the failed step (or after it) became a checkpoint; LATEST is the last complete one
    assert steps(ckpt) == published
    last = f"epoch_0_step_{published[-1]}"
    assert os.readlink(ckpt / "LATEST") == last
    validate(ckpt / last)
    assert max(logged_steps(ckpt)) <= step, "no step after the failed one ran to its log"

    if (rank, step) == (1, 8):  # the next start resumes from step 4 and ends exactly like the reference
        codes, _ = run_ranks(ckpt)
        assert codes == [ExitCode.DONE] * 2
        assert not list(ckpt.glob(".staging_*")), "a staging directory left by the failed save is removed at the next start"
        result = compare(ckpt, reference)
        assert result.identical and result.steps == 20, result.detail


def _render(requeue: str) -> str:
    try:
        from resilience.slurm.render import render_slurm
    except ImportError as exc:  # the templates module is another engineer's, maybe not there yet
        pytest.skip(f"resilience.slurm.render.render_slurm is not importable yet ({exc})")
    config = load_config(None, ["step_scheduler.preemption_signal=USR1", f"slurm.requeue={requeue}", "slurm.max_restarts=3"])
    return render_slurm(config, config_path="train.yaml")


def _run_case(script: str, rc: int, tmp_path: Path) -> tuple[int, str, list[str]]:
    """Run the script's exit-code ``case`` block with ``rs_rc=rc``: (exit code, output, the
    scontrol/sbatch calls it made)."""
    match = re.search(r"^case \$rs_rc in$.*?^esac$", script, re.MULTILINE | re.DOTALL)
    assert match, "no `case $rs_rc in ... esac` block in the rendered script"
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("scontrol", "sbatch"):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> "{calls}"\necho 4242\n')
        (bin_dir / tool).chmod(0o755)
    calls.unlink(missing_ok=True)
    prelude = "\n".join(
        [
            "rs_reap() { :; }",
            'rs_finish() { echo "finish $1: $2"; exit "$1"; }',
            f"rs_rc={rc} rs_restart=0 rs_max_restarts=3 rs_id=4242 rs_args=()",
            f"SLURM_JOB_ID=4242 RESILIENCE_RUN_ID=r RESILIENCE_STOP_FILE={tmp_path / 'stop'}",
        ]
    )
    proc = subprocess.run(
        ["bash", "-c", prelude + "\n" + match.group(0) + "\necho fell-through; exit 99"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
    )
    return proc.returncode, proc.stdout + proc.stderr, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize("requeue", ["requeue", "resubmit"])
def test_the_slurm_template_does_not_requeue_a_failed_run(tmp_path, requeue):
    script = _render(requeue)
    code, output, calls = _run_case(script, int(ExitCode.FAILED), tmp_path)
    assert (code, calls) == (1, []), f"exit 1 must end the job without a requeue: {output}"
    assert "not requeued" in output
    # the same block does requeue a preempted run: the check above can tell the two apart
    code, output, calls = _run_case(script, int(ExitCode.PREEMPTED), tmp_path)
    assert code == 75 and len(calls) == 1 and calls[0].split()[0] == ("scontrol" if requeue == "requeue" else "sbatch"), (output, calls)
