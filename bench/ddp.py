"""Multi-process benchmarks: per-step agreement overhead and stop latency (2 ranks, gloo), and
the time from a preemption signal to the exit of every rank of the digits example.

Both start real processes with ``resilience.launch.launch``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import REPO, median, remove
from bench.stats import controlled_overhead, median_interval
from resilience.exit_codes import ExitCode
from resilience.launch import launch

EXAMPLE = REPO / "examples" / "digits"


def rank_env() -> dict[str, str]:
    """What a bench rank needs on top of the environment: this repository on PYTHONPATH, one OpenMP thread."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(REPO) + (os.pathsep + path if path else ""), "OMP_NUM_THREADS": "1"}


def bench_agreement(
    work: Path,
    *,
    rounds: int,
    steps: int,
    big_k: int,
    latency_trials: int,
    saves: int,
    timeout_s: float,
    log: Callable[[str], None],
    ab_pairs: int = 100,
    ab_steps: int = 50,
    ab_max_s: float = 0.0,
    direct_calls: int = 3000,
    direct_chunk: int = 50,
    direct_interval_s: float | None = None,
) -> dict[str, Any]:
    """Run :mod:`bench.ddp_worker` on 2 ranks and summarise its blocks.

    Returns the raw blocks plus, per variant, the median over rounds of its mean step time and
    of its overhead over the ``none`` block of the same round (a paired ratio), with the
    order-statistic interval of that median (:func:`bench.stats.median_interval`); and
    ``ab``: the default cadence's overhead over a no-op call from at least ``ab_pairs``
    interleaved rows of ``ab_steps``-step blocks (more, for up to ``ab_max_s`` seconds, until
    the interval is about +-0.4 % wide) with its block-bootstrap interval, and the same against
    the bare step and the no-op's own reading (:func:`bench.stats.controlled_overhead`); and
    ``direct``: each boundary call timed ``direct_calls`` times (:mod:`bench.direct_cost`) over the
    median step of the same run, with the watchdog's reads (this process) added to the reports'."""
    out = work / "ddp_result.json"
    ckpt = work / "ddp_checkpoints"
    remove(out)
    remove(ckpt)
    cmd = [
        sys.executable,
        "-u",
        "-m",
        "bench.ddp_worker",
        "--out",
        str(out),
        "--ckpt-dir",
        str(ckpt),
        "--rounds",
        str(rounds),
        "--steps",
        str(steps),
        "--big-k",
        str(big_k),
        "--latency-trials",
        str(latency_trials),
        "--saves",
        str(saves),
        "--ab-pairs",
        str(ab_pairs),
        "--ab-steps",
        str(ab_steps),
        "--ab-max-seconds",
        str(ab_max_s),
        "--direct-calls",
        str(direct_calls),
        "--direct-chunk",
        str(direct_chunk),
    ]
    if direct_interval_s is not None:  # else the worker's default: the library's
        cmd += ["--direct-interval-s", str(direct_interval_s)]
    with launch(cmd, 2, env=rank_env(), failure_grace_s=5.0) as group:
        code, stalls, launcher = _wait_watched(group, timeout_s)
    if code != 0 or not out.exists():
        raise RuntimeError(f"the DDP bench ranks exited with {code} ({[p.returncode for p in group.procs]})")
    raw = json.loads(out.read_text())
    remove(out)
    remove(ckpt)
    blocks = raw["blocks"]
    summary: dict[str, Any] = {}
    for variant, rows in blocks.items():
        overheads = [row["mean_s"] / base["mean_s"] - 1 for row, base in zip(rows, blocks["none"])]
        summary[variant] = {
            "step_s": median([row["mean_s"] for row in rows]),
            "step_median_s": median([row["median_s"] for row in rows]),
            "boundary_call_s": median([row.get("boundary_mean_s", 0.0) for row in rows]),
            "overhead_fraction": median(overheads),
            "overhead_fraction_rounds": overheads,
            "overhead_interval": median_interval(overheads),
        }
    pairs = raw.get("ab_pairs", [])
    ab = controlled_overhead(pairs, "ours_auto")
    ab.update(
        steps_per_block=raw.get("ab_steps_per_block"),
        step_s={arm: median([row[arm] for row in pairs]) for arm in ("none", "noop", "ours_auto") if pairs and arm in pairs[0]},
        boundary_call_s=median([row["ours_auto_boundary_s"] for row in pairs]),
    )
    progress_pairs = raw.get("progress_ab_pairs", [])
    watchdog = controlled_overhead(progress_pairs, "progress")
    watchdog.update(
        steps_per_block=raw.get("ab_steps_per_block"),
        step_s={arm: median([row[arm] for row in progress_pairs]) for arm in ("none", "noop", "progress") if progress_pairs and arm in progress_pairs[0]},
        boundary_call_s=median([row["progress_boundary_s"] for row in progress_pairs]),
        stalls_seen=stalls,
    )
    direct = None
    if raw.get("direct"):
        from bench.direct_cost import summarise

        direct = summarise(raw["direct"], launcher["cpu_s"] / launcher["wall_s"] if launcher["wall_s"] else 0.0)
        direct["launcher"] = launcher
    latency = {
        k: {
            "seconds": median([t["seconds"] for t in trials]),
            "seconds_max": max(t["seconds"] for t in trials),
            "steps": median([t["steps"] for t in trials]),
            "same_step_on_all_ranks": all(t["same_step_on_all_ranks"] for t in trials),
            "trials": trials,
        }
        for k, trials in raw["stop_latency"].items()
    }
    return {
        "variants": summary,
        "ab": ab,
        "watchdog_ab": watchdog,
        "direct": direct,
        "stop_latency": latency,
        "save_s": median(raw["save_s"]),
        "save_s_all": raw["save_s"],
        "raw": raw,
    }


def _wait_watched(group, timeout_s: float) -> tuple[int, int, dict[str, float]]:
    """``group.wait(timeout_s)`` while ``resilience run``'s watchdog reads the ranks' progress
    records as the launcher does (its reads land beside every block of every row alike);
    returns (the group's exit code, stalls the watchdog reported, which should be 0, and the
    reads' cost: ``{"cpu_s", "wall_s", "checks"}``, the CPU of every ``check()`` and the time watched).

    Raises RuntimeError when the ranks have not finished within ``timeout_s`` seconds."""
    from resilience.launch.rank_group import POLL_INTERVAL_S
    from resilience.launch.watchdog import ProgressTimeout, Watchdog

    watchdog = Watchdog(group, ProgressTimeout())
    deadline = time.monotonic() + timeout_s
    stalls = checks = 0
    cpu = 0.0
    started = time.monotonic()
    while (code := group.poll()) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the DDP bench ranks did not finish within {timeout_s:g} s")
        before = time.thread_time()
        stalls += watchdog.check() is not None
        cpu += time.thread_time() - before
        checks += 1
        time.sleep(POLL_INTERVAL_S)
    return code, stalls, {"cpu_s": cpu, "wall_s": time.monotonic() - started, "checks": checks}


def _pointer(root: Path) -> str | None:
    """The checkpoint ``root/LATEST`` names (symlink or ``LATEST.txt``), or None."""
    for link in (root / "LATEST", root / "LATEST.txt"):
        try:
            return os.readlink(link) if link.is_symlink() else (link.read_text().strip() if link.exists() else None)
        except OSError:
            continue
    return None


def interpreter_teardown(trials: int, cases: tuple[str, ...] = ("plain", "gc_freeze", "os_exit")) -> dict[str, Any]:
    """Seconds from the last line of a Python program that imported torch (and gloo) to its
    exit: the floor under any "signal to exit" here. Also with ``gc.freeze()`` before the end
    (the final collections skip every object alive then) and with ``os._exit`` (no teardown)."""
    body = "import torch, torch.distributed, time, gc, os\n{extra}print(time.monotonic(), flush=True)\n{end}"
    variants = {"plain": ("", ""), "gc_freeze": ("gc.freeze()\n", ""), "os_exit": ("", "os._exit(0)\n")}
    out: dict[str, Any] = {}
    for name in cases:
        extra, end = variants[name]
        times = []
        for _ in range(trials):
            proc = subprocess.Popen(
                [sys.executable, "-c", body.format(extra=extra, end=end)], stdout=subprocess.PIPE, text=True, env={**os.environ, **rank_env()}
            )
            line = proc.stdout.readline()
            proc.wait()
            ended = time.monotonic()
            times.append(ended - float(line))
        out[name] = {"median_s": median(times), "all_s": times}
    return out


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as fh:
            return fh.read().count(b"\n")
    except FileNotFoundError:
        return 0


def signal_to_exit(work: Path, *, mode: str, after_steps: int, timeout_s: float, seed: int = 0) -> dict[str, Any]:
    """Start the digits example on 2 ranks, let it run ``after_steps`` steps, send SIGUSR1 and
    time until both ranks have exited.

    ``mode``: ``"all"`` sends it the way ``resilience run`` forwards Slurm's signal (every rank,
    via ``RankGroup.request_stop``); ``"one"`` ``os.kill``s rank 1 only (rank 0 learns of it
    through the agreement). Returns seconds to both exits, seconds until ``LATEST`` named the stop
    checkpoint, both exit codes and that checkpoint's name.
    """
    root = work / f"exit_{mode}"
    remove(root)
    cmd = [
        sys.executable,
        "-u",
        str(EXAMPLE / "train.py"),
        "--config",
        str(EXAMPLE / "digits.yaml"),
        f"checkpoint.checkpoint_dir={root}",
        "step_scheduler.num_epochs=100000",
    ]
    rows = root / "training.jsonl"
    exited: dict[int, float] = {}
    with launch(cmd, 2, env=rank_env(), failure_grace_s=5.0) as group:
        deadline = time.monotonic() + timeout_s
        while _count_lines(rows) < after_steps:
            if time.monotonic() > deadline or group.poll() is not None:
                raise RuntimeError(f"the digits example did not reach step {after_steps} (exit codes {group.returncodes})")
            time.sleep(0.01)
        time.sleep(random.Random(seed).uniform(0.0, 0.1))  # land anywhere inside a step
        waiters = []
        for local, proc in enumerate(group.procs):

            def wait(local: int = local, proc: subprocess.Popen = proc) -> None:
                proc.wait()
                exited[local] = time.monotonic()

            waiters.append(threading.Thread(target=wait, daemon=True))
        for thread in waiters:
            thread.start()
        before = _pointer(root)
        sent_at = time.monotonic()
        deadline = sent_at + timeout_s
        if mode == "all":
            group.request_stop(signal.SIGUSR1)
        else:
            os.kill(group.pids[1], signal.SIGUSR1)
        published_at = None
        while time.monotonic() < deadline and len(exited) < len(group.procs):
            if published_at is None and _pointer(root) not in (before, None):
                published_at = time.monotonic()  # LATEST names the stop checkpoint
            time.sleep(0.001)
        for thread in waiters:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        codes = [proc.poll() for proc in group.procs]
    if len(exited) != len(codes):
        raise RuntimeError(f"the digits example did not exit after the signal (exit codes {codes})")
    saved = _pointer(root)
    remove(root)
    return {
        "mode": mode,
        "seconds": max(exited.values()) - sent_at,
        "published_s": None if published_at is None else published_at - sent_at,
        "exit_codes": codes,
        "preempted": all(code == int(ExitCode.PREEMPTED) for code in codes),
        "checkpoint": saved,
    }


def bench_exit(
    work: Path,
    *,
    trials: int,
    modes: tuple[str, ...],
    after_steps: int,
    timeout_s: float,
    log: Callable[[str], None],
    teardown_cases: tuple[str, ...] = ("plain", "gc_freeze", "os_exit"),
) -> dict[str, Any]:
    """``trials`` runs per mode (``all``, ``one``), alternating; medians per mode; and the
    interpreter teardown anchor (:func:`interpreter_teardown`)."""
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for t in range(trials):
        for mode in modes:
            row = signal_to_exit(work, mode=mode, after_steps=after_steps, timeout_s=timeout_s, seed=t)
            results[mode].append(row)
            published = "n/a" if row["published_s"] is None else f"{row['published_s']:.3f} s"
            log(
                f"signal to exit ({mode} ranks signalled) trial {t + 1}/{trials}: checkpoint published after {published}, "
                f"both ranks exited after {row['seconds']:.3f} s, exit codes {row['exit_codes']}, saved {row['checkpoint']}"
            )
    teardown = interpreter_teardown(trials, teardown_cases)
    log("python teardown with torch imported: " + ", ".join(f"{k} {v['median_s']:.3f} s" for k, v in teardown.items()))
    return {
        "trials": results,
        "median_s": {mode: median([row["seconds"] for row in rows]) for mode, rows in results.items()},
        "median_published_s": {mode: median([row["published_s"] for row in rows]) for mode, rows in results.items()},
        "all_preempted": all(row["preempted"] for rows in results.values() for row in rows),
        "teardown_s": teardown,
    }
