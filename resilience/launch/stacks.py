"""Print every live local rank's Python stacks into the job's output, before the ranks are ended.

The ranks register :data:`resilience.progress.STACK_DUMP_SIGNAL` with :mod:`faulthandler` (the loop
does when ``resilience run`` started it); on that signal a rank writes each thread's stack to its
stderr, which is the launcher's (the job's output), from the C signal handler: also while its
main thread waits inside a collective. A stopped rank (SIGSTOP) gets SIGCONT right after the
signal, so it prints where it stopped. A rank without the handler yet (still importing torch,
or a program that does not use the loop) is not sent the signal: its default action would kill
it; the log says so instead.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from resilience.launch.rank_group import Log, RankGroup, catches
from resilience.launch.watchdog import is_stopped
from resilience.progress import STACK_DUMP_SIGNAL

#: Seconds to leave a rank to write its stacks before the next rank's (and before SIGTERM).
DUMP_WAIT_S = 0.3


def dump_stacks(group: RankGroup, describe: Callable[[int], str], log: Log, *, wait_s: float = DUMP_WAIT_S) -> list[int]:
    """Have each live rank of ``group`` print its Python stacks, one after the other, each after a
    header line (``log``) naming the rank and ``describe(local rank)`` (what it last reported).

    Returns the local ranks that were asked to dump. Never raises for a rank that exits meanwhile.
    """
    dumped = []
    for local in group.live_ranks():
        pid, rank = group.procs[local].pid, group.ranks[local]
        if not catches(pid, STACK_DUMP_SIGNAL):
            log(f"rank {rank} (pid {pid}; {describe(local)}): no stack dump handler (not inside resilient_loop yet); no stacks")
            continue
        log(f"rank {rank} (pid {pid}; {describe(local)}): its Python stacks follow")
        try:
            stopped = is_stopped(pid)
            os.kill(pid, STACK_DUMP_SIGNAL)
            if stopped:
                os.kill(pid, signal.SIGCONT)  # the handler runs once it runs again
            time.sleep(wait_s)
            if stopped:
                os.kill(pid, signal.SIGSTOP)  # as it was: its group is being ended, not resumed
        except ProcessLookupError:
            continue
        dumped.append(local)
    return dumped
