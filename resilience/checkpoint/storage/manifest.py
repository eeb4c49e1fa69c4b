"""The manifest: the list of every file with its size and digest (xxh3-128), plus run metadata.

It is written last, after every file is fsync'd, so its presence means "complete". Readers
trust a checkpoint only after :func:`validate` succeeds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resilience.checkpoint.layout import MANIFEST, needed_to_resume
from resilience.checkpoint.storage.durable import FileRecord, entry_digest, file_digest, write_bytes

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


def validate(directory: Path, *, checksums: bool = True, resume: bool = False, sizes: bool = True) -> dict[str, Any]:
    """Check that every listed file exists with its size, and when ``checksums`` its digest
    (reads every byte; without it the check costs one ``stat`` per file). With ``resume``, only
    the files a resume reads (:func:`~resilience.checkpoint.layout.needed_to_resume`: not the
    Hugging Face bundle written with the checkpoint, which a user may delete or export again).
    ``sizes=False`` (and no ``checksums``) checks the manifest alone, no file: for a caller that
    spreads the size checks (:func:`first_size_problem`) over ranks.

    Returns the manifest. Raises :class:`CheckpointInvalid` naming the first bad file.
    """
    if not directory.is_dir():
        raise CheckpointInvalid(f"{directory}: no such checkpoint directory")
    doc = read_manifest(directory)
    files = resume_files(doc) if resume else doc["files"]
    for rel, want in files.items():
        problem = size_problem(directory / rel, want.get("size") if isinstance(want, dict) else want) if sizes else None
        if problem is not None:
            raise CheckpointInvalid(f"{directory / rel}: {problem}")
        if entry_digest(want) is None:
            raise CheckpointInvalid(f"{directory / MANIFEST}: the entry of {rel} has no digest")
    if checksums:
        check_contents(directory, files)
    return doc


def resume_files(doc: dict[str, Any]) -> dict[str, Any]:
    """The entries of manifest ``doc`` a resume reads (:func:`~resilience.checkpoint.layout.needed_to_resume`), in its order."""
    return {rel: want for rel, want in doc["files"].items() if needed_to_resume(rel)}


def first_size_problem(directory: Path, files: dict[str, Any]) -> str | None:
    """``"<path>: <problem>"`` (:func:`size_problem`) for the first of ``files`` (``{relative path:
    entry}``) under ``directory`` that is missing or of another size than its entry, else None:
    :func:`validate`'s size check, for a share of the files. One ``stat`` per file."""
    for rel, want in files.items():
        problem = size_problem(directory / rel, want.get("size") if isinstance(want, dict) else want)
        if problem is not None:
            return f"{directory / rel}: {problem}"
    return None


def check_contents(directory: Path, files: dict[str, Any]) -> None:
    """Compare every file's digest with its manifest entry (``files``: ``{relative path: entry}``,
    already size-checked by :func:`validate`).

    Raises :class:`CheckpointInvalid` naming the first file whose bytes differ.
    """
    for rel, want in files.items():
        problem = digest_problem(directory / rel, want)
        if problem is not None:
            raise CheckpointInvalid(f"{directory / rel}: {problem}")


# The checks of one manifest entry, shared by validate (first problem raises), the loader's
# background check and ``resilience verify`` (every problem reported).


def well_formed(rel: Any, want: Any) -> bool:
    """True for an entry ``rel: want`` that names a relative path inside the checkpoint and has an
    integer size and a known digest."""
    return (
        isinstance(rel, str)
        and bool(rel)
        and not os.path.isabs(rel)
        and ".." not in Path(rel).parts
        and isinstance(want, dict)
        and isinstance(want.get("size"), int)
        and entry_digest(want) is not None
    )


def size_problem(path: Path, size: Any) -> str | None:
    """Why the file at ``path`` is not ``size`` bytes (``missing``, ``unreadable (...)``,
    ``N bytes, manifest says M (truncated?)``), or None when it is."""
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    return None if actual == size else f"{actual} bytes, manifest says {size} (truncated?)"


def digest_problem(path: Path, want: dict[str, Any], advance: Callable[[int], object] | None = None) -> str | None:
    """Why the bytes at ``path`` do not have entry ``want``'s digest (no digest in the entry,
    ``unreadable (...)``, ``checksum mismatch (corrupted bytes)``), or None when they do.
    ``advance(n)`` is called with the bytes read (a progress bar)."""
    digest = entry_digest(want)
    if digest is None:
        return "its manifest entry has no digest"
    try:
        actual = file_digest(path, digest[0], advance)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return None if actual == digest[1] else "checksum mismatch (corrupted bytes)"
