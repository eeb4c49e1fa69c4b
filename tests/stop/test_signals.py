"""resilience.stop.signals: spec parsing and the scoped recorder, with real signals and processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from resilience.stop.signals import DEFAULT_PREEMPTION_SIGNAL, SignalRecorder, parse_preemption_signal

S = signal.Signals
REPO = Path(__file__).resolve().parents[2]
KEY = "step_scheduler.preemption_signal"


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("SIGTERM", (S.SIGTERM,)),
        ("SIGUSR1", (S.SIGUSR1,)),
        ("usr1", (S.SIGUSR1,)),
        ("sigusr2", (S.SIGUSR2,)),
        (" term ", (S.SIGTERM,)),
        ("Int", (S.SIGINT,)),
        (15, (S.SIGTERM,)),
        ("15", (S.SIGTERM,)),
        (" 10 ", (S.SIGUSR1,)),
        (S.SIGUSR2, (S.SIGUSR2,)),
        (["TERM", "USR1"], (S.SIGTERM, S.SIGUSR1)),
        (("usr1", 15), (S.SIGUSR1, S.SIGTERM)),  # order kept
        ([S.SIGHUP], (S.SIGHUP,)),
        (None, ()),
    ],
)
def test_accepted_spec_normalises_to_signals(spec, expected):
    assert parse_preemption_signal(spec) == expected


def test_default_spec_is_sigterm():
    assert DEFAULT_PREEMPTION_SIGNAL == "SIGTERM"
    assert parse_preemption_signal() == (S.SIGTERM,)


@pytest.mark.parametrize(
    "spec, error, fragment",
    [
        (True, TypeError, "True"),  # bool is an int subclass, but not a signal
        (False, TypeError, "False"),
        (15.0, TypeError, "float"),
        (b"TERM", TypeError, "bytes"),
        ({"name": "TERM"}, TypeError, "dict"),
        ([["TERM"]], TypeError, "nested"),
        (["TERM", [10]], TypeError, "nested"),
        (["TERM", True], TypeError, "bool"),
        ([], ValueError, "empty"),
        ((), ValueError, "empty"),
        (["TERM", 15], ValueError, "SIGTERM"),  # duplicate after normalisation
        (["usr1", "SIGUSR1"], ValueError, "already"),
        ("USR3", ValueError, "unknown signal 'USR3'"),
        ("", ValueError, "unknown signal"),
        ("SIG_DFL", ValueError, "unknown signal"),
        (0, ValueError, "positive"),
        (-15, ValueError, "positive"),
        ("-15", ValueError, "positive"),
        (9999, ValueError, "9999 is not a signal number on this platform (1 to 64)"),
        (38, ValueError, "38 is the real-time signal SIGRTMIN+4, which is not supported; of the real-time signals use SIGRTMIN (34) or SIGRTMAX (64)"),
        ("38", ValueError, "SIGRTMIN+4"),
        ("KILL", ValueError, "cannot be caught"),
        (9, ValueError, "SIGKILL"),
        (S.SIGSTOP, ValueError, "cannot be caught"),
    ],
)
def test_rejected_spec_names_key_and_accepted_forms(spec, error, fragment):
    with pytest.raises(error) as info:
        parse_preemption_signal(spec)
    message = str(info.value)
    assert message.startswith(KEY)
    assert "accepted" in message
    assert fragment in message


def test_error_message_uses_the_callers_key():
    with pytest.raises(ValueError, match=r"^my\.section\.sig: unknown signal 'USR3'; accepted: a signal name"):
        parse_preemption_signal("USR3", key="my.section.sig")


def _dispositions(sigs):
    return {s: signal.getsignal(s) for s in sigs}


def test_recorder_restores_exact_dispositions_on_exit():
    sigs = (S.SIGUSR1, S.SIGUSR2, S.SIGHUP)

    def custom(signum, frame):
        pass

    old = signal.signal(S.SIGHUP, custom)
    try:
        before = _dispositions(sigs)
        with SignalRecorder(sigs) as rec:
            during = _dispositions(sigs)
            assert rec.active
        assert all(during[s] is not before[s] for s in sigs)  # really installed
        assert _dispositions(sigs) == before
    finally:
        signal.signal(S.SIGHUP, old)


def test_recorder_restores_dispositions_after_exception_in_body():
    sigs = (S.SIGUSR1, S.SIGTERM)
    before = _dispositions(sigs)
    with pytest.raises(ZeroDivisionError):
        with SignalRecorder(sigs):
            assert _dispositions(sigs) != before
            raise ZeroDivisionError
    assert _dispositions(sigs) == before


def test_recorded_signal_and_monotonic_times():
    with SignalRecorder((S.SIGUSR1, S.SIGUSR2)) as rec:
        assert not rec and rec.count == 0 and rec.first is None and not rec.pending
        t0 = time.monotonic()
        os.kill(os.getpid(), S.SIGUSR1)
        os.kill(os.getpid(), S.SIGUSR2)
        os.kill(os.getpid(), S.SIGUSR1)
        t1 = time.monotonic()
    got = rec.received
    assert [s for s, _ in got] == [S.SIGUSR1, S.SIGUSR2, S.SIGUSR1]
    assert all(isinstance(s, signal.Signals) for s, _ in got)
    times = [t for _, t in got]
    assert t0 <= times[0] <= times[1] <= times[2] <= t1
    assert rec and rec.pending and rec.count == 3 and rec.first == got[0]
    got.clear()  # `received` is a copy
    assert rec.count == 3


def test_previous_python_handler_still_runs():
    calls = []
    old = signal.signal(S.SIGUSR1, lambda signum, frame: calls.append(signum))
    try:
        with SignalRecorder((S.SIGUSR1,)) as rec:
            os.kill(os.getpid(), S.SIGUSR1)
        assert rec.count == 1
        assert calls == [S.SIGUSR1]
    finally:
        signal.signal(S.SIGUSR1, old)


@pytest.mark.usefixtures("python_sigint")
def test_a_recorded_sigint_is_a_stop_request_not_a_keyboard_interrupt():
    """``preemption_signal: INT``: Python's default SIGINT handler raises; recording replaces it as it replaces SIG_DFL."""
    assert signal.getsignal(S.SIGINT) is signal.default_int_handler
    try:
        with SignalRecorder((S.SIGINT,)) as rec:
            os.kill(os.getpid(), S.SIGINT)
            time.sleep(0.01)  # a KeyboardInterrupt would be raised here
    except KeyboardInterrupt:
        pytest.fail("the recorded SIGINT raised KeyboardInterrupt: no stop, no save, exit 130")
    assert [s for s, _ in rec.received] == [S.SIGINT]
    assert signal.getsignal(S.SIGINT) is signal.default_int_handler


def test_recorder_is_not_reentrant_but_reusable():
    rec = SignalRecorder((S.SIGUSR1,))
    before = signal.getsignal(S.SIGUSR1)
    with rec:
        os.kill(os.getpid(), S.SIGUSR1)
        with pytest.raises(RuntimeError, match="already active"):
            rec.__enter__()
    assert signal.getsignal(S.SIGUSR1) == before
    assert rec.count == 1  # still readable after exit
    with rec:
        assert rec.count == 0  # entering again starts a new record
    assert signal.getsignal(S.SIGUSR1) == before


@pytest.mark.timeout(10)
def test_off_main_thread_install_raises_and_installs_nothing():
    before = signal.getsignal(S.SIGUSR1)
    errors = []

    def enter():
        try:
            SignalRecorder((S.SIGUSR1,)).__enter__()
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            errors.append(exc)

    thread = threading.Thread(target=enter, name="not-main")
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "main thread" in str(errors[0]) and "not-main" in str(errors[0])
    assert signal.getsignal(S.SIGUSR1) == before


def test_invalid_recorder_signals_are_rejected():
    with pytest.raises(ValueError, match="twice"):
        SignalRecorder((S.SIGUSR1, S.SIGUSR1))
    with pytest.raises(ValueError, match="SIGKILL"):
        SignalRecorder((S.SIGKILL,))
    with pytest.raises(TypeError):
        SignalRecorder(("SIGTERM",))


@pytest.mark.timeout(20)
def test_forked_child_records_nothing_and_restores_nothing():
    read_fd, write_fd = os.pipe()
    with SignalRecorder((S.SIGUSR1,)) as rec:
        ours = signal.getsignal(S.SIGUSR1)
        pid = os.fork()
        if pid == 0:  # child: never return into pytest
            status = 1
            try:
                os.close(read_fd)
                os.kill(os.getpid(), S.SIGUSR1)  # SIG_DFL would kill us; the recorder must not
                time.sleep(0.05)
                count = rec.count
                rec.__exit__(None, None, None)
                still_ours = signal.getsignal(S.SIGUSR1) is ours
                os.write(write_fd, f"{count} {int(still_ours)}".encode())
                status = 0
            finally:
                os._exit(status)
        os.close(write_fd)
        _, wait_status = os.waitpid(pid, 0)
        with os.fdopen(read_fd) as pipe:
            report = pipe.read()
        assert os.waitstatus_to_exitcode(wait_status) == 0, report
        assert report == "0 1"  # nothing recorded, our handler left in place in the child
        assert rec.count == 0  # the parent's record is untouched
        os.kill(os.getpid(), S.SIGUSR1)
        assert rec.count == 1  # and the parent still records


def _run_child(body: str) -> subprocess.Popen:
    script = textwrap.dedent(
        """
        import os, sys, time
        from resilience.stop.signals import SignalRecorder, parse_preemption_signal
        """
    ) + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


@pytest.mark.timeout(30)
def test_disabled_spec_installs_nothing_so_sigterm_still_kills():
    proc = _run_child(
        """
        sigs = parse_preemption_signal(None)
        assert sigs == ()
        with SignalRecorder(sigs):
            print("ready", flush=True)
            time.sleep(20)
        print("survived", flush=True)
        """
    )
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == -signal.SIGTERM, (out, err)
    assert "survived" not in out


@pytest.mark.timeout(30)
def test_recorded_sigterm_lets_process_exit_normally():
    proc = _run_child(
        """
        with SignalRecorder(parse_preemption_signal("SIGTERM")) as rec:
            print("ready", flush=True)
            deadline = time.monotonic() + 20
            while not rec and time.monotonic() < deadline:
                time.sleep(0.01)
        print(rec.count, rec.first[0].name, flush=True)
        """
    )
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, (out, err)
    assert out.split() == ["1", "SIGTERM"]
