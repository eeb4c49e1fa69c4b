"""Interleaved blocks of timed steps on a bench rank (:mod:`bench.ddp_worker`): the default stop
agreement, and the watchdog's progress reports, each against a no-op call in the same harness
(the A/A control) and the bare step."""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from bench.direct_cost import AUTO_INTERVAL_S

if TYPE_CHECKING:
    from bench.ddp_worker import DigitsRun


def ab_phase(
    run: DigitsRun, rank: int, counter: list[int], pairs: int, steps: int, warmup: int, make_agreement, *, max_s: float = 0.0, half_width: float = 0.004
) -> list[dict[str, float]]:
    """At least ``pairs`` rows of timed blocks of ``steps`` steps: without the agreement
    (``none``), with a no-op call (``noop``) and with the default agreement (``ours_auto``), in
    the rotating orders of :func:`interleaved_pairs`.

    With ``max_s`` > 0 it goes on, 12 rows at a time, until the normal-approximation 95 %
    half-width of the per-row overhead over ``noop`` is at most ``half_width`` or ``max_s``
    seconds have passed (rank 0 decides and broadcasts, between blocks).

    One agreement (and its step clock) lives across all ``ours_auto`` blocks, as in a real run:
    its cadence is settled before the first timed block and is not reset between blocks. The
    step clock restarts at each such block (``record_save``, as after a save) so the ``none``
    block in between does not count as one long step. Returns one row per round:
    ``{"none", "noop", "ours_auto"}`` mean step times (s) and ``ours_auto_boundary_s`` (mean time in the call).
    """
    from resilience.timing import RunTimer, auto_cadence

    agreement, _ = make_agreement("auto")
    timer = RunTimer()

    def propose() -> int:
        timer.boundary()
        return auto_cadence(timer.step_s, AUTO_INTERVAL_S) if rank == 0 and agreement.starts_round(counter[0]) else 0  # as the loop

    def boundary() -> None:
        agreement.update(counter[0], 0, propose_every_steps=propose())

    try:
        rows = interleaved_pairs(
            run,
            rank,
            counter,
            pairs,
            steps,
            "ours_auto",
            boundary,
            settle=4 * warmup,
            warmup=warmup,
            before_block=lambda: timer.record_save(0.0),
            max_s=max_s,
            half_width=half_width,
        )
    finally:
        agreement.close()
    if rank == 0 and rows:
        print(f"ddp A/B: {len(rows)} rows of {steps} steps, {_versus(rows, 'ours_auto')} (every {agreement.every_steps} steps at the end)", flush=True)
    return rows


def progress_ab_phase(run: DigitsRun, rank: int, counter: list[int], pairs: int, steps: int, warmup: int, *, max_s: float = 0.0) -> list[dict[str, float]]:
    """The watchdog's cost on the step: the same interleaved pairs (:func:`interleaved_pairs`),
    without (``none``) and with this rank's progress report at every step boundary (``progress``:
    ``ProgressReporter.step``, what ``resilient_loop`` calls, writing the record ``resilience
    run``'s watchdog reads; the launcher's reads run beside both kinds of block alike). The
    record goes to ``RESILIENCE_PROGRESS_FILE`` (set by the launcher), else a temporary file.
    Ends with a ``done`` report, so a watchdog stops watching this rank."""
    import tempfile

    from resilience.env_names import PROGRESS_FILE_ENV
    from resilience.progress import ProgressReporter

    path = os.environ.get(PROGRESS_FILE_ENV) or os.path.join(tempfile.mkdtemp(prefix="bench-progress-"), f"rank{rank}")
    reporter = ProgressReporter(path)
    reporter.phase("step", counter[0])
    try:
        rows = interleaved_pairs(run, rank, counter, pairs, steps, "progress", lambda: reporter.step(counter[0]), settle=warmup, warmup=warmup, max_s=max_s)
    finally:
        reporter.phase("done", counter[0])
        reporter.close()
    if rank == 0 and rows:
        print(f"ddp A/B: {len(rows)} rows of {steps} steps, progress reports: {_versus(rows, 'progress')}", flush=True)
    return rows


def interleaved_pairs(
    run: DigitsRun,
    rank: int,
    counter: list[int],
    pairs: int,
    steps: int,
    name: str,
    boundary: Callable[[], None],
    *,
    settle: int,
    warmup: int,
    before_block: Callable[[], None] | None = None,
    max_s: float = 0.0,
    half_width: float = 0.004,
) -> list[dict[str, float]]:
    """Rows of three timed blocks of ``steps`` steps each: ``none`` (the bare step), ``noop`` (the
    step, then a call that does nothing, timed like the real one: the A/A control) and ``name``
    (the step then ``boundary()``), until :func:`_ab_done` (see :func:`ab_phase`). The rows cycle
    through the six orders of the three arms, so each arm runs first, second and last equally
    often and after each other arm equally often, and a linear drift cancels every six rows.
    First ``settle`` untimed steps with the boundary call and ``warmup`` without.
    ``before_block`` runs before each ``name`` block, untimed. Returns one row per round:
    ``{"none", "noop", name}`` mean step times (s) and ``<name>_boundary_s`` (mean time in
    ``boundary``)."""
    calls: dict[str, Callable[[], None] | None] = {"none": None, "noop": _noop, name: boundary}
    orders = list(itertools.permutations(calls))

    def block(variant: str, n: int) -> tuple[float, float]:
        if variant == name and before_block is not None:
            before_block()
        call = calls[variant]
        in_call = 0.0
        start = time.perf_counter()
        for _ in range(n):
            run.step()
            counter[0] += 1
            if call is not None:
                mid = time.perf_counter()
                call()
                in_call += time.perf_counter() - mid
        return (time.perf_counter() - start) / max(1, n), in_call / max(1, n)

    rows: list[dict[str, float]] = []
    dist.barrier()
    block(name, settle)  # untimed
    block("none", warmup)
    started = time.monotonic()
    while True:
        row: dict[str, float] = {}
        for variant in orders[len(rows) % len(orders)]:
            dist.barrier()
            row[variant], inside = block(variant, steps)
            if variant == name:
                row[f"{name}_boundary_s"] = inside
        rows.append(row)
        if len(rows) >= pairs and (len(rows) - pairs) % 12 == 0 and _ab_done(rows, rank, max_s, half_width, time.monotonic() - started, name):
            return rows


def _versus(rows: list[dict[str, float]], name: str) -> str:
    """``name`` vs the no-op call and vs the bare step, and the no-op vs the bare step, as text."""

    def over(a: str, b: str) -> str:
        return f"{sum(r[a] for r in rows) / sum(r[b] for r in rows) - 1:+.2%}"

    return f"{name} vs noop {over(name, 'noop')}, vs none {over(name, 'none')} (noop vs none {over('noop', 'none')})"


def _noop() -> None:
    """The A/A arm's call: the harness's own cost, without the thing measured."""


def _ab_done(rows: list[dict[str, float]], rank: int, max_s: float, half_width: float, elapsed_s: float, name: str = "ours_auto") -> bool:
    """Rank 0's verdict, broadcast to every rank: enough rows (see :func:`ab_phase`)."""
    done = torch.ones(1, dtype=torch.int64)
    if rank == 0 and max_s > 0 and elapsed_s < max_s and len(rows) >= 2:
        fractions = [r[name] / r["noop"] - 1 for r in rows]
        done[0] = int(1.96 * statistics.stdev(fractions) / len(fractions) ** 0.5 <= half_width)
    dist.broadcast(done, src=0)
    return bool(done.item())
