"""Several nodes' launchers fail and restart together, through one shared file.

With several nodes each runs its own ``resilience run``, and the ranks of all of them form one job.
A failure one launcher sees (a stall, a rank killed or crashed) must end every node's ranks, or the
others wait in a collective for a peer that is gone until the collective timeout; and an in-job
restart must start every node's ranks again together, once all the old ones are gone (the
rendezvous store lives in rank 0's process). The launchers share one file, ``--fault-file``, on a
filesystem every node sees (the multi-node batch template passes
``$RESILIENCE_STATE_DIR/<job>.<restart>.faults``, next to the stop file and pid files, which already
need that), and append one-line records to it. ``START`` counts the launcher's starts of the ranks
in this job (0 first, 1 after one in-job restart, ...):

========================================  =====================================================
``fault START NODE INFRA TEXT``           node NODE's start START failed: TEXT says how; INFRA
                                          1 for a stall or a kill (worth a requeue), 0 for a
                                          rank's error exit
``restart START NODE``                    node NODE reaped its ranks and waits to begin START
``end START NODE``                        node NODE will not begin START (no restart left, a
                                          stop signal, its ranks ended in order)
========================================  =====================================================

A launcher reads the file at most every :data:`READ_INTERVAL_S` while its ranks run; when another
node's ``fault`` record of the current start appears it ends its own ranks at once (SIGTERM, then
SIGKILL after ``--kill-grace``). Before a restart every launcher writes ``restart`` and waits
until every node has (the barrier); an ``end`` record, or a node that never arrives within the
barrier's timeout, cancels the restart everywhere and the launchers exit 75 (requeue).

Why a file and not torch's rendezvous store or a Slurm step restart: the store lives in rank 0,
which may be the rank that died, and is gone while the ranks are down between two starts; the
shared state directory outlives every rank, works outside Slurm, and costs one failed ``open`` per
read while no node has failed. Each record is one ``write`` of a file opened with ``O_APPEND``
(whole on a local or POSIX filesystem).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

READ_INTERVAL_S = 0.25
"""Seconds between two reads of the file while the ranks run (the propagation latency)."""
SETTLE_S = 2.0
"""Seconds a launcher whose ranks failed by an error exit waits for another node's record saying
it saw the cause first (a rank killed there makes the ranks here fail in their next collective)."""


@dataclasses.dataclass(frozen=True)
class Record:
    """One line of the fault file (see the module docstring)."""

    kind: str
    start: int
    node: int
    infrastructure: bool = False
    text: str = ""

    def describe(self) -> str:
        """``"node 1's launcher: rank 1 exited with signal SIGKILL"``."""
        return f"node {self.node}'s launcher: {self.text}"


def parse(line: str) -> Record | None:
    """The record on ``line``; ``None`` for a torn or foreign line."""
    parts = line.rstrip("\n").split(" ", 4)
    try:
        if parts[0] == "fault" and len(parts) == 5:
            return Record("fault", int(parts[1]), int(parts[2]), parts[3] == "1", parts[4])
        if parts[0] in ("restart", "end") and len(parts) == 3:
            return Record(parts[0], int(parts[1]), int(parts[2]))
    except ValueError:
        pass
    return None


class NodeFaults:
    """This node's view of the shared fault file at ``path`` (see the module docstring).

    ``node``: this node's rank (``--node-rank``); ``nnodes``: how many launchers share the file.
    :attr:`start` is the start being watched; :meth:`begin` moves it on. ``clock`` and ``sleep``
    are ``time.monotonic`` and ``time.sleep`` unless a test passes both.
    """

    def __init__(
        self,
        path: str,
        node: int,
        nnodes: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.path = path
        self.node = node
        self.nnodes = nnodes
        self.start = 0
        self._clock = clock
        self._sleep = sleep
        self._recorded = False
        self._next_read = 0.0

    def begin(self, start: int) -> None:
        """Watch start ``start`` from now on (0 first, +1 per in-job restart)."""
        self.start = start
        self._recorded = False
        self._next_read = 0.0

    def _append(self, line: str) -> None:
        """One record, one ``write``. Raises ``OSError`` when the file cannot be written."""
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line.replace("\n", " ") + "\n").encode())
        finally:
            os.close(fd)

    def records(self) -> list[Record]:
        """Every record in the file now; ``[]`` when there is none (or it cannot be read)."""
        try:
            with open(self.path) as fh:
                lines = fh.readlines()
        except OSError:
            return []
        return [record for record in map(parse, lines) if record is not None]

    @property
    def recorded(self) -> bool:
        """This node recorded a fault of the current start."""
        return self._recorded

    def record_fault(self, text: str, infrastructure: bool) -> bool:
        """Tell the other nodes that this node's current start failed (once per start; later calls
        do nothing). Returns True when this call wrote the record."""
        if self._recorded:
            return False
        self._recorded = True
        self._append(f"fault {self.start} {self.node} {int(infrastructure)} {text}")
        return True

    def peer_fault(self) -> Record | None:
        """Another node's ``fault`` record of the current start, or ``None``; reads the file at most
        every :data:`READ_INTERVAL_S` seconds (``None`` in between)."""
        now = self._clock()
        if now < self._next_read:
            return None
        self._next_read = now + READ_INTERVAL_S
        return next((r for r in self.records() if r.kind == "fault" and r.start == self.start and r.node != self.node), None)

    def peer_infrastructure(self, wait_s: float = SETTLE_S) -> Record | None:
        """Another node's ``fault`` record of the current start with INFRA 1, waiting up to
        ``wait_s`` seconds for one to appear; ``None`` when none did."""
        deadline = self._clock() + wait_s
        while True:
            found = next(
                (r for r in self.records() if r.kind == "fault" and r.start == self.start and r.node != self.node and r.infrastructure),
                None,
            )
            if found is not None or self._clock() >= deadline:
                return found
            self._sleep(READ_INTERVAL_S)

    def record_end(self) -> None:
        """Tell the other nodes that this node will not begin another start (no error if the file
        cannot be written: they then give up at the barrier's timeout)."""
        try:
            self._append(f"end {self.start + 1} {self.node}")
        except OSError:
            pass

    def wait_for_restart(self, timeout_s: float) -> str | None:
        """The barrier before start ``start + 1``: record ``restart`` and wait until every node has.

        Returns ``None`` when all have (then :meth:`begin` the new start), else why not: another
        node recorded ``end``, or ``timeout_s`` seconds passed. Raises ``OSError`` when the file
        cannot be written."""
        start = self.start + 1
        self._append(f"restart {start} {self.node}")
        deadline = self._clock() + timeout_s
        while True:
            records = [r for r in self.records() if r.start == start]
            ended = sorted({r.node for r in records if r.kind == "end"})
            if ended:
                return f"node(s) {ended} will not restart"
            arrived = {r.node for r in records if r.kind == "restart"}
            if len(arrived) >= self.nnodes:
                return None
            if self._clock() >= deadline:
                missing = sorted(set(range(self.nnodes)) - arrived)
                return f"node(s) {missing} did not get ready to restart within {timeout_s:g} s"
            self._sleep(READ_INTERVAL_S)
