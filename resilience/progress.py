"""Progress reports from a rank to its local launcher, for ``resilience run``'s watchdog.

The launcher gives each rank a file (``RESILIENCE_PROGRESS_FILE``, in its handshake directory);
the loop writes one fixed-size JSON record into it, in place, with one ``pwrite`` (no collective,
no fsync, no new file): at each phase change (starting, loading, step, saving, done) and at the
end of the first step after a start (the watchdog's start-up limit ends there) at once, and at
other step boundaries at most every :data:`MIN_INTERVAL_S` seconds, so most boundaries cost one
``time.monotonic()`` call (vDSO, no syscall) and the finished step's ``pwrite`` (below). The record::

    {"phase": "step", "step": 120, "t": 81234.5, "max_step_s": 0.031, "max_save_s": 0.4, "pid": 4242}

``t`` is ``time.monotonic()`` at the report: one clock for every process of a Linux machine, so
the launcher compares it with its own. ``max_step_s`` is the longest time between two step
boundaries seen (no save in between; the first step after a start, warm-up included, counts),
``max_save_s`` the longest synchronous part of a save; the launcher's ``--progress-timeout auto``
multiplies them by a safety factor.

The record's ``step`` can be up to :data:`MIN_INTERVAL_S` of steps old, so the file also holds the
last finished step at :data:`STEP_OFFSET`, right after the record (:data:`STEP_BYTES` of ASCII),
rewritten with one ``pwrite`` at every step boundary (about 2 us; no JSON, no rename). The
watchdog reads it (:func:`read_finished_step`) only to name the step of a rank it reports; it
judges by the record alone.

The rank also registers :data:`STACK_DUMP_SIGNAL` with :mod:`faulthandler`, so the launcher can
have it print every thread's Python stack to its stderr (the job's output) when it stalls: the
dump happens in the C signal handler, also while the main thread waits inside a collective.
Without the variable (no ``resilience run``) nothing is written and no signal is registered.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import signal
import time
from collections.abc import Callable, Mapping

from resilience.env_names import PROGRESS_FILE_ENV

PHASES = ("starting", "loading", "step", "saving", "done")
"""What a rank reports it is doing; ``done``: its loop ended (the watchdog stops watching it)."""
MIN_INTERVAL_S = 0.5
"""Seconds between two step reports at least (phase changes are reported at once)."""
RECORD_BYTES = 256
"""Every record is padded with spaces to this size, so a rewrite in place needs no truncation."""
STEP_OFFSET = RECORD_BYTES
"""Where the last finished step is kept, after the record (see the module docstring)."""
STEP_BYTES = 21
"""The finished step's width: 20 digits, space-padded, and a newline."""
STACK_DUMP_SIGNAL = signal.SIGRTMIN + 4
"""The signal on which a rank prints its Python stacks (``faulthandler``). A real-time signal:
nothing sends it by default, and the launcher forwards none of them, unlike USR1/USR2/TERM (the
preemption signals), INT, HUP and QUIT; SIGWINCH would fire on every terminal resize."""


class ProgressReporter:
    """Writes this rank's progress record (see the module docstring); every method is cheap.

    Args:
        path: the record's file, or ``None`` to report nothing (every method is then a no-op).
        min_interval_s: the least time between two step reports (seconds).
        clock: ``time.monotonic`` unless a test passes another.

    A write that fails (the launcher's directory removed under it) disables reporting quietly:
    the launcher is gone or ending the rank anyway.
    """

    def __init__(self, path: str | None, *, min_interval_s: float = MIN_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._min_interval_s = min_interval_s
        self._fd: int | None = None
        self._phase = "starting"
        self._step = 0
        self._last_write = float("-inf")
        self._written_step_s = 0.0  # max_step_s in the record written last
        self._last_boundary: float | None = None
        self.max_step_s = 0.0
        self.max_save_s = 0.0
        if path:
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError:
                self._fd = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ProgressReporter:
        """The reporter ``resilience run`` asked for (``RESILIENCE_PROGRESS_FILE``), with the
        stack-dump signal registered; a no-op reporter without it."""
        env = os.environ if env is None else env
        reporter = cls(env.get(PROGRESS_FILE_ENV))
        if reporter.enabled:
            register_stack_dump()
        return reporter

    @property
    def enabled(self) -> bool:
        """True while reports are written."""
        return self._fd is not None

    def phase(self, phase: str, step: int | None = None) -> None:
        """Report a phase change now (``phase`` one of :data:`PHASES`; ``step``: the last finished
        step, unchanged when ``None``). Raises ``ValueError`` for an unknown phase."""
        if phase not in PHASES:
            raise ValueError(f"phase: expected one of {PHASES}, got {phase!r}")
        if self._fd is None:
            return
        self._phase = phase
        if step is not None:
            self._step = step
            self._write_step(step)
        now = self._clock()
        # a load or save is not part of a step's time; the step after one starts now
        self._last_boundary = now if phase == "step" else None
        self._write(now)

    def step(self, global_step: int) -> None:
        """Step ``global_step`` just finished: measure it, and report when the last report is
        :data:`MIN_INTERVAL_S` old, the phase was another, or it is the first step measured (the
        record written still says none has finished: the watchdog would allow the start-up limit)."""
        if self._fd is None:
            return
        self._write_step(global_step)
        now = self._clock()
        if self._last_boundary is not None and now - self._last_boundary > self.max_step_s:
            self.max_step_s = now - self._last_boundary
        self._last_boundary = now
        self._step = global_step
        first_measured = self._written_step_s == 0.0 < self.max_step_s
        if self._phase != "step" or first_measured or now - self._last_write >= self._min_interval_s:
            self._phase = "step"
            self._write(now)

    def heartbeat(self) -> None:
        """Still working, inside a long step (an evaluation): refresh the record's time, at most every
        :data:`MIN_INTERVAL_S` seconds, without ending the step."""
        if self._fd is None:
            return
        now = self._clock()
        if now - self._last_write >= self._min_interval_s:
            self._write(now)

    def saved(self, seconds: float) -> None:
        """A save's synchronous part took ``seconds``: record it, and report phase ``step``."""
        if self._fd is None:
            return
        self.max_save_s = max(self.max_save_s, seconds)
        self.phase("step")

    def close(self) -> None:
        """Report ``done`` and close the file (idempotent)."""
        if self._fd is None:
            return
        self.phase("done")
        if self._fd is not None:  # the last write may have failed and closed it
            fd, self._fd = self._fd, None
            os.close(fd)

    def _write_step(self, step: int) -> None:
        # at every step boundary: step() took 2.3 us a call with it, 0.2-0.4 us without (a loop of
        # 100k calls, ext4, 2 loaded cores): 0.02 % of a 10 ms step
        self._pwrite(b"%20d\n" % step, STEP_OFFSET)

    def _write(self, now: float) -> None:
        record = {"phase": self._phase, "step": self._step, "t": now, "max_step_s": self.max_step_s, "max_save_s": self.max_save_s, "pid": os.getpid()}
        if self._pwrite(json.dumps(record).encode().ljust(RECORD_BYTES), 0):
            self._last_write = now
            self._written_step_s = self.max_step_s

    def _pwrite(self, data: bytes, offset: int) -> bool:
        """Write ``data`` at ``offset``; False (and reporting disabled) when it fails or is disabled."""
        if self._fd is None:
            return False
        try:
            os.pwrite(self._fd, data, offset)
        except OSError:
            fd, self._fd = self._fd, None
            os.close(fd)
            return False
        return True


def progress_file(ready_dir: str | os.PathLike[str], rank: int) -> str:
    """Path of rank ``rank``'s progress record in the launcher's handshake directory."""
    return os.path.join(os.fspath(ready_dir), f"progress_{rank}")


def register_stack_dump() -> bool:
    """Have :data:`STACK_DUMP_SIGNAL` print every thread's Python stack to stderr (fd 2, the job's
    output); idempotent. Returns False where ``faulthandler`` cannot register it."""
    try:
        faulthandler.register(STACK_DUMP_SIGNAL, file=2, all_threads=True, chain=False)
    except (ValueError, RuntimeError, OSError, AttributeError):
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Report:
    """One rank's progress record (what :class:`ProgressReporter` writes); ``t`` is ``time.monotonic()``."""

    phase: str
    step: int
    t: float
    max_step_s: float
    max_save_s: float


def read_report(path: str) -> Report | None:
    """The record at ``path`` (read by ``resilience run``'s watchdog and launcher); ``None`` when there is none or it cannot be parsed (half written)."""
    try:
        with open(path, "rb") as fh:
            doc = json.loads(fh.read(RECORD_BYTES))
        return Report(str(doc["phase"]), int(doc["step"]), float(doc["t"]), float(doc["max_step_s"]), float(doc["max_save_s"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_finished_step(path: str) -> int | None:
    """The last step the rank writing ``path`` finished (exact, unlike :attr:`Report.step`);
    ``None`` when the file has none yet or cannot be read. The field is read until two reads agree,
    so a rewrite that a read overlaps is not taken for a step."""
    try:
        with open(path, "rb") as fh:
            previous = None
            for _ in range(5):
                field = os.pread(fh.fileno(), STEP_BYTES, STEP_OFFSET)
                if field == previous:
                    return int(field) if len(field) == STEP_BYTES else None
                previous = field
    except (OSError, ValueError):
        return None
    return None
