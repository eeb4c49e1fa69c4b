"""Whether a directory can be the checkpoint root: a directory (or one that can be created), writable when saving.

Checked once, before any training, so a root that cannot hold checkpoints is a configuration
error at start, not a failed save (the first one may be a preemption's).
"""

from __future__ import annotations

import os
from pathlib import Path


def root_problem(root: Path, *, saving: bool) -> str | None:
    """Why ``root`` cannot be the checkpoint directory, or ``None`` (``saving``: it must be writable too).

    The check :meth:`Checkpointer._check_root <resilience.checkpoint.checkpointer.Checkpointer._check_root>`
    runs on rank 0 before any training."""
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # the nearest existing ancestor: the first save creates the rest
    if not existing.is_dir():
        return f"{existing} is a file, not a directory" if existing == root else f"{existing}, a parent of it, is a file"
    if not saving:
        return None  # reading only: a directory that does not exist yet just holds no checkpoint
    # A real attempt (mode bits, ACLs, read-only mounts and root squashing all answer it), undone
    # at once: a file in the directory, or the first missing directory under its nearest ancestor.
    probe = existing / f".write_probe.{os.getpid()}"
    try:
        if existing == root:
            probe.write_bytes(b"")
            probe.unlink()
        else:
            probe.mkdir()
            probe.rmdir()
    except OSError as exc:
        what = "write in" if existing == root else "create directories in"
        return f"cannot {what} {existing} ({exc.strerror or exc})"
    return None
