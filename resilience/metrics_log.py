"""Rank 0's metric logs at the checkpoint root (``training.jsonl``, ``validation.jsonl``)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from resilience.checkpoint.layout import TRAINING_LOG, VALIDATION_LOG
from resilience.checkpoint.policy.lowest_val import json_safe


def training_row(step: int, epoch: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """One ``training.jsonl`` row: ``global_step``, ``epoch`` and ``metrics`` made JSON-safe
    (:func:`~resilience.checkpoint.policy.lowest_val.json_safe`: one-element tensors and NumPy
    scalars as numbers, NaN/Inf as strings, as ``validation.jsonl`` and ``losses.json`` have them).

    Raises:
        TypeError: a value JSON cannot hold (a tensor of several elements, an object), naming its key.
    """
    row: dict[str, Any] = {"global_step": step, "epoch": epoch}
    for key, value in metrics.items():
        row[key] = json_safe(value)
        try:
            json.dumps(row[key])
        except (TypeError, ValueError) as exc:
            raise TypeError(f"loop.log({key}=...): {exc}; log numbers, strings, or one-element tensors") from None
    return row


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
