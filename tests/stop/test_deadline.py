"""Deadline-aware stopping, the lead-time warning and the requeue-loop guard."""

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

from resilience import ExitCode
from resilience.checkpoint.policy import progress_guard
from resilience.checkpoint.storage.manifest import validate
from resilience.launch import launch
from resilience.timing import RunTimer, lead_time_warning, must_stop
from runs import final_weights
from tiny_runs import train_xy

TINY = Path(__file__).resolve().parents[1] / "helpers" / "tiny_train.py"


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_run_timer_averages_steps_after_the_first_and_counts_saves():
    clock = FakeClock()
    timer = RunTimer(alpha=0.5, clock=clock)
    for dt in (5.0, 1.0, 1.0, 3.0):  # the first interval (warm-up) is not counted
        clock.now += dt
        timer.boundary()
    assert timer.step_s == pytest.approx(2.0)  # 1, then (1+1)/2=1, then (1+3)/2=2
    timer.record_save(4.0)
    clock.now += 1.0
    timer.boundary()  # the step after a save is timed from the save's end
    assert timer.save_s == 4.0 and timer.step_s == pytest.approx(1.5)


@pytest.mark.parametrize(
    "left,step_s,save_s,k,safety,expected",
    [
        (100.0, 1.0, 10.0, 1, 1.5, False),  # needs (1 + 10) * 1.5 = 16.5 s
        (16.6, 1.0, 10.0, 1, 1.5, False),
        (16.5, 1.0, 10.0, 1, 1.5, True),
        (16.0, 1.0, 10.0, 1, 1.5, True),
        (20.0, 1.0, 10.0, 4, 1.0, False),  # k=4: up to 7 more steps + one save = 17 s
        (17.0, 1.0, 10.0, 4, 1.0, True),
        (17.1, 1.0, 10.0, 4, 1.0, False),
        (5.0, 1.0, None, 1, 1.5, False),  # an untimed save counts as one step: (1 + 1) * 1.5 = 3 s
        (3.0, 1.0, None, 1, 1.5, True),
        (None, 1.0, 10.0, 1, 1.5, False),  # no known end: never
        (1.0, None, 10.0, 1, 1.5, False),  # no step timed yet: never
    ],
)
def test_must_stop_with_a_fake_clock(left, step_s, save_s, k, safety, expected):
    now = 5000.0
    end = None if left is None else now + left
    assert must_stop(now, end, step_s, save_s, agreement_every_steps=k, safety=safety) is expected


def test_lead_time_warning_fires_only_when_the_lead_is_too_short():
    assert lead_time_warning(300, 2.0, 60.0) is None  # needs (2 + 60) * 1.5 = 93 s
    warning = lead_time_warning(60, 2.0, 60.0)
    assert warning and "93" in warning and "signal_lead_s" in warning
    assert lead_time_warning(1, None, None) is None  # nothing timed yet: no verdict


def _loop(tmp_path, batches=30, **step_scheduler):
    cfg = {"checkpoint": {"checkpoint_dir": str(tmp_path)}, "step_scheduler": {"ckpt_every_steps": 5, **step_scheduler}}
    return train_xy(cfg, batches=batches)


def test_lead_time_warning_in_the_loop_after_the_first_save(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RESILIENCE_SIGNAL_LEAD_S", "0.0000001")
    with caplog.at_level(logging.WARNING, logger="resilience"):
        _loop(tmp_path / "short")
    assert any("signal_lead_s" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.setenv("RESILIENCE_SIGNAL_LEAD_S", "3600")
    with caplog.at_level(logging.WARNING, logger="resilience"):
        _loop(tmp_path / "long")
    assert not any("signal_lead_s" in r.getMessage() for r in caplog.records)


def test_requeue_loop_guard_counts_failed_and_cleanly_preempted_starts_apart(tmp_path):
    counts = [progress_guard.count_start(tmp_path, None)["failed"] for _ in range(3)]
    assert counts == [0, 1, 2], "a start that never reported a clean end is a failed one"
    progress_guard.record_clean_stop(tmp_path, None)  # the 3rd ended with an agreed stop
    doc = progress_guard.count_start(tmp_path, None)
    assert (doc["failed"], doc["preempted"]) == (2, 1)
    assert progress_guard.count_start(tmp_path, "epoch_0_step_5")["failed"] == 0, "a new checkpoint resets the count"
    assert progress_guard.verdict(2, 9, 3, 10) is None
    assert "max_restarts_without_progress: 3" in progress_guard.verdict(3, 0, 3, 10)
    assert "max_preemptions_without_progress: 10" in progress_guard.verdict(0, 10, 3, 10)
    assert progress_guard.verdict(100, 100, None, None) is None


def _start(ckpt, stop, *overrides, env=()) -> int:
    """One real start of tiny_train.py; a ``stop`` file that exists stops it before its first step."""
    cmd = [sys.executable, str(TINY), str(ckpt), *overrides]
    with launch(cmd, 1, env={"RANK": "0", "WORLD_SIZE": "1", "RESILIENCE_STOP_FILE": str(stop), **dict(env)}) as group:
        return group.wait(timeout=60)


@pytest.mark.timeout(300)
def test_five_starts_preempted_before_the_first_step_do_not_trip_the_guard_and_the_sixth_trains(tmp_path):
    """Clean preemptions (exit 75 from an agreed stop) are not failures: with the default limits
    five starts in a row stopped before their first step are followed by a start that trains."""
    stop = tmp_path / "stop"
    stop.touch()
    codes = [_start(tmp_path / "ck", stop) for _ in range(5)]
    assert codes == [ExitCode.PREEMPTED] * 5
    guard = progress_guard.read(tmp_path / "ck")
    assert (guard["failed"], guard["preempted"], guard["running"]) == (0, 5, False)
    stop.unlink()
    assert _start(tmp_path / "ck", stop) == ExitCode.DONE
    assert (tmp_path / "ck" / "epoch_0_step_40").is_dir()


@pytest.mark.timeout(300)
def test_a_run_that_keeps_being_preempted_before_it_can_save_exits_no_progress(tmp_path):
    """Each start is stopped before its first step (a stop file, as a batch script writes it on
    an early signal): no new checkpoint ever, so past max_preemptions_without_progress the next
    start ends with NO_PROGRESS."""
    stop = tmp_path / "stop"
    stop.touch()
    codes = [_start(tmp_path / "ck", stop, "checkpoint.max_preemptions_without_progress=2") for _ in range(3)]
    assert codes == [ExitCode.PREEMPTED, ExitCode.PREEMPTED, ExitCode.NO_PROGRESS]


@pytest.mark.timeout(300)
def test_starts_that_crash_before_a_checkpoint_still_trip_the_guard_and_a_preemption_between_does_not_reset_it(tmp_path):
    """A start that raises (exit 1) before any checkpoint is a failed one; a clean preemption
    between two of them neither counts as one nor resets the count: with
    max_restarts_without_progress=2 the start after two crashes exits NO_PROGRESS without training."""
    ckpt, stop = tmp_path / "ck", tmp_path / "stop"
    limit = "checkpoint.max_restarts_without_progress=2"
    crash = {"RAISE_AT_STEP": "3", "RAISE_RANK": "0"}
    codes = [_start(ckpt, stop, limit, env=crash)]
    stop.touch()
    codes.append(_start(ckpt, stop, limit, env=crash))
    stop.unlink()
    codes += [_start(ckpt, stop, limit, env=crash), _start(ckpt, stop, limit)]
    assert codes == [ExitCode.FAILED, ExitCode.PREEMPTED, ExitCode.FAILED, ExitCode.NO_PROGRESS]
    assert not list(ckpt.glob("epoch_*"))


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_a_wall_time_just_over_k_steps_stops_and_saves_before_the_end_and_resumes_exactly(tmp_path):
    # Only the run with the wall time sleeps in its steps: the reference and the resume have no
    # deadline, and their weights do not depend on how long a step takes (~6 s less to wait).
    env = {"OMP_NUM_THREADS": "1"}
    common = ["step_scheduler.ckpt_every_steps=1000"]
    with launch([sys.executable, str(TINY), str(tmp_path / "ref"), *common], 2, env=env) as group:
        assert group.wait(timeout=120) == ExitCode.DONE

    # 40 steps of ~0.1 s take ~4 s; a 2 s wall time ends well before that
    cut = [*common, "step_scheduler.wall_time_s=2.0"]
    with launch([sys.executable, str(TINY), str(tmp_path / "ck"), *cut], 2, env={**env, "SLEEP_PER_STEP_S": "0.1"}) as group:
        assert group.wait(timeout=120) == ExitCode.PREEMPTED
    latest = validate(tmp_path / "ck" / "LATEST")["meta"]
    assert latest["reason"] == "preemption" and 5 <= latest["global_step"] < 40
    rows = [json.loads(line) for line in (tmp_path / "ck" / "training.jsonl").read_text().splitlines()]
    assert rows[-1]["global_step"] == latest["global_step"], "no step ran after the deadline stop"

    with launch([sys.executable, str(TINY), str(tmp_path / "ck"), *common], 2, env=env) as group:
        assert group.wait(timeout=120) == ExitCode.DONE
    mine, ref = final_weights(tmp_path / "ck"), final_weights(tmp_path / "ref")
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in mine)
