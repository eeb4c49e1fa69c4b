"""The manifest: the list of every file with its size and digest (xxh3-128), plus run metadata.

It is written last, after every file is fsync'd, so its presence means "complete". Readers
trust a checkpoint only after :func:`validate` succeeds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from resilience.checkpoint.durable import FileRecord, entry_digest, file_digest, write_bytes
from resilience.checkpoint.layout import MANIFEST

FORMAT_VERSION = 1


class CheckpointInvalid(Exception):
    """A checkpoint directory is incomplete or corrupt; the message says which file and why."""


def write_manifest(directory: Path, files: list[FileRecord], meta: dict[str, Any]) -> None:
    """Write ``manifest.json`` (fsync'd) listing ``files`` with ``meta``."""
    doc = {
        "format_version": FORMAT_VERSION,
        "meta": meta,
        "files": {f.path: f.manifest_entry() for f in sorted(files, key=lambda f: f.path)},
    }
    write_bytes(directory / MANIFEST, json.dumps(doc, indent=1, sort_keys=True).encode())


def read_manifest(directory: Path) -> dict[str, Any]:
    """The parsed manifest. Raises :class:`CheckpointInvalid` when missing or malformed."""
    path = directory / MANIFEST
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointInvalid(f"{directory}: no {MANIFEST} (an incomplete save)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointInvalid(f"{path}: unreadable manifest ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format_version") != FORMAT_VERSION or not isinstance(doc.get("files"), dict):
        raise CheckpointInvalid(f"{path}: not a format-{FORMAT_VERSION} manifest")
    return doc


def validate(directory: Path, *, checksums: bool = True) -> dict[str, Any]:
    """Check that every listed file exists with its size, and when ``checksums`` its digest
    (reads every byte; without it the check costs one ``stat`` per file).

    Returns the manifest. Raises :class:`CheckpointInvalid` naming the first bad file.
    """
    if not directory.is_dir():
        raise CheckpointInvalid(f"{directory}: no such checkpoint directory")
    doc = read_manifest(directory)
    for rel, want in doc["files"].items():
        path = directory / rel
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointInvalid(f"{path}: missing") from None
        if not isinstance(want, dict) or size != want.get("size"):
            raise CheckpointInvalid(f"{path}: {size} bytes, manifest says {want.get('size') if isinstance(want, dict) else want!r} (truncated?)")
        if entry_digest(want) is None:
            raise CheckpointInvalid(f"{directory / MANIFEST}: the entry of {rel} has no digest")
    if checksums:
        check_contents(directory, doc)
    return doc


def check_contents(directory: Path, doc: dict[str, Any]) -> None:
    """Compare every file's digest with manifest ``doc`` (already size-checked by :func:`validate`).

    Raises :class:`CheckpointInvalid` naming the first file whose bytes differ.
    """
    for rel, want in doc["files"].items():
        algorithm, digest = entry_digest(want)
        path = directory / rel
        try:
            actual = file_digest(path, algorithm)
        except OSError as exc:
            raise CheckpointInvalid(f"{path}: unreadable ({exc})") from exc
        if actual != digest:
            raise CheckpointInvalid(f"{path}: checksum mismatch (corrupted bytes)")
