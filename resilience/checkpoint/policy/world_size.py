"""The strict world-size rule, checked when the loop is built instead of when the resume loads.

With ``checkpoint.world_size_change: strict`` (the default) a checkpoint saved under another world
size is refused, because the data position and RNG streams are per rank. Found at
``resilient_loop()``, the refusal is a :class:`~resilience.config.ConfigError` (exit 2, the batch
script does not requeue) raised on every rank before any training, rather than an error in the
middle of resuming (exit 1). The check reads one small JSON file (the manifest of the checkpoint
a resume would start with) on rank 0; the loader keeps its own check for what this one cannot
see (a fallback to an older checkpoint saved under yet another world size).
"""

from __future__ import annotations

import json
from pathlib import Path

from resilience.checkpoint.layout import LATEST, MANIFEST
from resilience.checkpoint.storage.object_path import Location
from resilience.checkpoint.storage.pointers import PointerError, read_pointer
from resilience.config import CheckpointConfig


def _first_candidate(config: CheckpointConfig, root: Location) -> Location | None:
    """The checkpoint a resume tries first: ``restore_from``, else ``LATEST`` of the checkpoint
    root, else ``load_path`` (a checkpoint, or a root whose ``LATEST`` is followed)."""
    if config.restore_from is not None:
        path = Path(config.restore_from)
        return path if path.is_absolute() or path.exists() else root / config.restore_from
    try:
        latest = read_pointer(root, LATEST) if config.resume else None
        if latest is not None:
            return latest
        if config.load_path is not None:
            path = Path(config.load_path).absolute()
            return path if (path / MANIFEST).exists() else read_pointer(path, LATEST)
    except PointerError:
        return None  # the resume reports it
    return None


def world_size_problem(config: CheckpointConfig, root: Location, world_size: int) -> str | None:
    """Why this run cannot resume under ``world_size`` (a :class:`ConfigError` message naming
    ``checkpoint.world_size_change`` and both sizes), or ``None``. Runs on rank 0; never raises:
    a missing or unreadable manifest is left to the resume's own checks."""
    if not config.enabled or config.world_size_change == "elastic" or config.no_load_optim:
        return None
    directory = _first_candidate(config, root)
    if directory is None:
        return None
    try:
        saved = int(json.loads((directory / MANIFEST).read_text())["meta"]["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if saved == world_size:
        return None
    return (
        f"checkpoint.world_size_change=strict: {directory.name} was saved with world size {saved}, this run has "
        f"{world_size} (the data position and RNG streams are per rank); resume with {saved} ranks, or set "
        "checkpoint.world_size_change=elastic to re-derive them (see its documentation)"
    )
