"""Signals at every phase of a 2-rank run: each one stops every rank at one step, saves at most
once, and exits with the code the batch script acts on.

Real processes, real signals, real files. Each rank is started by its own launcher
(``launch(..., nnodes=2, node_rank=r)``), so a stop requested through one launcher reaches one
rank only, as when Slurm signals one node's batch shell; "all" requests it through both. The
helper ``helpers/phase_train.py`` pauses every rank at a named phase until the test, having
signalled, releases it, so each signal lands in the phase the test names.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from resilience import ExitCode
from resilience.checkpoint.storage.manifest import validate
from resilience.launch import launch, resolve_master_port
from runs import compare

pytestmark = pytest.mark.multiproc
HELPER = Path(__file__).resolve().parents[1] / "helpers" / "phase_train.py"
STEPS = 20  # 2 epochs x 10 steps per rank; a save every 4 steps, evaluation every 5
ONE, ALL = (1,), (0, 1)


class TwoNodeRun:
    """Ranks 0 and 1 of one run, each under its own launcher (a one-rank "node")."""

    def __init__(self, ckpt: Path, events: Path, pause_at=(), overrides=()):
        self.ckpt, self.events_dir = ckpt, events
        cmd = [sys.executable, str(HELPER), str(ckpt), str(events), *overrides]
        env = {"OMP_NUM_THREADS": "1", "PAUSE_AT": ",".join(pause_at)}
        port = resolve_master_port(None, {})  # a port free on this machine now
        self._stack = contextlib.ExitStack()
        self.groups = [self._stack.enter_context(launch(cmd, 1, nnodes=2, node_rank=r, master_port=port, env=env, kill_grace_s=2.0)) for r in (0, 1)]

    def events(self, rank: int) -> list[str]:
        path = self.events_dir / f"rank_{rank}.events"
        return path.read_text().splitlines() if path.exists() else []

    def _poll(self) -> list[int | None]:
        return [group.poll() for group in self.groups]  # also releases signals a launcher holds

    def wait_for(self, line: str, ranks=ALL, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(line in self.events(r) for r in ranks):
            codes = self._poll()
            if any(code is not None for code in codes) or time.monotonic() > deadline:
                raise AssertionError(f"never saw {line!r} on ranks {ranks} (codes {codes}): {[self.events(r) for r in (0, 1)]}")
            time.sleep(0.005)

    def stop(self, sig: int, ranks) -> list[tuple[list[int], list[int]]]:
        """A stop request through the launchers of ``ranks``: (signalled, held) per launcher."""
        return [self.groups[r].request_stop(sig) for r in ranks]

    def release(self, tag: str) -> None:
        (self.events_dir / f"release_{tag}").touch()

    def finish(self, timeout: float = 60.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while None in self._poll():
            if time.monotonic() > deadline:
                raise AssertionError(f"the ranks did not exit within {timeout} s: {[self.events(r) for r in (0, 1)]}")
            time.sleep(0.01)
        self._stack.close()
        return [group.procs[0].returncode for group in self.groups]

    def __enter__(self) -> TwoNodeRun:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()  # kills and reaps whatever still runs


def run_to_end(ckpt: Path, events: Path, overrides=()) -> list[int]:
    with TwoNodeRun(ckpt, events, overrides=overrides) as run:
        return run.finish()


def checkpoints(ckpt: Path) -> list[int]:
    """Global steps of the published checkpoints, ascending."""
    return sorted(int(p.name.rsplit("_", 1)[1]) for p in ckpt.glob("epoch_*_step_*") if p.is_dir())


def latest(ckpt: Path) -> tuple[str, dict]:
    """LATEST's target and its (checksum-validated) manifest meta."""
    name = os.readlink(ckpt / "LATEST")
    return name, validate(ckpt / name)["meta"]


def logged_steps(ckpt: Path) -> list[int]:
    path = ckpt / "training.jsonl"
    return [json.loads(line)["global_step"] for line in path.read_text().splitlines()] if path.exists() else []


def saves(run: TwoNodeRun, rank: int) -> list[str]:
    return [line for line in run.events(rank) if line.startswith("save_begin")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run: what every resumed run must equal bitwise."""
    base = tmp_path_factory.mktemp("reference")
    assert run_to_end(base / "ck", base / "ev") == [ExitCode.DONE] * 2
    assert checkpoints(base / "ck") == [4, 8, 12, 16, 20]
    return base / "ck"


@pytest.fixture(scope="module")
def preempted(tmp_path_factory) -> Path:
    """A run preempted by USR1 on both ranks during step 6: LATEST is the checkpoint of step 7."""
    base = tmp_path_factory.mktemp("preempted")
    with TwoNodeRun(base / "ck", base / "ev", pause_at=["step:6"]) as run:
        run.wait_for("pause step:6")
        run.stop(signal.SIGUSR1, ALL)
        run.release("step:6")
        assert run.finish() == [ExitCode.PREEMPTED] * 2
    name, meta = latest(base / "ck")
    assert (name, meta["reason"]) == ("epoch_0_step_7", "preemption"), "a signal in step t stops after step t + 1 (k = 1)"
    return base / "ck"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("ranks", [ONE, ALL], ids=["rank1", "all-ranks"])
def test_a_stop_during_model_building_is_held_by_the_launcher_and_stops_before_the_first_step(tmp_path, ranks):
    with TwoNodeRun(tmp_path / "ck", tmp_path / "ev", pause_at=["build"]) as run:
        run.wait_for("pause build")
        for signalled, held in run.stop(signal.SIGUSR1, ranks):
            assert (signalled, held) == ([], [0]), "a rank without its handlers must not get the signal yet"
        run.release("build")
        codes = run.finish()
        assert codes == [ExitCode.PREEMPTED] * 2, (codes, run.events(0), run.events(1))
        for r in (0, 1):
            assert saves(run, r) == [], "nothing new to save before the first step"
    assert checkpoints(tmp_path / "ck") == [] and not (tmp_path / "ck" / "LATEST").exists()
    assert logged_steps(tmp_path / "ck") == [], "no step ran"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks", [(0,), ALL], ids=["rank0", "all-ranks"])
def test_a_stop_during_resume_loading_stops_before_the_first_step_and_saves_nothing(tmp_path, preempted, reference, ranks):
    ckpt = tmp_path / "ck"
    shutil.copytree(preempted, ckpt, symlinks=True)
    manifest = (ckpt / "epoch_0_step_7" / "manifest.json").read_bytes()
    with TwoNodeRun(ckpt, tmp_path / "ev", pause_at=["load"]) as run:
        run.wait_for("pause load")
        run.stop(signal.SIGUSR1, ranks)
        run.release("load")
        assert run.finish() == [ExitCode.PREEMPTED] * 2
        assert saves(run, 0) == saves(run, 1) == []
    assert checkpoints(ckpt) == [4, 7] and latest(ckpt)[0] == "epoch_0_step_7"
    assert (ckpt / "epoch_0_step_7" / "manifest.json").read_bytes() == manifest, "LATEST's checkpoint is untouched"
    assert logged_steps(ckpt)[-1] == 7

    if ranks == ALL:  # the checkpoint does not depend on which rank got the signal: resume once
        assert run_to_end(ckpt, tmp_path / "ev2") == [ExitCode.DONE] * 2
        result = compare(ckpt, reference)
        assert result.identical and result.steps == STEPS, result.detail


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks", [ONE, ALL], ids=["rank1", "all-ranks"])
def test_a_stop_during_evaluation_abandons_it_and_saves_the_last_completed_training_step(tmp_path, reference, ranks):
    ckpt = tmp_path / "ck"
    with TwoNodeRun(ckpt, tmp_path / "ev", pause_at=["eval:10"]) as run:
        run.wait_for("pause eval:10")
        run.stop(signal.SIGUSR1, ranks)
        run.release("eval:10")
        assert run.finish() == [ExitCode.PREEMPTED] * 2
        for r in (0, 1):
            assert "eval_abandoned 10" in run.events(r) and "eval_done 10" not in run.events(r)
            assert saves(run, r)[-1] == "save_begin 10 preemption"
    name, meta = latest(ckpt)
    assert (name, meta["global_step"], meta["reason"]) == ("epoch_0_step_10", 10, "preemption")
    assert checkpoints(ckpt) == [4, 8, 10]
    assert logged_steps(ckpt)[-1] == 10
    validation = [json.loads(line)["global_step"] for line in (ckpt / "validation.jsonl").read_text().splitlines()]
    assert validation == [5], "the abandoned evaluation records nothing"

    if ranks == ALL:
        assert run_to_end(ckpt, tmp_path / "ev2") == [ExitCode.DONE] * 2
        result = compare(ckpt, reference)
        assert result.identical and result.steps == STEPS, result.detail


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks", [ONE, ALL], ids=["rank1", "all-ranks"])
def test_a_stop_during_a_save_finishes_that_save_and_exits_without_a_second(tmp_path, reference, ranks):
    ckpt = tmp_path / "ck"
    with TwoNodeRun(ckpt, tmp_path / "ev", pause_at=["save:2"]) as run:
        run.wait_for("pause save:2")  # inside the save of step 8, on both ranks
        run.stop(signal.SIGUSR1, ranks)
        run.release("save:2")
        assert run.finish() == [ExitCode.PREEMPTED] * 2
        for r in (0, 1):
            assert saves(run, r) == ["save_begin 4 periodic", "save_begin 8 periodic"], "no second save of step 8"
    name, meta = latest(ckpt)
    assert (name, meta["reason"]) == ("epoch_0_step_8", "periodic")
    assert checkpoints(ckpt) == [4, 8]
    assert logged_steps(ckpt)[-1] == 8, "no step after the save"

    if ranks == ONE:
        assert run_to_end(ckpt, tmp_path / "ev2") == [ExitCode.DONE] * 2
        result = compare(ckpt, reference)
        assert result.identical and result.steps == STEPS, result.detail


@pytest.mark.timeout(90)
@pytest.mark.parametrize("ranks,step", [(ONE, 19), (ALL, 20)], ids=["rank1-in-step19", "all-ranks-in-step20"])
def test_a_stop_during_the_final_steps_finishes_normally_and_exits_done(tmp_path, reference, ranks, step):
    ckpt = tmp_path / "ck"
    with TwoNodeRun(ckpt, tmp_path / "ev", pause_at=[f"step:{step}"]) as run:
        run.wait_for(f"pause step:{step}")
        run.stop(signal.SIGUSR1, ranks)
        run.release(f"step:{step}")
        assert run.finish() == [ExitCode.DONE] * 2
        for r in (0, 1):
            assert not any("preemption" in line for line in saves(run, r))
    assert checkpoints(ckpt) == [4, 8, 12, 16, 20]
    assert latest(ckpt)[0] == "epoch_1_step_20"
    result = compare(ckpt, reference)
    assert result.identical and result.steps == STEPS, result.detail


@pytest.mark.timeout(120)
@pytest.mark.parametrize("second", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1-then-USR1", "USR1-then-TERM"])
@pytest.mark.parametrize("ranks", [ONE, ALL], ids=["rank1", "all-ranks"])
def test_a_second_signal_during_the_preemption_save_changes_nothing(tmp_path, reference, ranks, second):
    ckpt = tmp_path / "ck"
    with TwoNodeRun(ckpt, tmp_path / "ev", pause_at=["step:6", "save:preemption"]) as run:
        run.wait_for("pause step:6")
        run.stop(signal.SIGUSR1, ranks)
        run.release("step:6")
        run.wait_for("pause save:preemption")  # the first signal's save, on both ranks
        run.stop(second, ranks)
        run.release("save:preemption")
        codes = run.finish()
        assert codes == [ExitCode.PREEMPTED] * 2, "the second signal neither kills a rank nor changes the exit"
        for r in (0, 1):
            assert saves(run, r) == ["save_begin 4 periodic", "save_begin 7 preemption"], "never a second save"
    name, meta = latest(ckpt)
    assert (name, meta["reason"]) == ("epoch_0_step_7", "preemption")
    assert checkpoints(ckpt) == [4, 7] and logged_steps(ckpt)[-1] == 7

    if ranks == ALL and second == signal.SIGTERM:  # the save finished under a second signal resumes exactly
        assert run_to_end(ckpt, tmp_path / "ev2") == [ExitCode.DONE] * 2
        result = compare(ckpt, reference)
        assert result.identical and result.steps == STEPS, result.detail
