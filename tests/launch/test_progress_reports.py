"""The progress record a rank writes (:mod:`resilience.progress`) and the limits the watchdog reads it with."""

from __future__ import annotations

import pytest

from resilience.cli.run import main as run_main
from resilience.distributed import collective_timeout_s
from resilience.env_names import COLLECTIVE_TIMEOUT_ENV, PROGRESS_FILE_ENV
from resilience.launch.watchdog import AUTO_STEP_FLOOR_S, SAVE_FLOOR_S, ProgressTimeout, Report, read_report
from resilience.progress import RECORD_BYTES, ProgressReporter


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
    reporter.step(1)  # 0.1 s after the last report: not written
    assert read_report(str(path)) == Report("step", 0, 100.0, 0.0, 0.0)
    clock.now += 0.5
    reporter.step(2)
    assert read_report(str(path)) == Report("step", 2, 100.6, 0.5, 0.0)  # the longest step so far
    clock.now += 0.1
    reporter.phase("saving")  # a phase change: at once
    assert read_report(str(path)).phase == "saving" and read_report(str(path)).t == pytest.approx(100.7)
    clock.now += 3.0
    reporter.saved(3.0)
    clock.now += 0.2
    reporter.step(3)  # the step after the save counts from its end, not across it
    report = read_report(str(path))
    assert (report.phase, report.step, report.max_step_s, report.max_save_s) == ("step", 2, 0.5, 3.0)
    assert path.stat().st_size == RECORD_BYTES
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
