"""``resilience run``'s progress watchdog: which local rank stopped reporting progress, for how long.

Each rank under :func:`~resilience.resilient_loop` writes a progress record
(:mod:`resilience.progress`); :class:`Watchdog` reads them and compares each rank's silence with
the limit of the phase it reported (:class:`ProgressTimeout`), like nvidia-resiliency-ext's
section timeouts:

==========================  ==========================================  ==================================
phase                       ``--progress-timeout S``                    ``--progress-timeout auto``
==========================  ==========================================  ==================================
no report yet, starting,    ``max(S, startup)``                         ``startup``
loading, the first step
(until a rank finished one)
a step                      ``S``                                       ``max(60, 5 x longest step)``
a save                      ``max(S, 120, 5 x longest save)``           ``max(60, 120, 5 x longest save)``
done (the loop ended)       not watched                                 not watched
==========================  ==========================================  ==================================

``startup`` is ``--startup-timeout`` (default 600 s); ``longest step``: the longest any local rank
reported in this start. The first step (warm-up: compilation, communicator set-up) has the start-up
limit only until a local rank has finished a step (a rank reports the end of its first step at
once); from then on every rank's step has the step limit, the first after a resume or an in-job
restart included. A rank with no record yet is watched only once another local rank has written
one: a program that does not use the loop never reports, and is then watched only for its exit.

The watchdog judges the job (its local ranks), not each rank alone: a rank silent beyond its limit
has stalled only when every other watched rank is beyond its own limit too, or when it is stopped
(SIGSTOP, a debugger: it waits for nobody). A rank blocked in a collective looks like a hung one,
but while a peer still reports (a rank-0-only evaluation calling ``loop.heartbeat()``) or is in a
phase whose limit still runs (a long load or save), it is waiting for that peer. A real hang stops
every rank's reports (a rank-conditional collective leaves them all in one; a rank stuck computing
leaves the others in the next), so it is caught one limit after the job's last report, within
:data:`CHECK_INTERVAL_S`. One stuck in a collective whose peer is gone reports nothing either.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from resilience.launch.rank_group import RankGroup
from resilience.progress import Report, progress_file, read_finished_step, read_report

AUTO = "auto"
AUTO_FACTOR = 5.0
"""Safety factor on the longest step and save time reported (``auto``)."""
AUTO_STEP_FLOOR_S = 60.0
SAVE_FLOOR_S = 120.0
DEFAULT_STARTUP_TIMEOUT_S = 600.0
CHECK_INTERVAL_S = 0.25
"""Seconds between two reads of the records (the detection latency beyond the limit)."""


@dataclasses.dataclass(frozen=True)
class ProgressTimeout:
    """The watchdog's limits. ``seconds``: ``--progress-timeout`` (``None`` = ``auto``);
    ``startup_s``: ``--startup-timeout``. See the module docstring for the table."""

    seconds: float | None = None
    startup_s: float = DEFAULT_STARTUP_TIMEOUT_S

    @classmethod
    def parse(cls, text: str, startup_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> ProgressTimeout:
        """``"auto"`` or a number of seconds > 0. Raises ``ValueError`` naming
        ``--progress-timeout`` / ``--startup-timeout`` and their accepted forms."""
        if not isinstance(startup_s, (int, float)) or isinstance(startup_s, bool) or not startup_s > 0:
            raise ValueError(f"--startup-timeout: expected a number of seconds > 0, got {startup_s!r}")
        if str(text).strip().lower() == AUTO:
            return cls(None, float(startup_s))
        try:
            seconds = float(text)
        except ValueError:
            seconds = -1.0
        if not seconds > 0 or seconds == float("inf"):
            raise ValueError(f"--progress-timeout: expected 'auto' or a number of seconds > 0, got {text!r}")
        return cls(seconds, float(startup_s))

    def limit(self, report: Report | None, longest_step_s: float = 0.0) -> float | None:
        """Seconds of silence allowed after ``report`` (``None``: the rank has not reported yet);
        ``None`` when the rank is not watched (its loop ended). ``longest_step_s``: the longest step
        any local rank reported in this start (seconds; 0 while none has finished one)."""
        step_s = max(report.max_step_s, longest_step_s) if report is not None else 0.0
        if report is None or report.phase in ("starting", "loading") or (report.phase == "step" and step_s == 0):
            return max(self.startup_s, self.seconds or 0.0)
        if report.phase == "done":
            return None
        step_limit = self.seconds if self.seconds is not None else max(AUTO_STEP_FLOOR_S, AUTO_FACTOR * step_s)
        if report.phase == "saving":
            return max(step_limit, SAVE_FLOOR_S, AUTO_FACTOR * report.max_save_s)
        return step_limit

    @property
    def collective_s(self) -> float:
        """The ranks' bound on each collective of the library's own groups: the longest limit known
        before any report (a peer may legitimately wait that long for another's load)."""
        return max(self.startup_s, self.seconds or 0.0, SAVE_FLOOR_S)

    def describe(self) -> str:
        """``"15 s"`` or ``"auto"`` for log lines."""
        return AUTO if self.seconds is None else f"{self.seconds:g} s"


@dataclasses.dataclass(frozen=True)
class Stall:
    """A rank silent for longer than its limit."""

    local: int
    rank: int
    pid: int
    report: Report | None
    silent_s: float
    limit_s: float
    stopped: bool
    """The process is stopped (SIGSTOP, SIGTSTP, a debugger), not running."""
    finished_step: int | None = None
    """The last step the rank finished (its exact step field), ``None`` when unknown."""

    def describe(self) -> str:
        """One line: which rank, what it was doing, for how long, and the limit."""
        doing = "before its first progress report (starting)" if self.report is None else doing_text(self.report, self.finished_step)
        state = " and is stopped (SIGSTOP?)" if self.stopped else ""
        return f"rank {self.rank} (pid {self.pid}) made no progress for {self.silent_s:.1f} s {doing}{state}; limit {self.limit_s:g} s"


def doing_text(report: Report, finished_step: int | None) -> str:
    """What a rank was doing: ``"in step 31 (step 30 was its last finished)"``, ``"while saving
    (step 30 was its last finished)"``. ``finished_step``: its exact step field, else ``report.step``
    (up to :data:`~resilience.progress.MIN_INTERVAL_S` of steps old) is all there is."""
    step = report.step if finished_step is None else finished_step
    finished = f"step {step} was its last finished" if step > 0 else "no step finished yet"
    if report.phase == "step":
        return f"in step {step + 1} ({finished})"
    return f"after its loop ended ({finished})" if report.phase == "done" else f"while {report.phase} ({finished})"


def is_stopped(pid: int) -> bool:
    """True when process ``pid`` is stopped (state ``T``/``t`` in ``/proc/PID/stat``, Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class Watchdog:
    """Reads the progress records of ``group``'s ranks and finds one that stalled.

    ``clock`` must be ``time.monotonic`` (the ranks' records use it) unless a test passes both.
    """

    def __init__(self, group: RankGroup, timeout: ProgressTimeout, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.group = group
        self.timeout = timeout
        self._clock = clock
        self._started = clock()
        self._next_check = self._started
        self.reports: dict[int, Report] = {}
        """The latest record read per local rank."""

    def check(self) -> Stall | None:
        """A stalled live local rank, or ``None``; reads the records at most every
        :data:`CHECK_INTERVAL_S` seconds (``None`` in between). A rank silent beyond its limit has
        stalled when every watched rank is (see the module docstring) or when it is stopped. Of
        several, a stopped one, else the one silent longest (its peers may be waiting for it)."""
        now = self._clock()
        if now < self._next_check:
            return None
        self._next_check = now + CHECK_INTERVAL_S
        if not self.read():
            return None  # nobody reports: a program without the loop, watched for its exit only
        longest = max(report.max_step_s for report in self.reports.values())
        stalls, watched = [], 0
        for local, code in enumerate(self.group.returncodes):
            report = self.reports.get(local)
            limit = self.timeout.limit(report, longest) if code is None else None
            if limit is None:
                continue
            watched += 1
            silent = now - (report.t if report is not None else self._started)
            if silent > limit:
                pid = self.group.procs[local].pid
                stalls.append(Stall(local, self.group.ranks[local], pid, report, silent, limit, is_stopped(pid)))
        if len(stalls) < watched:  # a rank still within its limit: the silent ones may be waiting for it
            stalls = [stall for stall in stalls if stall.stopped]
        stall = max(stalls, key=lambda stall: (stall.stopped, stall.silent_s), default=None)
        return None if stall is None else dataclasses.replace(stall, finished_step=self.finished_step(stall.local))

    def read(self) -> dict[int, Report]:
        """Read every rank's record now into :attr:`reports` (a missing or torn one keeps the
        previous); returns :attr:`reports`, empty while no rank has reported."""
        if self.group.ready_dir is not None:
            for local, rank in enumerate(self.group.ranks):
                report = read_report(progress_file(self.group.ready_dir, rank))
                if report is not None:
                    self.reports[local] = report
        return self.reports

    def finished_step(self, local: int) -> int | None:
        """The last step local rank ``local`` finished, read now (exact, unlike its record's step,
        which is rate-limited); ``None`` when it has written none."""
        if self.group.ready_dir is None:
            return None
        return read_finished_step(progress_file(self.group.ready_dir, self.group.ranks[local]))

    def describe(self, local: int) -> str:
        """What local rank ``local`` is doing (its exact step) and when it last reported, for the
        stack dump's header."""
        report = self.reports.get(local)
        if report is None:
            return "no progress report yet"
        return f"{doing_text(report, self.finished_step(local))}, last report {self._clock() - report.t:.1f} s ago"
