"""One start of the local ranks, watched until they exit, and what its end means for a restart.

:func:`supervise` forwards the signals the launcher records, drives the :class:`RankGroup`'s
failure grace, and runs the progress :class:`~resilience.launch.watchdog.Watchdog`. On a stall it
prints the ranks' stacks (:func:`~resilience.launch.stacks.dump_stacks`), ends every local rank
(SIGTERM, SIGKILL after the kill grace) and reaps them. The :class:`Outcome` says whether the start
ended in order (every rank exited with the same code of the contract, or the launcher was asked
to stop) or failed, and how. With several nodes (a :class:`~resilience.launch.node_faults.NodeFaults`)
a local failure is recorded for the other nodes' launchers at once, and another node's failure ends
the local ranks at once.
"""

from __future__ import annotations

import dataclasses
import signal

from resilience.exit_codes import ExitCode
from resilience.failure_note import read_failure
from resilience.launch.exit_status import describe_code
from resilience.launch.forwarding import RecordedSignals, forward
from resilience.launch.node_faults import NodeFaults
from resilience.launch.rank_group import POLL_INTERVAL_S, Log, RankGroup
from resilience.launch.stacks import dump_stacks
from resilience.launch.watchdog import ProgressTimeout, Watchdog

#: Codes that end a start in order when every rank exits with one of them: training done, a bad
#: configuration, an agreed stop, the requeue-loop guard. Never restarted in-job.
ORDERLY_CODES = frozenset(int(code) for code in (ExitCode.DONE, ExitCode.CONFIG_ERROR, ExitCode.PREEMPTED, ExitCode.NO_PROGRESS, ExitCode.RESTART_LIMIT))


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one start ended.

    ``code``: the ranks' combined exit code (:func:`combine_exit_codes`). ``fault``: why the start
    failed, one line (``None``: it ended in order, or the launcher received a signal, so the job
    is being stopped and nothing is restarted). ``infrastructure``: the fault was a stall or a
    rank's death by a signal nobody asked for (not an exception in the program), in ranks that run
    :func:`~resilience.resilient_loop` (they reported progress): worth another allocation (exit 75)
    even without in-job restarts. ``stop_requested``: the launcher received a signal during this
    start (the job is being stopped): a fault then is not restarted in-job.
    """

    code: int
    codes: list[int]
    fault: str | None = None
    infrastructure: bool = False
    stop_requested: bool = False


def supervise(group: RankGroup, recorded: RecordedSignals, timeout: ProgressTimeout, log: Log, nodes: NodeFaults | None = None) -> Outcome:
    """Watch ``group`` until every rank has exited (see the module docstring); return the :class:`Outcome`.

    ``nodes``: the fault file shared with the other nodes' launchers (``None`` on one node)."""
    watchdog = Watchdog(group, timeout)
    group.before_term = lambda: dump_stacks(group, watchdog.describe, log)
    received = False
    code = None
    while code is None:
        for signum in recorded.take(POLL_INTERVAL_S):
            received = True
            forward(group, signum, log)
        code = group.poll()
        if code is None and nodes is not None:
            _share_first_failure(group, watchdog, nodes, log)
            peer = nodes.peer_fault()
            if peer is not None:  # its ranks are gone: ours would wait in a collective for them
                log(f"{peer.describe()}; ending every local rank")
                code = group.terminate()
                codes = [proc.returncode for proc in group.procs]
                return Outcome(code, codes, peer.describe(), infrastructure=peer.infrastructure, stop_requested=received)
        if code is None and not received:
            stall = watchdog.check()
            if stall is not None:
                log(f"watchdog: {stall.describe()}; printing the stacks of every local rank, then ending them")
                _share(nodes, stall.describe(), True, log)
                dump_stacks(group, watchdog.describe, log)
                code = group.terminate()
                codes = [proc.returncode for proc in group.procs]
                if code == ExitCode.DONE:  # it was only slow, and finished meanwhile
                    return Outcome(code, codes)
                return Outcome(code, codes, stall.describe(), infrastructure=True)
    codes = [proc.returncode for proc in group.procs]
    if received or (len(set(codes)) == 1 and codes[0] in ORDERLY_CODES):
        return Outcome(code, codes)
    local, first, why = _first_failed(group, codes)
    fault, infrastructure = f"rank {group.ranks[local]} exited with {describe_code(first)}{why}", _killed(first, watchdog)
    _share(nodes, fault, infrastructure, log)
    return Outcome(code, codes, fault, infrastructure=infrastructure)


def _first_failed(group: RankGroup, codes: list[int]) -> tuple[int, int, str]:
    """(local rank, its code, ``" (why)"`` or ``""``) of the rank that failed first. A death by a
    signal seen first (or, with every rank seen gone at once, any such death) is the likelier cause
    of the others' errors: a killed rank leaves no note. Else the earliest failure note
    (:mod:`resilience.failure_note`) decides, with its error as the why: a rank that ran out of
    memory may take longer to exit than the peers that failed because it left."""
    local, code = group.first_failure or min(((local, c) for local, c in enumerate(codes) if c != 0), key=lambda item: item[1] >= 0)
    if code < 0 or group.ready_dir is None:
        return local, code, ""
    notes = {other: read_failure(group.ready_dir, group.ranks[other]) for other, c in enumerate(codes) if c != 0}
    noted = {other: note for other, note in notes.items() if note is not None}
    if not noted:
        return local, code, ""
    local = min(noted, key=lambda other: noted[other].t)
    return local, codes[local], f" ({noted[local].error})"


def _killed(code: int, watchdog: Watchdog) -> bool:
    """A rank's death by a signal nobody asked for, in a program that reports progress. SIGTERM is
    the failure grace's or someone's stop; a program outside resilient_loop (no report) has no
    LATEST to resume from, so its kill is not turned into a requeue."""
    return code < 0 and code != -signal.SIGTERM and bool(watchdog.read())


def _share_first_failure(group: RankGroup, watchdog: Watchdog, nodes: NodeFaults, log: Log) -> None:
    """Record a rank's failure for the other nodes as soon as it is seen (the local ranks left may
    still run out their failure grace): their ranks would wait in a collective for this one."""
    if group.first_failure is not None and not nodes.recorded:
        local, code = group.first_failure
        if code not in ORDERLY_CODES:
            _share(nodes, f"rank {group.ranks[local]} exited with {describe_code(code)}", _killed(code, watchdog), log)


def _share(nodes: NodeFaults | None, text: str, infrastructure: bool, log: Log) -> None:
    if nodes is None:
        return
    try:
        if nodes.record_fault(text, infrastructure):
            log(f"told the other nodes' launchers (in {nodes.path}): {text}")
    except OSError as error:
        log(f"cannot record the failure in {nodes.path} for the other nodes: {error}")
