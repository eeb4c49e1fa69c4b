"""The resume path, top to bottom: pick a valid checkpoint (rank 0), tell every rank, load.

Rank 0 follows ``LATEST`` (or ``restore_from``), validates the manifest (sizes and sha256),
and when the target is missing, incomplete or corrupt falls back to the newest older valid
checkpoint with a warning. Every rank then loads the chosen directory.
"""

from __future__ import annotations

import logging
from pathlib import Path

from resilience.checkpoint.layout import BAD_MARKER, LATEST, list_checkpoints, parse_checkpoint_name
from resilience.checkpoint.manifest import CheckpointInvalid, validate
from resilience.checkpoint.pointers import PointerError, read_pointer
from resilience.distributed import DistContext

log = logging.getLogger("resilience.checkpoint")


class CheckpointNotFound(FileNotFoundError):
    """An explicitly requested checkpoint (``restore_from``) does not exist or is invalid."""


def _choose(root: Path, restore_from: str | None, key: str = "checkpoint.restore_from") -> tuple[str | None, list[str]]:
    """(directory to resume from or None, warnings). Runs on rank 0 only."""
    warnings: list[str] = []
    if restore_from is not None:
        path = Path(restore_from)
        if not path.is_absolute() and not path.exists():
            path = root / restore_from
        try:
            validate(path)
        except CheckpointInvalid as exc:
            raise CheckpointNotFound(f"{key}={restore_from!r}: {exc}") from exc
        return str(path), warnings

    candidates: list[Path] = []
    try:
        latest = read_pointer(root, LATEST)
    except PointerError as exc:
        warnings.append(str(exc))
        latest = None
    if latest is not None:
        candidates.append(latest)
    newest_step = parse_checkpoint_name(latest.name)[1] if latest is not None and parse_checkpoint_name(latest.name) else None
    for path in list_checkpoints(root):
        step = parse_checkpoint_name(path.name)[1]
        if path not in candidates and (newest_step is None or step <= newest_step):
            candidates.append(path)

    for path in candidates:
        if (path / BAD_MARKER).exists():
            warnings.append(f"skipping {path.name}: marked bad at an earlier start ({path / BAD_MARKER})")
            continue
        try:
            validate(path)
        except CheckpointInvalid as exc:
            warnings.append(f"skipping invalid checkpoint: {exc}")
            try:
                (path / BAD_MARKER).write_text(str(exc) + "\n")  # not tried again at the next start
            except OSError:
                pass
            continue
        if warnings:
            warnings.append(f"falling back to {path.name}")
        return str(path), warnings
    if candidates:
        warnings.append(f"no valid checkpoint under {root}: starting from scratch")
    return None, warnings


def find_resume_checkpoint(ctx: DistContext, root: Path, restore_from: str | None, *, key: str = "checkpoint.restore_from") -> Path | None:
    """The checkpoint every rank should resume from, or ``None`` for a fresh start (collective).

    Raises:
        CheckpointNotFound: on every rank, when ``restore_from`` is given but missing or invalid
            (the message names it as ``key``, e.g. ``checkpoint.load_path``).
    """
    result: tuple[str | None, list[str], str | None] = (None, [], None)
    if ctx.rank == 0:
        try:
            chosen, warnings = _choose(root, restore_from, key)
            result = (chosen, warnings, None)
        except CheckpointNotFound as exc:
            result = (None, [], str(exc))
    chosen, warnings, error = ctx.broadcast_object(result)
    if error:
        raise CheckpointNotFound(error)
    if ctx.rank == 0:
        for line in warnings:
            log.warning(line)
    return Path(chosen) if chosen else None
