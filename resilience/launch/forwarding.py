"""The signals the launcher records and passes on to its ranks, and how one is passed on."""

from __future__ import annotations

import collections
import os
import select
import signal
import socket
from collections.abc import Sequence

from resilience.launch.rank_group import STOP_SIGNALS, Log, RankGroup

#: Signals the ``run`` command records and forwards to every live rank. USR1/USR2/TERM are
#: what Slurm sends (``--signal``, preemption, time limit, ``scancel``); INT, HUP and QUIT are
#: the terminal's, forwarded rather than left to kill the launcher and orphan its ranks
#: (torchrun handles the same last three).
FORWARDED_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
)
# STOP_SIGNALS (from rank_group) request a preemption stop: recorded in the stop file and held
# for ranks that have not installed their handlers yet (see RankGroup.request_stop).

# Keyboard signals: a terminal sends them to its whole foreground process group.
_KEYBOARD_SIGNALS = frozenset({signal.SIGINT, signal.SIGQUIT})


class RecordedSignals:
    """Scoped handlers that only record signal numbers; :meth:`take` waits for and drains them.

    Not :class:`resilience.stop.signals.SignalRecorder`: that one chains to the previous Python
    handler (SIGINT's raises ``KeyboardInterrupt``) and has no wakeup; the launcher must
    replace every disposition, and forward at once.

    A handler appends to a deque and returns. ``signal.set_wakeup_fd`` makes the C-level
    handler write a byte to a socket, so :meth:`take` wakes at once instead of at the next
    poll. Leaving the ``with`` block restores the previous handlers and wakeup fd. Must be
    entered from the main thread (``signal.signal``'s rule; ``ValueError`` otherwise).
    """

    def __init__(self, signals: Sequence[int]) -> None:
        self._signals = list(signals)
        self._pending: collections.deque[int] = collections.deque()
        self._previous: dict[int, object] = {}
        self._previous_wakeup_fd = -1
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None

    def _record(self, signum: int, frame: object) -> None:
        self._pending.append(signum)

    def __enter__(self) -> RecordedSignals:
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        try:
            self._previous_wakeup_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
            for signum in self._signals:
                self._previous[signum] = signal.signal(signum, self._record)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def take(self, timeout: float) -> list[int]:
        """Signals recorded so far, oldest first; waits up to ``timeout`` seconds for one."""
        if not self._pending and self._reader is not None:
            select.select([self._reader], [], [], timeout)
        if self._reader is not None:
            try:
                while self._reader.recv(512):
                    pass
            except BlockingIOError:
                pass
        taken = []
        while self._pending:
            taken.append(self._pending.popleft())
        return taken

    def __exit__(self, *exc_info: object) -> None:
        for signum, previous in reversed(list(self._previous.items())):
            signal.signal(signum, previous)  # type: ignore[arg-type]
        self._previous.clear()
        if self._writer is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            self._writer.close()
            self._writer = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def _terminal_already_delivered(signum: int) -> bool:
    """True for SIGINT/SIGQUIT while we are the terminal's foreground process group.

    Ctrl-C (Ctrl-backslash) at a terminal sends SIGINT (SIGQUIT) to the whole foreground
    process group, ranks included (they share our group). Forwarding it again would hit each
    rank twice, e.g. a second ``KeyboardInterrupt`` in the middle of the first one's cleanup.
    A ``kill -INT`` while we are in the foreground is then not forwarded either (the log
    says so); without a controlling terminal (Slurm, nohup, setsid) every one is forwarded.
    """
    if signum not in _KEYBOARD_SIGNALS:
        return False
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:  # no controlling terminal: the SIGINT came from kill/scancel
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def forward(group: RankGroup, signum: int, log: Log) -> None:
    """Pass ``signum`` on to the live ranks of ``group`` (a stop signal through
    :meth:`RankGroup.request_stop`), logging one line about it with ``log``."""
    name = signal.Signals(signum).name
    if _terminal_already_delivered(signum):
        log(f"{name} from the terminal already reached the ranks; not forwarded")
        return
    if signum in STOP_SIGNALS:
        sent, held = group.request_stop(signum)
        if held:
            log(
                f"{name}: ranks {[group.ranks[local] for local in held]} are not ready yet; "
                "recorded a pending stop and holding the signal for them (a signal sent to the whole "
                "process group reaches them directly and ends them)"
            )
    else:
        sent = group.send_signal(signum)
    if sent:
        log(f"forwarded {name} to ranks {[group.ranks[local] for local in sent]}")
    elif not group.live_ranks():
        log(f"received {name}; no rank left running to forward it to")
