"""The sharded-save row of ``make bench``: FSDP2 on 2 ranks, each writing its half of the state,
against the disk's aggregate fsync'd write rate and DCP ``save`` of the same sharded state, all
measured in the same run (the ranks: :mod:`bench.sharded_worker`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import remove
from bench.ddp import rank_env
from resilience.launch import launch

# The default format: each rank writes its own DTensor shards as safetensors (the optimizer through DCP).
MODEL_SAVE_FORMAT = "safetensors"


def bench_sharded_save(work: Path, size: int, repeat: int, *, timeout_s: float, log: Callable[[str], None], nproc: int = 2) -> dict[str, Any]:
    """Run :mod:`bench.sharded_worker` on ``nproc`` ranks over a ``size``-byte fp32 model (+ Adam)
    and return its JSON (times in s, sizes in bytes).

    Raises:
        RuntimeError: a rank failed or the run took longer than ``timeout_s``.
    """
    out, scratch = work / "sharded_result.json", work / "sharded"
    remove(out)
    remove(scratch)
    scratch.mkdir(parents=True)
    cmd = [sys.executable, "-u", "-m", "bench.sharded_worker", "--out", str(out), "--dir", str(scratch), "--size", str(size), "--repeat", str(repeat)]
    cmd += ["--model-save-format", MODEL_SAVE_FORMAT]
    log(f"sharded save: FSDP2 over {nproc} ranks, {repeat} round(s), model_save_format {MODEL_SAVE_FORMAT}")
    try:
        with launch(cmd, nproc, env=rank_env(), failure_grace_s=10.0) as group:
            code = group.wait(timeout=timeout_s)  # subprocess.TimeoutExpired past it; leaving the block ends the ranks
            codes = [proc.returncode for proc in group.procs]
        if code != 0:
            raise RuntimeError(f"the sharded-save ranks exited {codes}")
        return json.loads(out.read_text())
    finally:
        remove(scratch)
        remove(out)
