"""Goodput under repeated preemption: the digits example preempted every T seconds, restarted each time.

Each case runs ``resilience run --nproc-per-node 2 examples/digits/train.py`` and sends SIGUSR1
to the launcher (which forwards it to both ranks, as Slurm's ``--signal=B:USR1`` reaches the batch
shell's launcher) ``T`` seconds after each start, but never before that start's first step (a
start that trained nothing would only measure the start). A launcher that exits 75
(``ExitCode.PREEMPTED``) is started again at once, as the requeue would; the case ends when one
exits 0 (done). The run length is calibrated from the first start (its step time and its time to
the first step) so that about ``preemptions`` preemptions happen: every later start gets
``step_scheduler.max_steps``.

What is measured, from the wall clock of this process and the rows rank 0 appends to
``training.jsonl`` (one per step, each seen here within ~10 ms of being written):

* ``goodput_fraction`` = useful training time / wall time, where useful = distinct steps trained
  x the step time (each start's first row to its last, over the steps between them, pooled: no
  start, no exit, but the example's periodic saves in it), and
  wall = first start to the last exit;
* per preemption: ``signal_to_exit_s`` (signal to the launcher's exit), ``restart_to_first_step_s``
  (the next start to its first row: process start, imports, rendezvous, choosing and loading the
  checkpoint, one step), ``steps_redone`` (steps logged before the exit past the checkpoint the
  next start resumed from: its first row's step - 1; must be 0), and ``preemption_cost_s``: the
  training time lost, from the signal to the next start's first step not trained before, minus
  the steps first trained in that window x the step time;
* the budget ``save_s + load_s + 2 s`` (one save and one load of the example's state, measured
  here on one rank, plus an allowance for starting the processes).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import REPO, drop_cache, median, remove, timed
from bench.ddp import EXAMPLE, rank_env
from resilience.exit_codes import ExitCode

PROCESS_START_ALLOWANCE_S = 2.0
POLL_S = 0.01


def _latest_step(root: Path) -> int:
    """The global step of the checkpoint ``root/LATEST`` names (0 when none)."""
    from resilience.checkpoint.storage.pointers import read_pointer

    found = read_pointer(root, "LATEST") if root.exists() else None
    return int(found.name.rsplit("_", 1)[1]) if found is not None else 0


class LogTail:
    """New rows of ``training.jsonl`` with the time each was first seen.

    The file is rewritten (a new inode) when a start truncates it to its resume point; then it is
    read again from the top and only rows past ``floor`` (the resume step) count as new."""

    def __init__(self, path: Path, floor: int) -> None:
        self.path = path
        self.floor = floor
        self.rows: list[tuple[int, float]] = []  # (global_step, seen at, time.monotonic)
        self._inode: int | None = None
        self._offset = 0
        self._partial = b""
        try:
            st = path.stat()
            self._inode, self._offset = st.st_ino, st.st_size  # rows already there are old
        except FileNotFoundError:
            pass

    def poll(self) -> None:
        """Read what was appended since the last call."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return
        if st.st_ino != self._inode:
            self._inode, self._offset, self._partial = st.st_ino, 0, b""
        if st.st_size <= self._offset:
            return
        now = time.monotonic()
        with open(self.path, "rb") as fh:
            fh.seek(self._offset)
            data = fh.read()
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        last = self.rows[-1][0] if self.rows else self.floor
        for line in lines:
            if line.strip():
                step = int(json.loads(line)["global_step"])
                if step > last:
                    self.rows.append((step, now))
                    last = step


def _launch(root: Path, extra: list[str], log_path: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "resilience",
        "run",
        "--nproc-per-node",
        "2",
        str(EXAMPLE / "train.py"),
        "--config",
        str(EXAMPLE / "digits.yaml"),
        f"checkpoint.checkpoint_dir={root}",
        "step_scheduler.num_epochs=100000",
        *extra,
    ]
    with open(log_path, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **rank_env()}, cwd=REPO)


def _segment(root: Path, extra: list[str], period_s: float | None, timeout_s: float, log_path: Path) -> dict[str, Any]:
    """One start: launch, signal after ``period_s`` (None: never), wait for the exit."""
    floor = _latest_step(root)
    tail = LogTail(root / "training.jsonl", floor)
    launched = time.monotonic()
    proc = _launch(root, extra, log_path)
    signalled = None
    deadline = launched + timeout_s
    try:
        while proc.poll() is None:
            tail.poll()
            now = time.monotonic()
            if period_s is not None and signalled is None and tail.rows and now >= launched + period_s:
                os.kill(proc.pid, signal.SIGUSR1)
                signalled = time.monotonic()
            if now > deadline:
                raise RuntimeError(f"a start of the digits example ran past {timeout_s:g} s (log: {log_path})")
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    exited = time.monotonic()
    tail.poll()
    return {
        "launched": launched,
        "signalled": signalled,
        "exited": exited,
        "code": proc.returncode,
        "resume_step": floor,
        "rows": tail.rows,
        "stop_checkpoint_step": _latest_step(root),
    }


def _logged_steps(root: Path) -> list[int]:
    path = root / "training.jsonl"
    return [int(json.loads(line)["global_step"]) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_case(work: Path, period_s: float, preemptions: int, *, timeout_s: float, log: Callable[[str], None]) -> dict[str, Any]:
    """The digits example preempted every ``period_s`` seconds about ``preemptions`` times (see
    the module doc); returns the case's figures and every start's raw timeline.

    Raises:
        RuntimeError: a start exited with another code than 0 or 75, ran past ``timeout_s``, or
            the run did not finish within ``preemptions + 3`` starts.
    """
    root = work / f"goodput_{period_s:g}s"
    remove(root)
    root.mkdir(parents=True)
    log_path = work / f"goodput_{period_s:g}s.log"
    remove(log_path)
    segments: list[dict[str, Any]] = []
    extra: list[str] = []
    while True:
        more = len(segments) < preemptions
        seg = _segment(root, extra, period_s if more else None, timeout_s, log_path)
        segments.append(seg)
        rows = seg["rows"]
        log(
            f"goodput T={period_s:g} s start {len(segments)}: first step after {rows[0][1] - seg['launched'] if rows else float('nan'):.2f} s, "
            f"{len(rows)} steps, exit {seg['code']}" + (f" {seg['exited'] - seg['signalled']:.2f} s after the signal" if seg["signalled"] else "")
        )
        if seg["code"] == 0:
            break
        if seg["code"] != int(ExitCode.PREEMPTED) or seg["signalled"] is None:
            raise RuntimeError(
                f"a start of the digits example exited {seg['code']} (signalled: {seg['signalled'] is not None}; log: {log_path}):\n{_tail(log_path)}"
            )
        if len(segments) > preemptions + 2:
            raise RuntimeError(f"the digits run did not finish after {len(segments)} starts (log: {log_path})")
        if len(segments) == 1:
            extra = [f"step_scheduler.max_steps={_calibrated_max_steps(seg, period_s, preemptions)}"]
    out = summarise(segments, period_s)
    logged = _logged_steps(root)
    out["all_steps_logged_once"] = logged == list(range(1, len(logged) + 1))  # the final log: each step once, in order
    remove(root)
    remove(log_path)
    return out


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _calibrated_max_steps(first: dict[str, Any], period_s: float, preemptions: int) -> int:
    """The step count that leaves ``preemptions - 1`` more preemptions and half a period to finish."""
    rows = first["rows"]
    step_s = _step_s([first]) or 0.01
    start_s = rows[0][1] - first["launched"] if rows else period_s / 2
    per_start = max(period_s - start_s, 0.25 * period_s)
    last = rows[-1][0] if rows else first["stop_checkpoint_step"]
    return last + max(2, math.ceil((preemptions - 0.5) * per_start / step_s))


def _step_s(segments: list[dict[str, Any]]) -> float:
    """Seconds per step while training: every start's time from its first row to its last over
    the steps between them, pooled. Not the median gap between rows: rows are seen here in polls
    ~10 ms apart, so with a shorter step most gaps are 0 or one poll, never the step time."""
    spans = [(seg["rows"][-1][1] - seg["rows"][0][1], seg["rows"][-1][0] - seg["rows"][0][0]) for seg in segments if len(seg["rows"]) > 1]
    steps = sum(n for _, n in spans)
    return sum(t for t, _ in spans) / steps if steps else 0.0


def summarise(segments: list[dict[str, Any]], period_s: float) -> dict[str, Any]:
    """The case's figures from its starts' timelines (see the module doc)."""
    step_s = _step_s(segments)
    first_seen: dict[int, float] = {}
    for seg in segments:
        for step, at in seg["rows"]:
            first_seen.setdefault(step, at)
    wall = segments[-1]["exited"] - segments[0]["launched"]
    useful = len(first_seen) * step_s
    preemptions = []
    seen: set[int] = set()
    for before, after in zip(segments, segments[1:]):
        seen.update(step for step, _ in before["rows"])
        last_logged = before["rows"][-1][0] if before["rows"] else before["resume_step"]
        first_next = after["rows"][0] if after["rows"] else None
        resumed_from = first_next[0] - 1 if first_next else after["resume_step"]
        # the window ends at the next start's first step not trained before (redone ones are lost time)
        end = next((at for step, at in after["rows"] if step not in seen), after["exited"])
        new_in_window = sum(1 for at in first_seen.values() if before["signalled"] <= at <= end)
        window = end - before["signalled"]
        preemptions.append(
            {
                "signal_to_exit_s": before["exited"] - before["signalled"],
                "restart_gap_s": after["launched"] - before["exited"],
                "restart_to_first_step_s": (first_next[1] - after["launched"]) if first_next else None,
                "steps_after_signal": sum(1 for _, at in before["rows"] if at >= before["signalled"]),
                "stop_checkpoint_step": before["stop_checkpoint_step"],
                "last_logged_step": last_logged,
                "resumed_from_step": resumed_from,
                "steps_redone": max(0, last_logged - resumed_from),
                "window_s": window,
                "preemption_cost_s": window - new_in_window * step_s,
            }
        )
    first = segments[0]
    return {
        "period_s": period_s,
        "goodput_fraction": useful / wall if wall > 0 else None,
        "useful_s": useful,
        "wall_s": wall,
        "step_s": step_s,
        "steps": len(first_seen),
        "starts": len(segments),
        "first_start_to_first_step_s": (first["rows"][0][1] - first["launched"]) if first["rows"] else None,
        "preemptions": preemptions,
        "exit_codes": [seg["code"] for seg in segments],
    }


def state_save_load_s(work: Path, rounds: int) -> tuple[float, float, list[float], list[float]]:
    """Median seconds of one ``Checkpointer.save`` and one cold ``Checkpointer.load`` of the digits
    example's state (model, AdamW, LR schedule, data position) on one rank, and every round."""
    from bench.ddp_worker import DigitsRun
    from bench.storage import ours_checkpointer
    from resilience.checkpoint import TrainingState

    run = DigitsRun(0, 1)
    for _ in range(3):
        run.step()
    state = TrainingState(model=run.model, optimizer=run.optimizer, lr_scheduler=run.lr_scheduler, dataloader=run.loader)
    root = work / "goodput_state"
    remove(root)
    saves, loads = [], []
    for r in range(rounds):
        seconds, path = timed(ours_checkpointer(root, state, r + 1).save)
        saves.append(seconds)
        drop_cache([path])
        seconds, _ = timed(lambda path=path, step=r + 1: ours_checkpointer(root, state, step).load(path, state))
        loads.append(seconds)
    remove(root)
    return median(saves), median(loads), saves, loads


def bench_goodput(work: Path, *, periods: tuple[float, ...], preemptions: int, timeout_s: float, log: Callable[[str], None]) -> dict[str, Any]:
    """Every case of :func:`run_case` and the cost budget (:func:`state_save_load_s` + 2 s)."""
    save_s, load_s, saves, loads = state_save_load_s(work, 3)
    budget = save_s + load_s + PROCESS_START_ALLOWANCE_S
    log(f"goodput budget per preemption: save {save_s * 1e3:.1f} ms + load {load_s * 1e3:.1f} ms + {PROCESS_START_ALLOWANCE_S:g} s")
    cases = []
    for period in periods:
        case = run_case(work, period, preemptions, timeout_s=timeout_s, log=log)
        cases.append(case)
        costs = [p["preemption_cost_s"] for p in case["preemptions"]]
        log(
            f"goodput T={period:g} s: {case['goodput_fraction']:.1%} ({case['useful_s']:.1f} s useful of {case['wall_s']:.1f} s), "
            f"{len(costs)} preemptions costing {', '.join(f'{c:.2f}' for c in costs)} s, steps redone {[p['steps_redone'] for p in case['preemptions']]}"
        )
    return {
        "cases": cases,
        "save_s": save_s,
        "load_s": load_s,
        "save_s_all": saves,
        "load_s_all": loads,
        "process_start_allowance_s": PROCESS_START_ALLOWANCE_S,
        "budget_s": budget,
    }
