"""Run an example preempted, resumed and uninterrupted, and compare the runs bitwise.

Shared by ``demo.py`` (``make demo``), ``examples/llm/demo.py`` (which passes its own script,
config and weights reader) and the test suite. Every figure it reports is computed by
comparing files the runs wrote: ``training.jsonl`` (per-step loss and learning rate of rank 0)
and the final checkpoint's model weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from resilience.checkpoint.formats.model_io import model_file
from resilience.checkpoint.layout import LATEST
from resilience.launch import launch

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train.py"
CONFIG = HERE / "digits.yaml"


@dataclasses.dataclass
class RunResult:
    """Exit codes per rank, and the step the signal was sent at (if any)."""

    codes: list[int]
    signalled_at_step: int | None = None


def _rows(ckpt_dir: Path) -> list[dict]:
    path = ckpt_dir / "training.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(
    ckpt_dir: Path,
    nproc: int,
    *,
    overrides: list[str] = (),
    signal_rank: int | None = None,
    signal_at_step: int | None = None,
    sig: int = signal.SIGUSR1,
    timeout: float = 180.0,
    script: Path = TRAIN,
    config: Path = CONFIG,
) -> RunResult:
    """Run the example (``script --config config``; the digits one unless given) with ``nproc`` ranks;
    optionally send ``sig`` to one rank only, once rank 0 has logged ``signal_at_step`` steps.
    Returns each rank's exit code."""
    cmd = [sys.executable, str(script), "--config", str(config), f"checkpoint.checkpoint_dir={ckpt_dir}", *overrides]
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deadline = time.monotonic() + timeout
    sent_at = None
    with launch(cmd, nproc, env=env, failure_grace_s=20.0) as group:
        while group.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{script.parent.name} run in {ckpt_dir} did not finish in {timeout} s")
            if signal_rank is not None and sent_at is None:
                rows = _rows(ckpt_dir)
                if rows and rows[-1]["global_step"] >= signal_at_step:
                    group.send_signal(sig, ranks=[signal_rank])
                    sent_at = rows[-1]["global_step"]
            time.sleep(0.005)
        codes = [proc.returncode for proc in group.procs]
    return RunResult(codes=codes, signalled_at_step=sent_at)


def run_cli(
    ckpt_dir: Path,
    nproc: int,
    *,
    overrides: list[str] = (),
    signal_rank: int | None = None,
    signal_at_step: int | None = None,
    sig: int = signal.SIGUSR1,
    timeout: float = 180.0,
    script: Path = TRAIN,
    config: Path = CONFIG,
) -> RunResult:
    """:func:`run` through the command itself: ``resilience run --nproc-per-node nproc script
    --config config ...``. A signal for one rank goes to that rank's pid (from the launcher's
    ``--pid-file``); each rank's exit code is read from the launcher's last line (``ranks exited
    with [...]``). The launcher's and ranks' stderr is passed on once the run ended."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.parent.mkdir(parents=True, exist_ok=True)
    pid_file, err_file = ckpt_dir.parent / f".{ckpt_dir.name}.pids", ckpt_dir.parent / f".{ckpt_dir.name}.stderr"
    pid_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "resilience", "run", "--nproc-per-node", str(nproc), "--pid-file", str(pid_file)]
    cmd += [str(script), "--config", str(config), f"checkpoint.checkpoint_dir={ckpt_dir}", *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    deadline = time.monotonic() + timeout
    sent_at = None
    with open(err_file, "w") as err, subprocess.Popen(cmd, env=env, stderr=err) as launcher:
        try:
            while launcher.poll() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{script.parent.name} run in {ckpt_dir} did not finish in {timeout} s")
                if signal_rank is not None and sent_at is None:
                    rows = _rows(ckpt_dir)
                    if rows and rows[-1]["global_step"] >= signal_at_step:
                        pids = dict(line.split()[1:] for line in pid_file.read_text().splitlines() if line.startswith("rank "))
                        os.kill(int(pids[str(signal_rank)]), sig)
                        sent_at = rows[-1]["global_step"]
                time.sleep(0.005)
        finally:
            if launcher.poll() is None:
                launcher.terminate()  # the launcher stops its ranks
    text = err_file.read_text()
    sys.stderr.write(text)
    err_file.unlink()
    pid_file.unlink(missing_ok=True)
    found = re.findall(r"ranks exited with \[([^\]]*)\]", text)
    codes = [int(c) for c in found[-1].split(",")] if found else [launcher.returncode]
    return RunResult(codes=codes, signalled_at_step=sent_at)


@dataclasses.dataclass
class Comparison:
    """Per-step losses, learning rates and final weights of two runs, compared exactly."""

    steps: int
    losses_equal: bool
    lrs_equal: bool
    weights_equal: bool
    detail: str = ""

    @property
    def identical(self) -> bool:
        """True only when every compared quantity is bitwise equal."""
        return self.steps > 0 and self.losses_equal and self.lrs_equal and self.weights_equal


def final_weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """The model weights of the checkpoint ``LATEST`` points at."""
    return load_file(str(ckpt_dir / LATEST / model_file()))


def compare(run_dir: Path, reference_dir: Path, weights=final_weights) -> Comparison:
    """Compare a (preempted and resumed) run with an uninterrupted reference run, bitwise;
    ``weights(ckpt_dir)`` reads the final weights of a run (``{name: tensor}``)."""
    rows, ref = _rows(run_dir), _rows(reference_dir)
    steps_a = [r["global_step"] for r in rows]
    steps_b = [r["global_step"] for r in ref]
    detail = []
    if steps_a != steps_b:
        detail.append(f"step sequences differ ({len(steps_a)} vs {len(steps_b)} rows)")
    losses_equal = steps_a == steps_b and all(a["loss"] == b["loss"] for a, b in zip(rows, ref))
    lrs_equal = steps_a == steps_b and all(a["lr"] == b["lr"] for a, b in zip(rows, ref))
    if not losses_equal and steps_a == steps_b:
        first = next(a["global_step"] for a, b in zip(rows, ref) if a["loss"] != b["loss"])
        detail.append(f"losses first differ at step {first}")
    wa, wb = weights(run_dir), weights(reference_dir)
    weights_equal = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    if not weights_equal:
        detail.append("final weights differ")
    return Comparison(len(rows), losses_equal, lrs_equal, weights_equal, "; ".join(detail))


def latest_name(ckpt_dir: Path) -> str | None:
    """Name of the checkpoint ``LATEST`` points at."""
    link = ckpt_dir / LATEST
    return os.readlink(link) if link.is_symlink() else None
