"""The progress record a rank writes (:mod:`resilience.progress`) and the limits the watchdog reads it with."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from resilience.cli.run import main as run_main
from resilience.distributed import collective_timeout_s
from resilience.env_names import COLLECTIVE_TIMEOUT_ENV, PROGRESS_FILE_ENV
from resilience.launch.rank_group import RankGroup
from resilience.launch.watchdog import AUTO_STEP_FLOOR_S, SAVE_FLOOR_S, ProgressTimeout, Report, Watchdog, is_stopped, read_report
from resilience.progress import STEP_BYTES, STEP_OFFSET, ProgressReporter, progress_file, read_finished_step


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_step_reports_are_rate_limited_while_phase_changes_are_written_at_once(tmp_path):
    path, clock = tmp_path / "progress_0", FakeClock()
    reporter = ProgressReporter(str(path), clock=clock)
    reporter.phase("step", 0)
    clock.now += 0.1
    reporter.step(1)  # the first step measured: at once (see below)
    clock.now += 0.1
    reporter.step(2)  # 0.1 s after the last report: not written
    assert read_report(str(path)) == Report("step", 1, pytest.approx(100.1), pytest.approx(0.1), 0.0)
    assert read_finished_step(str(path)) == 2  # the step field is written at every boundary
    clock.now += 0.5
    reporter.step(3)
    assert read_report(str(path)) == Report("step", 3, pytest.approx(100.7), pytest.approx(0.5), 0.0)  # the longest step so far
    clock.now += 0.1
    reporter.phase("saving")  # a phase change: at once
    assert read_report(str(path)).phase == "saving" and read_report(str(path)).t == pytest.approx(100.8)
    clock.now += 3.0
    reporter.saved(3.0)
    clock.now += 0.2
    reporter.step(4)  # the step after the save counts from its end, not across it
    report = read_report(str(path))
    assert (report.phase, report.step, report.max_step_s, report.max_save_s) == ("step", 3, pytest.approx(0.5), 3.0)
    assert path.stat().st_size == STEP_OFFSET + STEP_BYTES and read_finished_step(str(path)) == 4
    reporter.close()
    assert read_report(str(path)).phase == "done"


def test_without_the_launchers_variable_nothing_is_reported():
    reporter = ProgressReporter.from_env({})
    assert not reporter.enabled
    reporter.phase("loading")
    reporter.step(1)
    reporter.close()


def test_a_removed_directory_breaks_no_report(tmp_path):
    folder = tmp_path / "ready"
    folder.mkdir()
    reporter = ProgressReporter.from_env({PROGRESS_FILE_ENV: str(folder / "progress_0")})
    assert reporter.enabled
    reporter.phase("step", 1)
    (folder / "progress_0").unlink()
    folder.rmdir()
    reporter.phase("saving")  # the open file survives; nothing raises
    reporter.close()
    assert not reporter.enabled


@pytest.mark.parametrize("text", ["0", "-3", "soon", "inf", ""])
def test_a_bad_progress_timeout_names_the_option_and_its_forms(text):
    with pytest.raises(ValueError, match=r"--progress-timeout: expected 'auto' or a number of seconds > 0"):
        ProgressTimeout.parse(text)


def test_limits_per_phase_follow_the_reported_step_and_save_times():
    auto, fixed = ProgressTimeout.parse("auto", 600), ProgressTimeout.parse("15", 600)
    first = Report("step", 0, 0.0, 0.0, 0.0)  # no step finished yet since the start
    slow = Report("step", 9, 0.0, 20.0, 50.0)
    assert auto.limit(None) == fixed.limit(None) == auto.limit(first) == fixed.limit(first) == 600
    assert auto.limit(Report("step", 9, 0.0, 0.1, 0.0)) == AUTO_STEP_FLOOR_S
    assert auto.limit(slow) == 100.0 and fixed.limit(slow) == 15
    assert fixed.limit(Report("saving", 9, 0.0, 0.1, 0.0)) == SAVE_FLOOR_S
    assert fixed.limit(Report("saving", 9, 0.0, 0.1, 50.0)) == 250.0
    assert auto.limit(Report("done", 9, 0.0, 0.1, 0.0)) is None
    assert ProgressTimeout.parse("900", 600).collective_s == 900 and auto.collective_s == 600
    # the first step once another local rank has finished one: the step limit
    assert fixed.limit(first, 0.1) == 15 and auto.limit(first, 0.1) == AUTO_STEP_FLOOR_S and auto.limit(first, 30.0) == 150.0


def test_the_collective_timeout_comes_from_the_launcher_else_the_default():
    assert collective_timeout_s(600, {}) == 600
    assert collective_timeout_s(600, {COLLECTIVE_TIMEOUT_ENV: "45"}) == 45
    with pytest.raises(ValueError, match=COLLECTIVE_TIMEOUT_ENV):
        collective_timeout_s(600, {COLLECTIVE_TIMEOUT_ENV: "0"})


def test_a_heartbeat_inside_a_long_step_refreshes_the_time_but_not_the_step(tmp_path):
    path, clock = tmp_path / "progress_0", FakeClock()
    reporter = ProgressReporter(str(path), clock=clock)
    reporter.phase("step", 4)
    clock.now = 100.2
    reporter.heartbeat()  # too soon after the last report: not written
    assert read_report(str(path)).t == 100.0
    clock.now = 100.6
    reporter.heartbeat()
    assert read_report(str(path)) == Report("step", 4, 100.6, 0.0, 0.0)


def test_the_end_of_the_first_step_after_a_start_is_reported_at_once(tmp_path):
    """The resume's record (no step finished: the start-up limit) must not outlive the first step
    by the rate limit's 0.5 s: a hang two steps after a resume would be watched with 600 s."""
    path, clock = tmp_path / "progress_0", FakeClock()
    reporter = ProgressReporter(str(path), clock=clock)
    reporter.phase("step", 5)  # resumed at step 5
    clock.now += 0.05
    reporter.step(6)
    assert read_report(str(path)) == Report("step", 6, 100.05, pytest.approx(0.05), 0.0)
    clock.now += 0.05
    reporter.step(7)  # later steps: rate-limited again
    assert read_report(str(path)).step == 6


@pytest.fixture
def sleeping_pair(tmp_path):
    """Two real processes as local ranks 0 and 1 of a RankGroup reporting into ``tmp_path / "ready"``:
    (group, a reporter per rank, the fake clock both the reporters and the test's watchdog read)."""
    ready, clock = tmp_path / "ready", FakeClock()
    ready.mkdir()
    procs = [subprocess.Popen(["sleep", "120"]) for _ in range(2)]
    group = RankGroup(procs, [0, 1], ["sleep", "120"], kill_grace_s=0.5, ready_dir=str(ready))
    reporters = [ProgressReporter(progress_file(ready, rank), clock=clock) for rank in (0, 1)]
    try:
        yield group, reporters, clock
    finally:
        group.send_signal(signal.SIGCONT)
        group.close()


def steps(reporters, clock, count: int, step_s: float = 0.1) -> None:
    for _ in range(count):
        clock.now += step_s
        for reporter in reporters:
            reporter.step(reporter._step + 1)


def test_the_job_is_judged_a_rank_waiting_while_its_peer_heartbeats_is_not_hung_but_a_stopped_one_is(sleeping_pair):
    """``auto`` (60 s here): rank 0 evaluates alone for 70 s calling heartbeat() while rank 1 waits in
    a collective; only when rank 0 too is silent beyond the limit is the job hung. A stopped rank is
    hung at its own limit: it waits for nobody."""
    group, reporters, clock = sleeping_pair
    watchdog = Watchdog(group, ProgressTimeout.parse("auto"), clock=clock)
    for reporter in reporters:
        reporter.phase("step", 10)
    steps(reporters, clock, 10)
    started = clock.now
    while clock.now < started + 70:  # rank 0's evaluation; rank 1 silent since `started`
        clock.now += 0.5
        reporters[0].heartbeat()
        assert watchdog.check() is None, clock.now - started
    clock.now += AUTO_STEP_FLOOR_S - 0.5
    assert watchdog.check() is None
    clock.now += 1.0
    stall = watchdog.check()
    assert stall is not None and stall.rank == 1 and stall.limit_s == AUTO_STEP_FLOOR_S and not stall.stopped

    reporters[0].heartbeat()  # rank 0 works again; rank 1 is stopped
    os.kill(group.procs[1].pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while not is_stopped(group.procs[1].pid) and time.monotonic() < deadline:  # the kernel stops it soon after
        time.sleep(0.01)
    clock.now += 0.5
    stall = watchdog.check()
    assert stall is not None and stall.rank == 1 and stall.stopped, stall


def test_the_job_is_judged_a_peer_in_a_long_save_covers_a_waiting_rank_and_a_first_step_ends_the_start_up_limit(sleeping_pair):
    """``--progress-timeout 4``: rank 0 still writes its part of a save (limit 120 s) while rank 1,
    done with its part, waits 100 s in the next step's collective: waiting. In the next start, once a
    rank has finished its first step after the resume, a rank still in its first step has the step
    limit too: both stuck are caught 4 s after the last report, not after the start-up limit."""
    group, reporters, clock = sleeping_pair
    watchdog = Watchdog(group, ProgressTimeout.parse("4", 600), clock=clock)
    for reporter in reporters:
        reporter.phase("step", 0)
    steps(reporters, clock, 10)
    for reporter in reporters:
        reporter.phase("saving")
    clock.now += 1.0
    reporters[1].saved(1.0)
    clock.now += 100
    assert watchdog.check() is None

    restarted = [ProgressReporter(progress_file(group.ready_dir, rank), clock=clock) for rank in (0, 1)]
    watchdog = Watchdog(group, ProgressTimeout.parse("4", 600), clock=clock)
    for reporter in restarted:
        reporter.phase("step", 10)  # both resumed epoch_0_step_10
    clock.now += 0.05
    restarted[1].step(11)  # rank 1 finished its first step, then waits for rank 0, stuck in its own
    clock.now += 3.7
    assert watchdog.check() is None
    clock.now += 0.4  # the watchdog reads at most every 0.25 s
    stall = watchdog.check()
    assert stall is not None and stall.rank == 0 and stall.limit_s == 4, stall


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--progress-timeout", "soon"], "--progress-timeout: expected 'auto' or a number of seconds > 0, got 'soon'"),
        (["--startup-timeout", "0"], "--startup-timeout: expected a number of seconds > 0"),
        (["--max-restarts", "-1"], "--max-restarts: expected an int >= 0"),
        (
            ["--max-restarts", "1", "--nnodes", "2", "--master-port", "29500"],
            "--max-restarts: with --nnodes > 1 the launchers restart together through a shared file: pass --fault-file PATH",
        ),
    ],
)
def test_a_watchdog_option_resilience_run_cannot_take_exits_2_before_starting_anything(argv, message, capsys):
    assert run_main(["-n", "1", *argv, "no_such_script.py"]) == 2
    assert message in capsys.readouterr().err
