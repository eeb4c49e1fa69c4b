"""``LOWEST_VAL``: a pointer to the checkpoint with the lowest validation metric.

Semantics follow NeMo AutoModel: a validation result is a dict of metrics; when it holds one
metric that one is used, otherwise the one named ``checkpoint.best_metric_key`` (lower is
better). The metric of a step is recorded in the manifest meta of that step's checkpoint
(``meta.val_metric`` = ``{"key", "value"}``); ``LOWEST_VAL`` moves, with the same atomic
pointer swap as ``LATEST``, after the checkpoint is published. NaN and +/-Inf never become the
best. On resume the best value so far is re-read from the manifest of the checkpoint
``LOWEST_VAL`` names, so the pointer only ever moves to a better checkpoint across restarts.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from resilience.checkpoint.layout import LOWEST_VAL, list_checkpoints
from resilience.checkpoint.storage.manifest import CheckpointInvalid, read_manifest
from resilience.checkpoint.storage.object_path import Location
from resilience.checkpoint.storage.pointers import PointerError, delete_pointer, read_pointer, write_pointer

log = logging.getLogger("resilience.checkpoint")

DEFAULT_METRIC_KEY = "default"


def to_number(value: Any) -> Any:
    """A plain Python value for JSON: one-element tensors and NumPy scalars become numbers."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):
            return value
    return value


def json_safe(value: Any) -> Any:
    """``value`` with NaN/Inf floats written as the strings ``"nan"``, ``"inf"``, ``"-inf"``, so
    the JSON stays strict (``json.dumps`` would write bare ``NaN``, which most parsers reject)."""
    value = to_number(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def select_metric(metrics: Mapping[str, Any], key: str = DEFAULT_METRIC_KEY) -> tuple[str, float | None]:
    """``(name, value)`` of the metric that decides ``LOWEST_VAL``.

    One metric: that one, whatever ``key`` says (NeMo renames it ``val_loss``). Several: the one
    named ``key``. ``value`` is ``None`` when the metric is not a finite number (NaN, Inf, a
    string), so it can never become the best.

    Raises:
        ValueError: several metrics and none named ``key`` (the message lists them).
    """
    if not metrics:
        raise ValueError("log_validation() needs at least one metric, e.g. log_validation(val_loss=0.42)")
    if len(metrics) == 1:
        name, value = next(iter(metrics.items()))
    elif key in metrics:
        name, value = key, metrics[key]
    else:
        raise ValueError(
            f"checkpoint.best_metric_key={key!r} is not among the validation metrics {sorted(metrics)}; "
            "set it to the metric that decides LOWEST_VAL (lower is better)"
        )
    value = to_number(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return name, None
    return name, float(value)


def append_jsonl(path: Path, row: Mapping[str, Any]) -> None:
    """Append one JSON row to ``path`` (created with its parent when missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(json_safe(row)) + "\n")


def recorded_value(directory: Location) -> float | None:
    """The finite ``meta.val_metric.value`` in ``directory``'s manifest, else ``None``."""
    try:
        meta = read_manifest(directory).get("meta", {})
    except CheckpointInvalid:
        return None
    entry = meta.get("val_metric") or {}
    value = entry.get("value") if isinstance(entry, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class LowestVal:
    """Rank 0's view of ``LOWEST_VAL`` under ``root``: the best value so far and where it is."""

    def __init__(self, root: Location):
        self.root = root
        self.best_value: float | None = None
        self.best_name: str | None = None

    def reload(self) -> None:
        """Re-read the best value from the manifest of the checkpoint ``LOWEST_VAL`` names
        (on resume). A missing pointer or target, or one without a finite metric, means no best."""
        self.best_value, self.best_name = None, None
        try:
            target = read_pointer(self.root, LOWEST_VAL)
        except PointerError as exc:
            log.warning("ignoring %s: %s", LOWEST_VAL, exc)
            return
        if target is None:
            return
        value = recorded_value(target)
        if value is not None:
            self.best_value, self.best_name = value, target.name

    def consider(self, directory: Location, value: float | None) -> bool:
        """Move ``LOWEST_VAL`` to ``directory`` (just published) if ``value`` is a new best.

        Returns True when the pointer moved. A re-save of the current best's step replaces its
        value; if that value is worse (or missing) the best is searched again over all
        checkpoints' manifests. Raises ``OSError`` when the pointer cannot be written.
        """
        if directory.name == self.best_name and (value is None or self.best_value is None or value > self.best_value):
            return self._rescan()
        if value is None or (self.best_value is not None and value >= self.best_value):
            return False
        write_pointer(self.root, LOWEST_VAL, directory)
        self.best_value, self.best_name = value, directory.name
        log.info("%s -> %s (%s)", LOWEST_VAL, directory.name, value)
        return True

    def _rescan(self) -> bool:
        best: tuple[float, Location] | None = None
        for path in list_checkpoints(self.root):
            value = recorded_value(path)
            if value is not None and (best is None or value < best[0]):
                best = (value, path)
        if best is None:
            delete_pointer(self.root, LOWEST_VAL)
            self.best_value, self.best_name = None, None
            return True
        write_pointer(self.root, LOWEST_VAL, best[1])
        self.best_value, self.best_name = best[0], best[1].name
        return True
