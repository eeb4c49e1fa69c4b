"""Launch ``helpers/sample_train.py`` on real ranks and read back which samples each step saw."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from resilience.launch import launch

HELPER = Path(__file__).resolve().parent / "helpers" / "sample_train.py"


def run(ckpt: Path, record: Path, nproc: int = 1, *, loader: str = "plain", batch: int = 4, overrides: list[str] = (), timeout: float = 120.0) -> list[int]:
    """Run the helper on ``nproc`` ranks until every rank exits; returns their exit codes."""
    cmd = [sys.executable, str(HELPER), str(ckpt), str(record), *overrides]
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LOADER": loader, "BATCH": str(batch)}
    deadline = time.monotonic() + timeout
    with launch(cmd, nproc, env=env, failure_grace_s=60.0) as group:
        while group.poll() is None:
            assert time.monotonic() < deadline, f"sample_train.py in {ckpt} still running after {timeout} s"
            time.sleep(0.02)
        return [proc.returncode for proc in group.procs]


def steps(record: Path, nproc: int = 1) -> dict[int, dict]:
    """Step -> {"ids": sorted sample ids over every rank, "loss": rank 0's, "lr_step", "lr"}."""
    out: dict[int, dict] = {}
    for rank in range(nproc):
        path = Path(f"{record}.rank{rank}")
        for line in path.read_text().splitlines() if path.exists() else []:
            row = json.loads(line)
            entry = out.setdefault(row["step"], {"ids": [], "loss": None, "lr_step": row["lr_step"], "lr": row["lr"]})
            entry["ids"] = sorted(entry["ids"] + row["ids"])
            if rank == 0:
                entry["loss"] = row["loss"]
    return dict(sorted(out.items()))
