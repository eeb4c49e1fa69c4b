"""Ctrl-C during a save: the save finishes and publishes, then the run exits 130; a second Ctrl-C aborts.

The 2-rank runs go through ``resilience run`` on a pseudo-terminal, and the test types Ctrl-C
(``\\x03``) into it: the terminal sends SIGINT to its whole foreground process group, the launcher
and both ranks, as at a real terminal. ``helpers/phase_train.py`` pauses every rank inside the save
(at its first "parts" phase) until the test releases it, so each Ctrl-C lands in that save.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from resilience import ExitCode
from resilience.checkpoint.storage.manifest import validate
from resilience.stop.interrupt import HeldInterrupt
from tiny_runs import train_xy

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "phase_train.py"
CTRL_C = b"\x03"


@pytest.mark.usefixtures("python_sigint")
def test_a_first_sigint_is_held_to_the_end_of_the_block_and_a_second_raises_at_once():
    ran = []
    with pytest.raises(KeyboardInterrupt):
        with HeldInterrupt():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # the handler has run: a KeyboardInterrupt would have left the block here
            ran.append("after the first")
    assert ran == ["after the first"], "the block finished before the held SIGINT was raised"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    with pytest.raises(KeyboardInterrupt) as raised:
        with HeldInterrupt():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
            ran.append("after the second")
    assert ran == ["after the first"], "a second SIGINT raises inside the block"
    assert raised.value.__context__ is None, "one KeyboardInterrupt for both: leaving the block raises no other"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("python_sigint")
def test_a_hold_changes_nothing_but_python_s_default_sigint_handler_in_the_main_thread():
    calls = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with HeldInterrupt():  # a handler of the program's own runs at once, as before
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
            assert calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)
    with HeldInterrupt(), HeldInterrupt():  # nested: the outer one holds, and delivers once
        inner = signal.getsignal(signal.SIGINT)
    assert inner is not signal.default_int_handler and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    seen = []
    worker = threading.Thread(target=lambda: seen.append(HeldInterrupt().__enter__()._installed))
    worker.start()
    worker.join()
    assert seen == [False], "signal.signal works only in the main thread: a hold elsewhere installs nothing"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # started with SIGINT ignored (nohup, a background job): it stays ignored
    with HeldInterrupt():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN, "a hold replaced an ignored SIGINT"
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN, "leaving the hold changed an ignored SIGINT"


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_launcher_environment")
def test_with_int_in_preemption_signal_ctrl_c_is_a_stop_request_that_saves_and_exits_75(tmp_path):
    def ctrl_c_in_step_2(step):
        if step.global_step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    config = {"step_scheduler": {"num_epochs": 1, "preemption_signal": "INT"}, "checkpoint": {"checkpoint_dir": str(tmp_path)}}
    try:
        loop = train_xy(config, batches=4, on_step=ctrl_c_in_step_2)
    except KeyboardInterrupt:
        pytest.fail("the recorded SIGINT also raised KeyboardInterrupt: no stop, no save, exit 130")
    assert (loop.exit_code, loop.stop_step) == (ExitCode.PREEMPTED, 2)
    assert latest(tmp_path)[0] == "epoch_0_step_2"


class TerminalRun:
    """``resilience run -n 2 phase_train.py`` in its own session, with a pty as its controlling terminal."""

    def __init__(self, tmp_path: Path, pause_at, overrides=()):
        self.ckpt, self.events_dir = tmp_path / "ck", tmp_path / "ev"
        self.master, slave = os.openpty()
        cmd = [sys.executable, "-m", "resilience", "run", "-n", "2", str(HELPER), str(self.ckpt), str(self.events_dir), *overrides]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PAUSE_AT": ",".join(pause_at)}
        self.stderr = tmp_path / "stderr"
        with open(self.stderr, "w") as err:
            self.launcher = subprocess.Popen(
                cmd, stdin=slave, stdout=err, stderr=err, env=env, start_new_session=True, preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            )
        os.close(slave)

    def events(self, rank: int) -> list[str]:
        path = self.events_dir / f"rank_{rank}.events"
        return path.read_text().splitlines() if path.exists() else []

    def wait_for(self, line: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(line in self.events(r) for r in (0, 1)):
            if self.launcher.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"never saw {line!r} (launcher: {self.launcher.poll()}): {[self.events(r) for r in (0, 1)]} {self.stderr.read_text()}")
            time.sleep(0.005)

    def release(self, tag: str) -> None:
        (self.events_dir / f"release_{tag}").touch()

    def ctrl_c(self) -> None:
        os.write(self.master, CTRL_C)

    def finish(self, timeout: float = 60.0) -> tuple[int, list[int]]:
        """The launcher's exit code and the ranks' (from its last line)."""
        self.launcher.wait(timeout)
        text = self.stderr.read_text()
        found = re.findall(r"ranks exited with \[([^\]]*)\]", text)
        assert found, text
        return self.launcher.returncode, [int(c) for c in found[-1].split(",")]

    def __enter__(self) -> TerminalRun:
        return self

    def __exit__(self, *exc) -> None:
        if self.launcher.poll() is None:
            os.killpg(self.launcher.pid, signal.SIGKILL)
            self.launcher.wait()
        os.close(self.master)


def latest(ckpt: Path) -> tuple[str, dict]:
    """LATEST's target and its manifest meta, every file checked against its digest."""
    name = os.readlink(ckpt / "LATEST")
    return name, validate(ckpt / name)["meta"]


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "save, pause_at, overrides, published",
    [
        ("the stop save", ["step:6", "save:preemption"], (), ("epoch_0_step_7", "preemption")),
        # the background write of step 8's save: the Ctrl-C finds the main thread training or waiting for it
        ("an async periodic save", ["save:2"], ("checkpoint.is_async=true",), ("epoch_0_step_8", "periodic")),
    ],
    ids=["stop-save", "async-periodic-save"],
)
def test_ctrl_c_during_a_save_lets_it_publish_then_exits_130(tmp_path, save, pause_at, overrides, published):
    with TerminalRun(tmp_path, pause_at, overrides) as run:
        if "step:6" in pause_at:
            run.wait_for("pause step:6")
            os.kill(run.launcher.pid, signal.SIGUSR1)  # a preemption: the launcher forwards it to both ranks
            run.release("step:6")
        tag = pause_at[-1]
        run.wait_for(f"pause {tag}")  # inside the save, on both ranks
        run.ctrl_c()
        time.sleep(0.5)  # the ranks' handlers run (a killed save would end the ranks meanwhile)
        run.release(tag)
        code, codes = run.finish()
    assert (code, codes) == (130, [130, 130]), f"{save}: Ctrl-C still ends the run, after the save"
    name, meta = latest(run.ckpt)
    assert (name, meta["reason"]) == published, f"{save} was published and LATEST names it"
    assert not any(p.name.startswith(".staging") for p in run.ckpt.iterdir())
    for rank in (0, 1):
        assert run.events(rank)[-1] == "exit 130"


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_second_ctrl_c_during_the_stop_save_aborts_it_and_leaves_latest_as_it_was(tmp_path):
    with TerminalRun(tmp_path, ["step:6", "save:preemption"]) as run:
        run.wait_for("pause step:6")
        os.kill(run.launcher.pid, signal.SIGUSR1)
        run.release("step:6")
        run.wait_for("pause save:preemption")
        before = latest(run.ckpt)
        run.ctrl_c()
        time.sleep(1.0)  # handled before the next: two SIGINTs pending at once are delivered as one
        run.ctrl_c()  # the save is never released: only an abort ends it
        code, codes = run.finish()
    assert (code, codes) == (130, [130, 130])
    assert before[0] == "epoch_0_step_4"
    assert latest(run.ckpt) == before, "the aborted save published nothing; the previous checkpoint still verifies"
    assert not (run.ckpt / "epoch_0_step_7").exists()
