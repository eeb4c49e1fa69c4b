"""The sharded rows of ``make bench``: FSDP2 on 2 ranks, each writing its half of the state, against
the disk's aggregate fsync'd write rate and DCP ``save`` of the same sharded state; then the load of
that checkpoint on the same 2 ranks and on 1 rank (resharded), against the disk's cold read of the
same bytes and DCP ``load``, each checked bitwise; all measured in the same run (the ranks:
:mod:`bench.sharded_worker`; the phases of one save and load: :mod:`bench.sharded_phases`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import remove
from bench.ddp import rank_env
from bench.sharded_phases import LOAD, SAVE, format_phases, labels
from resilience.launch import launch

# The default format: each rank writes its own DTensor shards (model and optimizer) as safetensors.
MODEL_SAVE_FORMAT = "safetensors"
RESHARD_RANKS = 1  # the resharded load: 2 ranks' checkpoint into 1


def sharded_rounds(repeat: int) -> int:
    """Rounds of the sharded save and of each sharded load for ``repeat`` rounds of everything
    else: ``2 * repeat + 1`` (11 at the default 5), one round when ``repeat`` is 1 (``--quick``).
    The disk's rate moved 2x between rounds of 5-round runs here, and the targets (0.9 of the
    disk's write rate, 0.8 of its read rate) sit inside that noise: the paired ratios' median
    over 11 rounds gets an interval from inner order statistics instead of the extremes. Beside a
    busy process one cold 1.6 GB read per rank took 1.0-2.8 s, ours and the anchor alike, and
    windows of 5 of 15 such rounds put ours' median ratio anywhere in 0.87-1.09 (of 11:
    0.96-1.0; bench/README.md). A save round costs about 10 s (three methods' 3 GiB saves, each
    dropped from the page cache after), a load round about 8 s."""
    return repeat if repeat <= 1 else 2 * repeat + 1


def bench_sharded_save(work: Path, size: int, repeat: int, *, timeout_s: float, log: Callable[[str], None], nproc: int = 2) -> dict[str, Any]:
    """Run :mod:`bench.sharded_worker` on ``nproc`` ranks (:func:`sharded_rounds` rounds of the save,
    then of the load) and then on :data:`RESHARD_RANKS` (as many rounds of the load of the
    same checkpoint) over a ``size``-byte fp32 model (+ Adam);
    return the first run's JSON with the second's under ``reshard`` (times in s, sizes in bytes).

    Raises:
        RuntimeError: a rank failed (a load that differs from the saved state fails its rank), or
            a run took longer than ``timeout_s``.
    """
    out, scratch = work / "sharded_result.json", work / "sharded"
    remove(scratch)
    scratch.mkdir(parents=True)
    try:
        rounds = f"{sharded_rounds(repeat)} round(s) of the save and of each load"
        log(f"sharded save and load: FSDP2 over {nproc} ranks, {rounds}, model_save_format {MODEL_SAVE_FORMAT}")
        doc = _run(out, scratch, size, repeat, nproc, "save", timeout_s)
        log(format_phases(f"sharded save phases ({nproc} ranks, s)", doc["phases"]["save"], labels(SAVE)))
        log(format_phases(f"sharded load phases ({nproc} -> {nproc} ranks, s)", doc["phases"]["load"], labels(LOAD)))
        log(f"sharded load: the checkpoint of {nproc} ranks on {RESHARD_RANKS}")
        doc["reshard"] = _run(out, scratch, size, repeat, RESHARD_RANKS, "reshard", timeout_s)
        log(format_phases(f"sharded load phases ({nproc} -> {RESHARD_RANKS} ranks, s)", doc["reshard"]["phases"]["load"], labels(LOAD)))
        return doc
    finally:
        remove(scratch)
        remove(out)


def _run(out: Path, scratch: Path, size: int, repeat: int, nproc: int, mode: str, timeout_s: float) -> dict[str, Any]:
    remove(out)
    cmd = [sys.executable, "-u", "-m", "bench.sharded_worker", "--out", str(out), "--dir", str(scratch), "--size", str(size)]
    cmd += ["--repeat", str(sharded_rounds(repeat)), "--model-save-format", MODEL_SAVE_FORMAT, "--mode", mode]
    with launch(cmd, nproc, env=rank_env(), failure_grace_s=10.0) as group:
        code = group.wait(timeout=timeout_s)  # subprocess.TimeoutExpired past it; leaving the block ends the ranks
        codes = [proc.returncode for proc in group.procs]
    if code != 0:
        raise RuntimeError(f"the sharded {mode} ranks ({nproc}) exited {codes}")
    return json.loads(out.read_text())
