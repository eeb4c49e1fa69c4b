"""The manifest: every file's size and digest (xxh3-128), plus run metadata.

It is written last, after every file is fsync'd, so its presence means "complete". Readers
trust a checkpoint only after :func:`validate` succeeds.

Format 2 keeps it O(tensors), not O(ranks): ``manifest.json`` lists the files any rank may read
(a replicated model's and optimizer's files, indexes, the run's records) and the *rank
manifests*, each holding the *own* files (those only their writer reads back at the same world
size: rank state, a sharded model's and optimizer's shards) of a block of ranks
(``rank_manifests/ranks_<first>-<last>.json``, written by the block's first rank), with
``"rank_blocks": {"world_size": N, "block": B}``. A rank reads the rank manifests of the saved
ranks it checks (:func:`owned_ranks`: its own at the same world size), each checked against its
digest in the manifest, so the manifest's chain of digests covers every byte. At 8,192 ranks the
single list was 34 MiB (FSDP2), read by rank 0 and broadcast to every rank at each resume. Format 1
manifests (one list) still load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from resilience.checkpoint.layout import MANIFEST, needed_to_resume, rank_manifest_file
from resilience.checkpoint.storage.durable import FileRecord, bytes_digest, entry_digest, file_digest, write_bytes
from resilience.checkpoint.storage.object_path import Location, ObjectPath
from resilience.checkpoint.storage.object_store import StoreError

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
RANK_MANIFESTS = "rank_blocks"
"""The manifest's key of ``{"world_size": N, "block": B}`` (format 2)."""
OBJECTS = "objects"
"""The manifest's key, on object storage only, of the prefix (relative to the checkpoint root)
holding the checkpoint's files: ``<name>/<checkpoint id>``, one per save, so a re-save of a
step never overwrites the files the previous manifest describes (see :func:`data_dir`)."""
OWNED = "owned_files"
"""A key a rank adds to its own parsed copy of a manifest (never written): the entries of the
files of the saved ranks it checks (:func:`read_owned`), so the load's digest share finds them."""


class CheckpointInvalid(Exception):
    """A checkpoint directory is incomplete or corrupt; the message says which file and why."""


def write_manifest(
    directory: Path, files: list[FileRecord], meta: dict[str, Any], rank_manifests: dict[str, int] | None = None, *, objects: str | None = None
) -> None:
    """Write ``manifest.json`` (fsync'd) listing ``files`` (the rank manifests' among them) with
    ``meta``; ``rank_manifests``: ``{"world_size": N, "block": B}`` when the ranks' own files are in
    rank manifests (:func:`write_rank_manifest`); ``objects``: the prefix of the files on object
    storage (:data:`OBJECTS`)."""
    doc: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "meta": meta,
        "files": {f.path: f.manifest_entry() for f in sorted(files, key=lambda f: f.path)},
    }
    if rank_manifests is not None:
        doc[RANK_MANIFESTS] = rank_manifests
    if objects is not None:
        doc[OBJECTS] = objects
    write_bytes(directory / MANIFEST, json.dumps(doc, indent=1, sort_keys=True).encode())


def read_manifest(directory: Location) -> dict[str, Any]:
    """The parsed manifest. Raises :class:`CheckpointInvalid` when missing or malformed."""
    path = directory / MANIFEST
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointInvalid(f"{directory}: no {MANIFEST} (an incomplete save)") from None
    except StoreError:
        raise  # the store failed to answer (after its retries): nothing is known of the checkpoint
    except (OSError, ValueError) as exc:
        raise CheckpointInvalid(f"{path}: unreadable manifest ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format_version") not in READABLE_VERSIONS or not isinstance(doc.get("files"), dict):
        raise CheckpointInvalid(f"{path}: not a manifest of format {' or '.join(map(str, READABLE_VERSIONS))}")
    ranks = doc.get(RANK_MANIFESTS)
    if ranks is not None and not (isinstance(ranks, dict) and all(isinstance(ranks.get(k), int) and ranks[k] > 0 for k in ("world_size", "block"))):
        raise CheckpointInvalid(f"{path}: {RANK_MANIFESTS} is not {{world_size, block}} ({ranks!r})")
    objects = doc.get(OBJECTS)
    if objects is not None and not (isinstance(objects, str) and objects.strip("/") and ".." not in objects.split("/") and not objects.startswith("/")):
        raise CheckpointInvalid(f"{path}: {OBJECTS} is not a prefix under the checkpoint root ({objects!r})")
    return doc


def data_dir(directory: Any, doc: dict[str, Any]) -> Any:
    """Where the files of the checkpoint ``directory`` (its parsed manifest ``doc``) lie: the
    directory itself, or on object storage the save's own prefix (:data:`OBJECTS`, under the root;
    a local copy of such a checkpoint holds its files in the directory itself)."""
    objects = doc.get(OBJECTS)
    return directory.parent / objects if objects and isinstance(directory, ObjectPath) else directory


# Rank manifests (format 2): each block of ranks' own files.


def write_rank_manifest(directory: Path, first: int, per_rank: list[list[FileRecord]]) -> FileRecord:
    """Write the rank manifest of ranks ``first .. first + len(per_rank) - 1`` (``per_rank[i]``:
    rank ``first + i``'s own files) into ``directory`` (fsync'd); returns its record, which goes
    into the manifest. Raises ``OSError`` from the write."""
    rel = rank_manifest_file(first, first + len(per_rank) - 1)
    doc = {
        "format_version": FORMAT_VERSION,
        "ranks": {str(first + i): {f.path: f.manifest_entry() for f in sorted(records, key=lambda f: f.path)} for i, records in enumerate(per_rank)},
    }
    data = json.dumps(doc, sort_keys=True).encode()
    (directory / rel).parent.mkdir(parents=True, exist_ok=True)
    write_bytes(directory / rel, data)
    return FileRecord(rel, len(data), bytes_digest(data))


def owned_ranks(doc: dict[str, Any], rank: int, world_size: int) -> range:
    """The saved ranks whose own files rank ``rank`` of ``world_size`` checks: ``rank``,
    ``rank + world_size``, ... below the saved world size (its own at the same world size; none for
    a format 1 manifest, whose list holds every file)."""
    ranks = doc.get(RANK_MANIFESTS)
    return range(rank, ranks["world_size"], world_size) if ranks else range(0)


def read_owned(directory: Location, doc: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """The entries (``{relative path: entry}``) of the own files of the saved ranks rank ``rank``
    of ``world_size`` checks (:func:`owned_ranks`), from their rank manifests, each read once and
    checked against its entry in ``doc`` (digest included: they are small).

    Raises:
        CheckpointInvalid: a rank manifest is missing, of another size or digest than its entry,
            unreadable, or lacks a rank it should hold.
    """
    return ranks_entries(directory, doc, owned_ranks(doc, rank, world_size))


def ranks_entries(directory: Location, doc: dict[str, Any], saved_ranks: Iterable[int]) -> dict[str, Any]:
    """The entries of the own files of ``saved_ranks``, from their rank manifests (each read once,
    checked against its entry in ``doc``); ``{}`` for a format 1 manifest. Raises
    :class:`CheckpointInvalid` as :func:`read_owned`."""
    ranks = doc.get(RANK_MANIFESTS)
    out: dict[str, Any] = {}
    if not ranks:
        return out  # format 1: every file is in the list
    blocks: dict[str, dict[str, Any]] = {}
    for saved in saved_ranks:
        first = saved - saved % ranks["block"]
        rel = rank_manifest_file(first, min(first + ranks["block"], ranks["world_size"]) - 1)
        if rel not in blocks:
            blocks[rel] = _read_rank_manifest(directory, rel, doc["files"].get(rel))
        files = blocks[rel].get(str(saved))
        if not isinstance(files, dict):
            raise CheckpointInvalid(f"{directory / rel}: holds no entry for rank {saved}")
        out.update(files)
    return out


def all_files(directory: Location, doc: dict[str, Any], *, skip_bad: bool = False) -> dict[str, Any]:
    """Every file's entry: the manifest's list and every rank's own files (reading every rank
    manifest: O(files), for the command-line tools and a full checksum pass, not for a resume).

    Raises :class:`CheckpointInvalid` as :func:`read_owned`; with ``skip_bad`` a bad rank manifest's
    files are left out instead (its own entry, in the list, still fails a check of it: ``verify``).
    """
    files = dict(doc["files"])
    ranks = doc.get(RANK_MANIFESTS)
    if not ranks:
        return files  # format 1: every file is in the list
    for first in range(0, ranks["world_size"], ranks["block"]):
        last = min(first + ranks["block"], ranks["world_size"]) - 1
        rel = rank_manifest_file(first, last)
        try:
            block = _read_rank_manifest(directory, rel, doc["files"].get(rel))
            missing = [r for r in range(first, last + 1) if not isinstance(block.get(str(r)), dict)]
            if missing:
                raise CheckpointInvalid(f"{directory / rel}: holds no entry for rank {missing[0]}")
        except CheckpointInvalid:
            if skip_bad:
                continue
            raise
        for entries in block.values():
            files.update(entries)
    return files


def _read_rank_manifest(directory: Location, rel: str, want: Any) -> dict[str, Any]:
    """Rank manifest ``rel``'s ``{rank: {path: entry}}``, its bytes checked against ``want``."""
    if not isinstance(want, dict):
        raise CheckpointInvalid(f"{directory / MANIFEST}: lists no {rel}")
    try:
        data = (directory / rel).read_bytes()
    except FileNotFoundError:
        raise CheckpointInvalid(f"{directory / rel}: missing") from None
    except StoreError:
        raise
    except OSError as exc:
        raise CheckpointInvalid(f"{directory / rel}: unreadable ({exc.strerror})") from exc
    if len(data) != want.get("size"):
        raise CheckpointInvalid(f"{directory / rel}: {len(data)} bytes, manifest says {want.get('size')} (truncated?)")
    digest = entry_digest(want)
    if digest is None or bytes_digest(data, digest[0]) != digest[1]:
        raise CheckpointInvalid(f"{directory / rel}: checksum mismatch (corrupted bytes)")
    try:
        ranks = json.loads(data)["ranks"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointInvalid(f"{directory / rel}: unreadable rank manifest ({exc})") from exc
    if not isinstance(ranks, dict):
        raise CheckpointInvalid(f"{directory / rel}: unreadable rank manifest")
    return ranks


def validate(directory: Location, *, checksums: bool = True, resume: bool = False, sizes: bool = True) -> dict[str, Any]:
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
    if not sizes and not checksums:
        return doc  # the manifest alone: the rank manifests are read by the ranks that check them
    files_at = data_dir(directory, doc)
    every = all_files(files_at, doc)
    files = {rel: want for rel, want in every.items() if needed_to_resume(rel)} if resume else every
    for rel, want in files.items():
        problem = size_problem(files_at / rel, want.get("size") if isinstance(want, dict) else want) if sizes else None
        if problem is not None:
            raise CheckpointInvalid(f"{files_at / rel}: {problem}")
        if entry_digest(want) is None:
            raise CheckpointInvalid(f"{directory / MANIFEST}: the entry of {rel} has no digest")
    if checksums:
        check_contents(files_at, files)
    return doc


def resume_files(doc: dict[str, Any]) -> dict[str, Any]:
    """The entries of manifest ``doc``'s list a resume reads (:func:`~resilience.checkpoint.layout.needed_to_resume`),
    in its order: with format 2, the files any rank may read, not the ranks' own (:data:`OWNED`)."""
    return {rel: want for rel, want in doc["files"].items() if needed_to_resume(rel)}


def first_size_problem(directory: Location, files: dict[str, Any]) -> str | None:
    """``"<path>: <problem>"`` (:func:`size_problem`) for the first of ``files`` (``{relative path:
    entry}``) under ``directory`` that is missing or of another size than its entry, else None:
    :func:`validate`'s size check, for a share of the files. One ``stat`` per file."""
    for rel, want in files.items():
        problem = size_problem(directory / rel, want.get("size") if isinstance(want, dict) else want)
        if problem is not None:
            return f"{directory / rel}: {problem}"
    return None


def check_contents(directory: Location, files: dict[str, Any]) -> None:
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


def size_problem(path: Location, size: Any) -> str | None:
    """Why the file at ``path`` is not ``size`` bytes (``missing``, ``unreadable (...)``,
    ``N bytes, manifest says M (truncated?)``), or None when it is."""
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    except StoreError:
        raise
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    return None if actual == size else f"{actual} bytes, manifest says {size} (truncated?)"


def digest_problem(path: Location, want: dict[str, Any], advance: Callable[[int], object] | None = None) -> str | None:
    """Why the bytes at ``path`` do not have entry ``want``'s digest (no digest in the entry,
    ``unreadable (...)``, ``checksum mismatch (corrupted bytes)``), or None when they do.
    ``advance(n)`` is called with the bytes read (a progress bar)."""
    digest = entry_digest(want)
    if digest is None:
        return "its manifest entry has no digest"
    try:
        actual = file_digest(path, digest[0], advance)
    except StoreError:
        raise
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return None if actual == digest[1] else "checksum mismatch (corrupted bytes)"
