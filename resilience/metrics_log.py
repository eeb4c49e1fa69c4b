"""Rank 0's metric logs at the checkpoint root (``training.jsonl``, ``validation.jsonl``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from resilience.checkpoint.layout import TRAINING_LOG, VALIDATION_LOG


def truncate_logs(root: Path, global_step: int) -> None:
    """Drop the rows of steps after ``global_step`` from both logs under ``root`` (at a resume:
    those steps are trained again). Each log is rewritten under a temporary name and renamed."""
    for name in (TRAINING_LOG, VALIDATION_LOG):
        path = root / name
        if not path.exists():
            continue
        rows = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("global_step", 0) <= global_step]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(r + "\n" for r in rows))
        os.replace(tmp, path)
