"""Preemption signals: parse the configured spec, and record deliveries while training runs.

The spec follows NeMo AutoModel's ``step_scheduler.preemption_signal`` (default ``SIGTERM``,
which is what Slurm sends at the end of a job's time and on preemption, and what
``sbatch --signal=TERM@<seconds>`` sends early). The recorder follows Megatron's
``dist_signal_handler``: the handler only records and returns; the training loop polls the
record at step boundaries and does the slow work (agreement, checkpoint, exit) itself.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

DEFAULT_PREEMPTION_SIGNAL = "SIGTERM"

_ACCEPTED = (
    "accepted: a signal name (case-insensitive, with or without SIG, e.g. 'SIGUSR1', 'usr1'), a number (e.g. 15 or '15'), a list of these, or null to disable"
)
# The kernel never lets a process handle these, so a spec naming them can never work.
_UNCATCHABLE = frozenset({signal.SIGKILL, signal.SIGSTOP})
_NUMBER = re.compile(r"[+-]?\d+")


def parse_preemption_signal(spec: Any = DEFAULT_PREEMPTION_SIGNAL, *, key: str = "step_scheduler.preemption_signal") -> tuple[signal.Signals, ...]:
    """Normalise a preemption-signal spec to a tuple of :class:`signal.Signals`, in spec order.

    Accepted forms (NeMo AutoModel ``preemption_signal`` semantics):

    * a name, case-insensitive, with or without ``SIG``, surrounding whitespace ignored:
      ``"SIGUSR1"``, ``"usr1"``, ``" term "``;
    * a number as ``int`` or numeric string: ``15``, ``"15"``;
    * a :class:`signal.Signals` member;
    * a list or tuple of the above (order kept; e.g. ``["TERM", "USR1"]``);
    * ``None``: preemption handling disabled, returns ``()``.

    Raises:
        TypeError: the spec or a list item has the wrong type (``bool``, ``float``, ``bytes``,
            ``dict``, a nested list, ...).
        ValueError: an empty list; a name or number that is not a signal on this platform;
            ``0`` or a negative number; an uncatchable signal (``SIGKILL``, ``SIGSTOP``); a fault or
            bookkeeping signal (``SIGSEGV``, ``SIGBUS``, ``SIGFPE``, ``SIGILL``, ``SIGABRT``,
            ``SIGCHLD``, ``SIGPIPE``, ``SIGTRAP``);
            two items naming the same signal (``["TERM", 15]``).

    Every message starts with ``key`` and lists the accepted forms.
    """
    if spec is None:
        return ()
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise ValueError(f"{key}: empty list; {_ACCEPTED}")
        out: list[signal.Signals] = []
        for i, item in enumerate(spec):
            if isinstance(item, (list, tuple)):
                raise TypeError(f"{key}[{i}]: nested list {item!r} is not allowed; {_ACCEPTED}")
            sig = _parse_one(item, f"{key}[{i}]")
            if sig in out:
                raise ValueError(f"{key}: {item!r} names {sig.name}, which is already in the list {list(spec)!r}; {_ACCEPTED}")
            out.append(sig)
        return tuple(out)
    return (_parse_one(spec, key),)


def _parse_one(item: Any, key: str) -> signal.Signals:
    # bool is an int subclass: True would silently mean SIGHUP (1).
    if isinstance(item, bool) or not isinstance(item, (int, str)):
        raise TypeError(f"{key}: expected a signal name or number, got {item!r} ({type(item).__name__}); {_ACCEPTED}")
    if isinstance(item, str):
        text = item.strip()
        if _NUMBER.fullmatch(text):
            return _from_number(int(text), item, key)
        name = text.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        sig = signal.Signals.__members__.get(name)
        if sig is None:
            raise ValueError(f"{key}: unknown signal {item!r}; {_ACCEPTED}")
        return _catchable(sig, item, key)
    return _from_number(int(item), item, key)


def _from_number(number: int, item: Any, key: str) -> signal.Signals:
    if number <= 0:
        raise ValueError(f"{key}: signal numbers are positive, got {item!r}; {_ACCEPTED}")
    try:
        sig = signal.Signals(number)
    except ValueError:
        rtmin, rtmax = getattr(signal, "SIGRTMIN", None), getattr(signal, "SIGRTMAX", None)
        if rtmin is not None and rtmax is not None and rtmin < number < rtmax:
            # Python names only the first and the last real-time signal; the ones between have
            # no signal.Signals member to record them by.
            raise ValueError(
                f"{key}: {item!r} is the real-time signal SIGRTMIN+{number - rtmin}, which is not supported; of the real-time "
                f"signals use SIGRTMIN ({int(rtmin)}) or SIGRTMAX ({int(rtmax)}); {_ACCEPTED}"
            ) from None
        raise ValueError(f"{key}: {item!r} is not a signal number on this platform (1 to {signal.NSIG - 1}); {_ACCEPTED}") from None
    return _catchable(sig, item, key)


# Signals a process sends itself on a fault or uses for its own bookkeeping: recording one
# instead of letting it act would hide a crash (SIGSEGV, SIGABRT from torch's fatal errors) or
# stop training whenever a child exits (SIGCHLD).
_NOT_A_STOP_REQUEST = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT, signal.SIGCHLD, signal.SIGPIPE, signal.SIGTRAP})


def _catchable(sig: signal.Signals, item: Any, key: str) -> signal.Signals:
    if sig in _UNCATCHABLE:
        raise ValueError(f"{key}: {item!r} is {sig.name}, which cannot be caught; {_ACCEPTED}")
    if sig in _NOT_A_STOP_REQUEST:
        raise ValueError(
            f"{key}: {item!r} is {sig.name}, a fault or bookkeeping signal, not a stop request; "
            f"use the one Slurm sends (--signal=B:USR1@N: USR1; scancel's default: TERM); {_ACCEPTED}"
        )
    return sig


class SignalRecorder:
    """Scoped handlers that record each delivery of ``signals`` as ``(signal, time.monotonic())``.

    Use as a context manager around training; poll at step boundaries::

        with SignalRecorder(parse_preemption_signal(cfg)) as rec:
            for step in ...:
                ...
                if rec: ...  # a preemption signal arrived

    * The handler only appends to a list and returns (no I/O, no locks, no exit: it may run
      between any two bytecodes). Then, if the disposition it replaced was a Python callable,
      it calls that too, so a handler installed earlier (a launcher's, a logger's) still runs.
      It never chains to ``SIG_DFL``/``SIG_IGN`` or to Python's default SIGINT handler
      (``KeyboardInterrupt``): recording *replaces* "die", "ignore" or "interrupt".
    * ``__exit__`` restores exactly the dispositions found on ``__enter__``, also when the body
      raises.
    * Install only from the main thread (``signal.signal`` works nowhere else): ``RuntimeError``.
    * Fork: in a child forked while installed, the handler does nothing and ``__exit__`` restores
      nothing. That alone does not keep DataLoader workers alive: torch's worker loop installs
      its own C-level SIGTERM handler over the inherited one, and ``spawn`` workers inherit
      nothing; :mod:`resilience.state.worker_signals` shields them, so a signal sent to the whole
      job (Slurm signals every process of a step) leaves them serving until the save is done.
    * An empty ``signals`` makes the recorder a no-op (installs nothing, any thread).
    * A recorder is not re-entrant (``RuntimeError``); it may be entered again after exit, which
      clears what it received.

    Args:
        signals: the signals to record, e.g. from :func:`parse_preemption_signal`. Ints are
            converted to :class:`signal.Signals`.

    Raises:
        TypeError / ValueError: an item is not a signal, is uncatchable, or is repeated.
    """

    def __init__(self, signals: Iterable[signal.Signals]) -> None:
        sigs: list[signal.Signals] = []
        for item in signals:
            if isinstance(item, bool) or not isinstance(item, int):
                raise TypeError(f"SignalRecorder: expected signal.Signals, got {item!r} ({type(item).__name__})")
            sig = signal.Signals(item)
            if sig in _UNCATCHABLE:
                raise ValueError(f"SignalRecorder: {sig.name} cannot be caught")
            if sig in sigs:
                # A second install would find our own handler as "previous" and chain to itself.
                raise ValueError(f"SignalRecorder: {sig.name} is listed twice")
            sigs.append(sig)
        self._signals: tuple[signal.Signals, ...] = tuple(sigs)
        self._received: list[tuple[signal.Signals, float]] = []
        self._previous: dict[signal.Signals, Any] = {}
        self._active = False
        self._pid: int | None = None

    @property
    def signals(self) -> tuple[signal.Signals, ...]:
        """The signals this recorder handles (possibly empty)."""
        return self._signals

    @property
    def active(self) -> bool:
        """True between ``__enter__`` and ``__exit__``."""
        return self._active

    @property
    def received(self) -> list[tuple[signal.Signals, float]]:
        """A copy of the deliveries so far: ``(signal, time.monotonic() seconds)``, oldest first."""
        return list(self._received)

    @property
    def count(self) -> int:
        """How many deliveries were recorded."""
        return len(self._received)

    @property
    def first(self) -> tuple[signal.Signals, float] | None:
        """The first delivery, or ``None``."""
        return self._received[0] if self._received else None

    @property
    def pending(self) -> bool:
        """True once any signal was recorded (same as ``bool(recorder)``)."""
        return bool(self._received)

    def __bool__(self) -> bool:
        return bool(self._received)

    def __enter__(self) -> SignalRecorder:
        if self._active:
            raise RuntimeError("SignalRecorder is already active; use a new recorder per scope")
        self._received.clear()
        if not self._signals:
            self._active = True
            return self
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "SignalRecorder must be entered from the main thread: Python only installs signal "
                f"handlers there (current thread: {threading.current_thread().name!r})"
            )
        previous: dict[signal.Signals, Any] = {}
        for sig in self._signals:
            prev = signal.getsignal(sig)
            if prev is None:
                # Installed by C code before Python started: it could not be restored on exit.
                self._restore(previous)
                raise RuntimeError(
                    f"SignalRecorder: {sig.name} has a handler not installed from Python, which could not be restored; choose another preemption_signal or null"
                )
            try:
                signal.signal(sig, self._make_handler(prev))
            except BaseException:
                self._restore(previous)
                raise
            previous[sig] = prev
        self._previous = previous
        self._pid = os.getpid()
        self._active = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._active:
            return
        self._active = False
        previous, self._previous = self._previous, {}
        if self._pid is not None and os.getpid() != self._pid:
            return  # a forked child: the dispositions belong to the parent's scope
        self._pid = None
        self._restore(previous)

    @staticmethod
    def _restore(previous: dict[signal.Signals, Any]) -> None:
        for sig, prev in reversed(list(previous.items())):
            signal.signal(sig, prev)

    def _make_handler(self, prev: Any) -> Callable[[int, Any], None]:
        # SIG_DFL / SIG_IGN are not callable; default_int_handler is SIGINT's "die" (KeyboardInterrupt)
        chain = prev if callable(prev) and prev is not signal.default_int_handler else None
        received = self._received
        pid = os.getpid()
        monotonic, to_signal, getpid = time.monotonic, signal.Signals, os.getpid

        def _record(signum: int, frame: Any) -> None:
            if getpid() != pid:
                return  # forked child: see the class docstring
            received.append((to_signal(signum), monotonic()))
            if chain is not None:
                chain(signum, frame)

        return _record
