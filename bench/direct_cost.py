"""The step boundary's cost measured directly, call by call, on a bench rank (issue 27, item 2).

Run by :mod:`bench.ddp_worker` after the interleaved rows, in the same two processes. The digits
DDP step runs as in a real loop and each boundary call is timed on the training thread with
``time.perf_counter`` around it, thousands of times, in chunks of consecutive boundaries:

* the stop agreement: ``StopAgreement.update`` at the default cadence (``auto``, one agreement
  alive across all chunks, its step clock and proposal computed at each boundary as the loop
  does), on a gloo group of its own made for this phase. The call's time includes any wait for
  the round in flight. What the call does not show is the round itself, run by gloo's threads
  while training goes on: every CPU second those threads take is a second the two ranks, which
  use both cores, do not get. So the threads the group started are found (the tasks of
  ``/proc/self/task`` that appeared when it was made) and their CPU time per chunk is read from
  their thread CPU clocks and charged to the boundaries in full, as if each of their CPU seconds
  delayed the step by a second (true on 2 saturated cores; on a node with spare cores they cost
  the step nothing). The same threads' CPU over as many steps without the agreement is measured
  first (``idle``: should be ~0, the attribution's check);
* the same at cadence 1 (a round every step), the calibration: its direct figure can be held
  against the rounds' A/B figure for ``ours_k1``, where the cost is large enough to see;
* the watchdog's progress report (``ProgressReporter.step``, what ``resilient_loop`` calls): one
  ``pwrite`` per boundary and a 256-byte record at most every 0.5 s, all on the training thread;
* a call that does nothing, timed the same way: the baseline (below).

What is charged per boundary: the call's wall time less the time the training thread was runnable
but waiting for a CPU during it (read from its ``schedstat``), i.e. its own CPU in the call plus
any sleep waiting for the round in flight, plus gloo's threads' CPU. The time spent runnable but
waiting inside the call is not charged again: a wake-up of gloo's threads preempting the caller
is their CPU (charged already), another process's is the machine, not the call. The wall-time
figure (the call's whole wall time + gloo's CPU: an upper estimate that counts such a preemption
twice) is kept beside it. The reads of the clocks around each call cost a few microseconds each
time here (far more than in a tight loop: after a training step the interpreter runs cold): a call
that does nothing, timed the same way in the same processes (``noop``), measures them, and its
mean is subtracted (``baseline_s``, its interval carried into the figure's).

Each rank returns, per chunk, the summed call time, the charged thread CPU and every step's time
(to take the median step of the same run); :func:`bench.ddp.bench_agreement` turns them into
figures with their intervals.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from resilience.config import StepSchedulerConfig

if TYPE_CHECKING:
    from bench.ddp_worker import DigitsRun

AUTO_INTERVAL_S = StepSchedulerConfig().agreement_interval_s  # the library's default


def _tasks() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def thread_cpu_s(tids: set[int]) -> float:
    """CPU seconds the threads ``tids`` of this process have used (their thread CPU clocks:
    ``CLOCK_THREAD_CPUTIME_ID`` of another thread, ``(~tid << 3) | 6``, as glibc builds it)."""
    total = 0
    for tid in tids:
        try:
            total += time.clock_gettime_ns(((~tid) << 3) | 6)
        except OSError:  # the thread has exited
            pass
    return total / 1e9


def _run_delay_ns(fd: int) -> int:
    """This thread's total time runnable but waiting for a CPU (ns): ``schedstat``'s second
    field, complete up to now (a wait is added when it ends, and this thread is running)."""
    return int(os.pread(fd, 128, 0).split()[1])


def _chunks(run: DigitsRun, counter: list[int], calls: int, chunk: int, boundary: Callable[[], None] | None, tids: set[int]) -> list[dict[str, Any]]:
    """``calls`` steps in chunks of ``chunk``, each step followed by ``boundary()`` (timed) when given.

    Per chunk: ``call_s`` (wall time in the calls), split into ``call_cpu_s`` (this thread on a
    CPU), ``call_runq_s`` (runnable, waiting for a CPU another thread held: charged through that
    thread's CPU when it is gloo's, noise when another process's) and ``call_blocked_s`` (the
    rest: asleep, waiting for the round, and the clock reads' own cost); ``thread_cpu_s`` of ``tids``; every step's time."""
    fd = os.open(f"/proc/self/task/{threading_native_id()}/schedstat", os.O_RDONLY)
    out = []
    try:
        for _ in range(max(1, calls // chunk)):
            cpu0 = thread_cpu_s(tids)
            wall = cpu = runq = blocked = 0.0
            steps = []
            for _ in range(chunk):
                start = time.perf_counter()
                run.step()
                counter[0] += 1
                if boundary is None:
                    steps.append(time.perf_counter() - start)
                    continue
                # the windows nest: wall ⊇ run delay ⊇ CPU, so the time charged (wall - run delay)
                # never drops a wait inside the call (a wait the reads themselves catch is charged:
                # the conservative side); the reads' own cost is the baseline's
                mid = time.perf_counter()
                steps.append(mid - start)
                delay0 = _run_delay_ns(fd)
                cpu_before = time.thread_time_ns()
                boundary()
                on_cpu = (time.thread_time_ns() - cpu_before) / 1e9
                waited = (_run_delay_ns(fd) - delay0) / 1e9
                took = time.perf_counter() - mid
                wall, cpu, runq = wall + took, cpu + on_cpu, runq + waited
                blocked += max(0.0, took - on_cpu - waited)
            out.append(
                {"call_s": wall, "call_cpu_s": cpu, "call_runq_s": runq, "call_blocked_s": blocked, "thread_cpu_s": thread_cpu_s(tids) - cpu0, "steps_s": steps}
            )
    finally:
        os.close(fd)
    return out


def agreement_chunks(
    run: DigitsRun, rank: int, counter: list[int], *, calls: int, chunk: int, every: int | str, interval_s: float = AUTO_INTERVAL_S
) -> dict[str, Any]:
    """The agreement at cadence ``every`` (an int, or ``"auto"``: rounds ``interval_s`` apart) on a new gloo group; see the module docstring."""
    from resilience.stop.agreement import StopAgreement
    from resilience.timing import RunTimer, auto_cadence

    dist.barrier()
    before = _tasks()
    group = dist.new_group(backend="gloo")
    agreement = StopAgreement(group, every_steps=1 if every == "auto" else int(every), adaptive=every == "auto")
    tids = _tasks() - before - {threading_native_id()}
    timer = RunTimer()

    def boundary() -> None:
        timer.boundary()
        auto = every == "auto" and rank == 0 and agreement.starts_round(counter[0])  # as the loop: a proposal only when sent
        propose = auto_cadence(timer.step_s, max(interval_s, 2 * agreement.round_s)) if auto else 0
        agreement.update(counter[0], 0, propose_every_steps=propose)

    try:
        dist.barrier()
        idle = _chunks(run, counter, max(chunk, calls // 10), chunk, None, tids)
        for _ in range(chunk):  # the cadence settles (auto): untimed
            run.step()
            counter[0] += 1
            boundary()
        dist.barrier()
        timed = _chunks(run, counter, calls, chunk, boundary, tids)
        every_at_end = agreement.every_steps
    finally:
        agreement.close()
        dist.destroy_process_group(group)
    return {"chunks": timed, "idle": idle, "threads": len(tids), "every_steps_at_end": every_at_end, "chunk": chunk, "interval_s": interval_s}


def progress_chunks(run: DigitsRun, rank: int, counter: list[int], *, calls: int, chunk: int) -> dict[str, Any]:
    """The watchdog's progress report at every boundary (to ``RESILIENCE_PROGRESS_FILE``, else a temporary file)."""
    import tempfile

    from resilience.env_names import PROGRESS_FILE_ENV
    from resilience.progress import ProgressReporter

    path = os.environ.get(PROGRESS_FILE_ENV) or os.path.join(tempfile.mkdtemp(prefix="bench-progress-"), f"rank{rank}")
    reporter = ProgressReporter(path)
    reporter.phase("step", counter[0])
    try:
        dist.barrier()
        timed = _chunks(run, counter, calls, chunk, lambda: reporter.step(counter[0]), set())
    finally:
        reporter.phase("done", counter[0])
        reporter.close()
    return {"chunks": timed, "chunk": chunk}


def _noop() -> None:
    """The baseline's call: nothing, timed exactly like the real ones."""


def noop_chunks(run: DigitsRun, counter: list[int], *, calls: int, chunk: int) -> dict[str, Any]:
    """A call that does nothing, timed like the others: the timing's own cost in this process at
    this point (the clock reads around each call), subtracted from theirs."""
    dist.barrier()
    return {"chunks": _chunks(run, counter, calls, chunk, _noop, set()), "chunk": chunk}


def threading_native_id() -> int:
    """This (the training) thread's kernel id: never charged as the group's."""
    import threading

    return threading.get_native_id()


def direct_phase(run: DigitsRun, rank: int, counter: list[int], *, calls: int, chunk: int = 50, interval_s: float = AUTO_INTERVAL_S) -> dict[str, Any]:
    """Every rank: the three measurements of the module docstring (``auto`` with rounds ``interval_s``
    apart, ``step_scheduler.agreement_interval_s``); rank 0 returns all ranks' (the others None)."""
    mine = {
        "agreement": agreement_chunks(run, rank, counter, calls=calls, chunk=chunk, every="auto", interval_s=interval_s),
        "agreement_k1": agreement_chunks(run, rank, counter, calls=max(chunk, calls // 4), chunk=chunk, every=1),
        "progress": progress_chunks(run, rank, counter, calls=calls, chunk=chunk),
        "noop": noop_chunks(run, counter, calls=calls, chunk=chunk),
    }
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if rank == 0:

        def per_call_us(name: str) -> float:
            total = sum(c["call_s"] - c["call_runq_s"] + c["thread_cpu_s"] for r in ranks for c in r[name]["chunks"])
            return total / len(ranks) / (len(mine[name]["chunks"]) * chunk) * 1e6

        print("direct: " + ", ".join(f"{name} {per_call_us(name):.1f} us" for name in mine) + " per boundary (mean of ranks, timing included)", flush=True)
    return {"ranks": ranks} if rank == 0 else {}


def summarise(direct: dict[str, Any], launcher_cpu_per_s: float = 0.0) -> dict[str, Any]:
    """Per measurement (``agreement``, ``agreement_k1``, ``progress``): per rank the cost per
    boundary (the call's CPU + its sleep + gloo's threads' CPU, by chunk; see the module docstring)
    over the median step of the same chunks
    (:func:`bench.stats.cost_fraction`), and the figure: the rank whose interval reaches
    highest (a step waits for its slowest rank). ``progress`` adds the launcher's reads
    (``launcher_cpu_per_s``: CPU seconds per second of the watchdog's checks, one core's share,
    charged to the step in full)."""
    from bench.stats import cost_fraction

    out: dict[str, Any] = {}
    for name in ("agreement", "agreement_k1", "progress"):
        per_rank = []
        for rank in direct["ranks"]:
            got = rank[name]
            noop = rank.get("noop")
            base = [(c["call_s"] - c["call_runq_s"]) / noop["chunk"] for c in noop["chunks"]] if noop else None
            chunks, chunk = got["chunks"], got["chunk"]
            extra = launcher_cpu_per_s if name == "progress" else 0.0
            costs = [(c["call_s"] - c["call_runq_s"] + c["thread_cpu_s"]) / chunk for c in chunks]
            steps = [s for c in chunks for s in c["steps_s"]]
            fig = cost_fraction(costs, steps, extra=extra, baseline=base)
            wall = cost_fraction([(c["call_s"] + c["thread_cpu_s"]) / chunk for c in chunks], steps, extra=extra)
            idle = got.get("idle") or []
            n = len(chunks) * chunk
            fig.update(
                calls=n,
                calls_per_step=1,
                call_s=sum(c["call_s"] for c in chunks) / n,
                call_cpu_s=sum(c["call_cpu_s"] for c in chunks) / n,
                call_blocked_s=sum(c["call_blocked_s"] for c in chunks) / n,
                call_runq_s=sum(c["call_runq_s"] for c in chunks) / n,
                wall_figure={k: wall[k] for k in ("value", "ci_low", "ci_high")},
                thread_cpu_s=sum(c["thread_cpu_s"] for c in chunks) / n,
                idle_thread_cpu_s=sum(c["thread_cpu_s"] for c in idle) / (len(idle) * chunk) if idle else None,
                threads=got.get("threads"),
                every_steps_at_end=got.get("every_steps_at_end"),
                interval_s=got.get("interval_s"),
                chunk=chunk,
            )
            per_rank.append(fig)
        worst = max(per_rank, key=lambda f: f["ci_high"] if f["ci_high"] is not None else (f["value"] or 0.0))
        out[name] = {**worst, "rank": per_rank.index(worst), "ranks": per_rank}
    out["progress"]["launcher_cpu_per_s"] = launcher_cpu_per_s
    return out
