"""Cross-rank stop-step agreement: every rank stops after the same step, at negligible cost.

A preemption signal reaches ranks at different moments (or only some of them), yet all ranks must
stop after the same step, or the ones still stepping wait forever in the training's collectives.
:class:`StopAgreement` combines each rank's local stop flag with a MAX all-reduce that is started
non-blocking at one step boundary and read at the next, so the per-step path never blocks on a
collective that had less than a whole cadence to finish (measured on 2 CPU ranks: a blocking
all-reduce every step costs 2-8 % of a 20-40 ms step; this pattern about a quarter of that).

At scale the round itself is the cost: gloo's ring all-reduce takes ``2(N - 1)`` sequential hops,
past the default 0.5 s cadence at thousands of ranks. When the ranks span several nodes, with several ranks
on a node, the MAX runs on node-local groups plus a group of node leaders instead
(:mod:`resilience.stop.node_groups`; bench/agreement.py measures the hop and prints both costs).
"""

from __future__ import annotations

import operator
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from resilience.stop.node_groups import NodeGroups, node_key


def _reason(value: Any, what: str) -> int:
    if isinstance(value, bool):
        return int(value)
    try:
        code = operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: expected 0 (no stop), a positive int reason code, or a bool, got {value!r} ({type(value).__name__})") from None
    if code < 0:
        raise ValueError(f"{what}: reason codes are >= 0 (0 = no stop), got {code}")
    return code


class StopAgreement:
    """Agree across ranks on whether, and why, to stop after the current step.

    Call :meth:`update` on every rank at every step boundary, right after step ``global_step``
    finished, with that rank's local stop reason (0 = no; 1 = preemption signal; larger codes are
    free for deadlines, failures, ...). It returns 0 to continue, or the agreed reason code > 0,
    which every rank receives at the same ``global_step``: stop after this step.

    How: at each boundary where ``global_step % every_steps == 0`` the rank waits for the
    all-reduce (MAX, one int64) it started at the previous boundary, reads it, and starts a new
    one carrying its current flag (``async_op=True``). Every rank starts the same sequence of
    collectives and reads the k-th result at the same step, so the decision is deterministic. A
    local flag is sticky: once passed, it is carried by every later collective until agreed.
    Codes combine by MAX, so a larger code raised on one rank wins over a smaller one elsewhere.
    Once a code is agreed it is final: every later :meth:`update` returns it and starts nothing.

    Stop latency (``k = every_steps``): if the first nonzero ``local_stop`` on any rank is passed
    to ``update(t, ...)``, every rank gets the stop from ``update(s, ...)`` with

        ``t + k <= s <= t + 2k - 1``  (exactly ``s = ceil(t / k) * k + k``),

    i.e. after ``k`` to ``2k - 1`` more steps, or at most ``(2k - 1) * step_time`` seconds after
    step ``t`` ended (``k = 1``: exactly one more step). A signal that arrives during step ``t``
    is passed at ``update(t)`` if the caller polls its recorder right before calling. To stop
    within ``G`` seconds of a signal (Slurm ``--signal=TERM@G``) while leaving ``save_s`` seconds
    for the checkpoint, choose ``k <= (G - save_s) / (2 * step_time)``.

    Adaptive cadence (``adaptive=True``): each collective also carries a proposed cadence (the
    MAX over ranks of what :meth:`update` got as ``propose_every_steps``; the loop proposes on
    rank 0 only, from its measured step time, and 0 elsewhere). Every rank reads the same
    proposal at the same step and switches to it there, so the ranks stay in lockstep; the
    latency bound above then holds with ``k`` the larger of the old and new cadence. With
    ``adaptive`` the constructor also times a few blocking rounds (:attr:`round_s`), so that the
    proposer can keep a round's time under the time between rounds: then the round a boundary
    reads has finished, and :meth:`update` never waits for it, however long rounds are at scale.

    Node groups (``nodes="auto"``, the default): when ``group`` spans every rank and the launcher's
    environment places them on 2+ nodes with 2+ ranks on some node, each round is a MAX within the
    node, among the node leaders, and a broadcast back (:class:`~resilience.stop.node_groups.NodeGroups`),
    with the same rounds at the same steps, so the same stop step; otherwise (``nodes="flat"``,
    one node, one rank per node, a rank without node information) one all-reduce on ``group``.

    Local mode: with ``group=None`` and torch.distributed not initialised there are no
    collectives; :meth:`update` returns the sticky local flag at once (any step, no cadence).

    Args:
        group: a dedicated gloo process group for our collectives, made by the caller with
            ``dist.new_group(backend="gloo")`` on every rank (gloo, so it works on CPU tensors
            when training uses NCCL). With ``None`` and torch.distributed initialised, the
            constructor creates one itself; ``dist.new_group`` is a collective, so then every
            rank must construct its ``StopAgreement`` at the same point.
        adaptive: let the cadence follow the proposals passed to :meth:`update` (see above).
        every_steps: the (initial) cadence ``k`` in steps, >= 1 (default 1). Must be equal on all ranks:
            the constructor checks it with one blocking all-reduce and raises ``ValueError`` on
            every rank if not. The per-step cost (about one small all-reduce, see module doc)
            is divided by ``k``; the latency above grows with it.
        nodes: ``"auto"`` (node groups where they help, see above) or ``"flat"``.
        timeout_s: seconds bounding each collective on the node groups (``None``: torch's
            default); pass the timeout ``group`` was made with so a dead peer fails a round alike.

    Raises:
        TypeError: ``every_steps`` is not an int.
        ValueError: ``every_steps < 1``, or differs between ranks, or ``nodes`` is not one of the above.

    All ranks must call :meth:`update` at the same sequence of ``global_step`` values, and
    :meth:`drain`, :meth:`agree_now` and :meth:`close` at the same points.
    """

    def __init__(
        self, group: dist.ProcessGroup | None = None, *, every_steps: int = 1, adaptive: bool = False, nodes: str = "auto", timeout_s: float | None = None
    ) -> None:
        if isinstance(every_steps, bool) or not isinstance(every_steps, int):
            raise TypeError(f"every_steps: expected an int >= 1, got {every_steps!r} ({type(every_steps).__name__})")
        if every_steps < 1:
            raise ValueError(f"every_steps: must be >= 1, got {every_steps}")
        if nodes not in ("auto", "flat"):
            raise ValueError(f"nodes: expected 'auto' or 'flat', got {nodes!r}")
        self.every_steps = every_steps
        """The current cadence in steps (it changes only with ``adaptive``); read it, do not set it."""
        self._adaptive = adaptive
        self._owns_group = False
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.new_group(backend="gloo")  # collective: every rank makes the same call
            self._owns_group = True
        self.group = group
        """The gloo group used (``None`` in local mode, and after :meth:`close`)."""
        self.node_groups: NodeGroups | None = None
        """The node-local and leader groups each round runs on (``None``: one flat all-reduce)."""
        self.local = 0
        """This rank's sticky local reason code (MAX of every ``local_stop`` passed); read only."""
        self.agreed = 0
        """The agreed reason code so far (0 = none yet; final once > 0); read only."""
        self._work: Any = None  # the in-flight all-reduce, or None
        self._buf = torch.zeros(2, dtype=torch.int64)  # [stop code, proposed cadence]
        self._closed = False
        self.round_s = 0.0
        """Seconds one round took at construction with ``adaptive`` (the slowest of 3 on this rank,
        after a first that connects); 0.0 without ``adaptive`` or in local mode."""
        if self.group is not None:
            try:
                if nodes == "auto" and dist.get_world_size(self.group) == dist.get_world_size() > 1:
                    self._check_same_cadence_and_find_nodes(timeout_s)
                else:
                    self._check_same_cadence()
                if adaptive:
                    self.round_s = self._time_rounds()
            except BaseException:
                if self._owns_group:
                    dist.destroy_process_group(self.group)
                raise

    def _time_rounds(self, rounds: int = 3) -> float:
        """The slowest of ``rounds`` blocking rounds on this rank, in seconds, after one untimed
        round (it makes the connections when gloo connects lazily)."""
        probe = torch.zeros(2, dtype=torch.int64)
        self._wait(self._start(probe))
        slowest = 0.0
        for _ in range(rounds):
            t0 = time.perf_counter()
            self._wait(self._start(probe))
            slowest = max(slowest, time.perf_counter() - t0)
        return slowest

    def _check_same_cadence(self) -> None:
        both = torch.tensor([self.every_steps, -self.every_steps], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        self._raise_unless_same(int(both[0]), -int(both[1]))

    def _check_same_cadence_and_find_nodes(self, timeout_s: float | None) -> None:
        """One all-gather of (node, cadence) from every rank: the same list everywhere, so the same
        decision (node groups or flat) and the same cadence error on every rank."""
        mine = torch.tensor([node_key(os.environ), self.every_steps], dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(rows, mine, group=self.group)
        cadences = [int(row[1]) for row in rows]
        self._raise_unless_same(max(cadences), min(cadences))
        self.node_groups = NodeGroups.build([int(row[0]) for row in rows], dist.get_rank(), timeout_s)

    def _raise_unless_same(self, high: int, low: int) -> None:
        if high != low:
            raise ValueError(f"every_steps: must be equal on all ranks, got values from {low} to {high} (this rank: {self.every_steps})")

    @property
    def distributed(self) -> bool:
        """True when combining over a process group; False in local mode."""
        return self.group is not None

    @property
    def in_flight(self) -> bool:
        """True while a started all-reduce has not been read yet."""
        return self._work is not None

    def update(self, global_step: int, local_stop: int | bool, *, propose_every_steps: int = 0) -> int:
        """Record this rank's flag after step ``global_step``; return the agreed code (0 = continue).

        Args:
            global_step: the step that just finished, >= 0; the same sequence on every rank.
            local_stop: 0/False (no stop) or a reason code > 0 / True (= 1).
            propose_every_steps: with ``adaptive``, a cadence to switch to (0 = no proposal),
                carried by the collective started here; ignored otherwise.

        Returns:
            0 to continue, or the reason code > 0 that every rank gets at this same step.

        Raises:
            TypeError / ValueError: bad ``global_step`` or ``local_stop``.
            RuntimeError: after :meth:`close`.
        """
        # Between rounds with nothing new to carry, a plain int step returns at once: this runs after
        # every step, with the interpreter's caches cold from the step (bench/direct_cost.py).
        if (
            type(global_step) is int
            and type(local_stop) is int
            and 0 <= local_stop <= self.local
            and global_step > 0
            and global_step % self.every_steps
            and not self.agreed
            and self.group is not None
        ):
            return 0
        step = _reason(global_step, "global_step")
        code = _reason(local_stop, "local_stop")
        self._check_open()
        if code > self.local:
            self.local = code
        if self.agreed:
            return self.agreed
        if self.group is None:
            self.agreed = self.local
            return self.agreed
        if step % self.every_steps:
            return 0
        if self._work is not None:
            result = self._read()
            if result:
                self.agreed = result
                return result
        self._buf[0] = self.local
        self._buf[1] = max(0, int(propose_every_steps)) if self._adaptive else 0
        self._work = self._start(self._buf)
        return 0

    def starts_round(self, global_step: int) -> bool:
        """True when :meth:`update` at ``global_step`` reads and starts a round (so carries a
        proposed cadence); False between rounds, once agreed, in local mode and after :meth:`close`.
        Lets a proposer compute its proposal only when it is sent."""
        return self.group is not None and not self.agreed and global_step % self.every_steps == 0

    def _start(self, tensor: torch.Tensor) -> Any:
        """Begin ``tensor = MAX over ranks`` in place: a gloo work or a future (node groups)."""
        if self.node_groups is not None:
            return self.node_groups.start(tensor)
        return dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def _read(self) -> int:
        work, self._work = self._work, None
        self._wait(work)
        if self._adaptive and int(self._buf[1]) >= 1:
            self.every_steps = int(self._buf[1])  # the same value at the same step on every rank
        return int(self._buf[0])

    def _wait(self, work: Any) -> None:
        if self.node_groups is not None:
            work.result()  # re-raises a failed round (a dead peer past the timeout)
        else:
            work.wait()

    def drain(self) -> int:
        """Wait for the in-flight all-reduce, if any, and return the agreed code (0 = none).

        Call on every rank at the same point (end of training) so no rank leaves a collective
        pending. Idempotent: a second call waits for nothing and returns the same code. After a
        drain that returned 0, :meth:`update` may continue (the next boundary starts afresh).
        """
        if self._work is not None:
            result = self._read()
            if result > self.agreed:
                self.agreed = result
        return self.agreed

    def close(self) -> int:
        """:meth:`drain`, then forget the group (destroying it if the constructor created it).

        Returns the drained code. Idempotent; :meth:`update` raises afterwards.
        """
        if self._closed:
            return self.agreed
        try:
            return self.drain()
        finally:
            self._closed = True
            self._work = None
            group, self.group = self.group, None
            nodes, self.node_groups = self.node_groups, None
            if nodes is not None:
                nodes.close()
            if self._owns_group and group is not None and dist.is_initialized():
                dist.destroy_process_group(group)

    def agree_now(self, local_stop: int | bool) -> int:
        """One blocking MAX all-reduce of ``local_stop`` over all ranks, for rare one-shot decisions.

        Every rank must call it at the same point. Independent of :meth:`update`'s sticky flag.
        Local mode: returns ``local_stop`` as an int. Cost: one small blocking all-reduce
        (~0.2 ms on 2 CPU ranks, plus waiting for the slowest rank).
        """
        code = _reason(local_stop, "local_stop")
        self._check_open()
        if self.group is None:
            return code
        value = torch.tensor([code], dtype=torch.int64)
        if self.node_groups is not None:
            self.node_groups.start(value).result()  # queued after a round in flight, as gloo orders its own
        else:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return int(value[0])

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("StopAgreement is closed")

    def __enter__(self) -> StopAgreement:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a dead peer must not hide the error that got us here
            pass
