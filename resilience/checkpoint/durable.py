"""Durable file primitives: write + fsync, directory fsync, checksums.

A rename is only durable once the *directory* holding it is fsync'd (POSIX), so every
publication step below ends with :func:`fsync_dir` on the parent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

_CHUNK = 8 << 20  # 8 MiB reads: large enough to run at disk speed, small enough to stay cheap


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """A file in a checkpoint: path relative to the checkpoint directory, size in bytes, sha256 hex."""

    path: str
    size: int
    sha256: str


def fsync_dir(path: Path) -> None:
    """fsync a directory so renames and creations inside it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to a new file at ``path`` and fsync it. Raises ``OSError`` (e.g. ENOSPC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """fsync an existing file (one written by a library that does not fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's contents."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def record(root: Path, relpath: str) -> FileRecord:
    """Describe ``root/relpath`` for the manifest (size and sha256)."""
    full = root / relpath
    return FileRecord(path=relpath, size=full.stat().st_size, sha256=sha256_file(full))
