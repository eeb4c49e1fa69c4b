"""``resilience verify PATH``: every file's size and digest against its manifest, every failure reported.

``PATH`` is a checkpoint directory or a checkpoint root (then every published checkpoint in it;
unpublished leftovers and checkpoints set aside after a rollback are listed as skipped). Only the
standard library is imported at import time; the checkpoint modules and tqdm are imported
inside the functions, so registering the command costs ``resilience run`` nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resilience.checkpoint.layout import (
    ABANDONED_INFIX,
    BAD_MARKER,
    BUNDLE_MANIFEST,
    MANIFEST,
    MODEL_CONSOLIDATE_SH,
    MODEL_CONSOLIDATED,
    STAGING_PREFIX,
    TRASH_PREFIX,
    list_checkpoints,
    needed_to_resume,
    parse_checkpoint_name,
)
from resilience.cli.output import JSON_VERSION, UsageError, add_json_flag, existing_dir, first_line, print_doc, read_side, usage_failed, within
from resilience.exit_codes import ExitCode

HELP = "check every file's size and digest against the manifest of a checkpoint, or of every checkpoint under a root; exit 1 on any failure"


FILES_AT = "_files_at"
"""The key of a checkpoint's files' location in :func:`verify_path`'s copy of its manifest (object storage)."""


def _targets(path: Path) -> tuple[list[Path], list[str], list[str]]:
    """(checkpoint directories to verify, names of unpublished leftovers skipped, names of
    checkpoints set aside after a rollback, skipped: no run resumes from them)."""
    if (path / MANIFEST).exists() or parse_checkpoint_name(path.name) or path.name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
        return [path], [], []
    found = list_checkpoints(path)
    if not found:
        raise UsageError(f"PATH {str(path)!r}: neither a checkpoint directory (no {MANIFEST}) nor a checkpoint root (no epoch_<E>_step_<S> directories in it)")
    children = sorted(c.name for c in path.iterdir() if c.is_dir() and not c.is_symlink())
    leftovers = [name for name in children if name.startswith((STAGING_PREFIX, TRASH_PREFIX))]
    set_aside = [name for name in children if ABANDONED_INFIX in name and parse_checkpoint_name(name.split(ABANDONED_INFIX)[0])]
    return found, leftovers, set_aside


def _check_files(directory: Path, files: dict[str, Any], result: dict[str, Any], advance: Callable[[int], object], prefix: str = "") -> None:
    """Check each ``files`` entry (``{relative path: {"size", digest}}``, under ``directory``)
    against the bytes on disk; failures are appended to ``result["failures"]`` named
    ``prefix + path``, counts added to ``result``."""
    from resilience.checkpoint.storage.manifest import digest_problem, size_problem, well_formed

    failures = result["failures"]
    for rel, want in sorted(files.items()):
        name = f"{prefix}{rel}"
        if not well_formed(rel, want):
            failures.append({"file": name, "problem": "malformed manifest entry (needs a relative path, an integer size and a digest)"})
            continue
        result["files_checked"] += 1
        problem = size_problem(directory / rel, want["size"])
        if problem is not None:
            failures.append({"file": name, "problem": problem})
            advance(want["size"])  # not read
            continue
        problem = digest_problem(directory / rel, want, advance)
        if problem is None or not problem.startswith("unreadable"):
            result["bytes_checked"] += want["size"]
        if problem is not None:
            failures.append({"file": name, "problem": problem})


def _bundle(directory: Path, manifest: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None, str | None]:
    """``(state, files, problem)`` of ``model/consolidated/`` (the Hugging Face bundle). state:
    None (no bundle, or the one written with the checkpoint, checked with its manifest),
    ``removed`` (written with the checkpoint, deleted since: a resume does not need it),
    ``verified`` (written later, with ``bundle_manifest.json``: ``files`` are its entries; also a
    bundle that replaced the checkpoint's own), ``unverified`` (written later, without one) or
    ``failed`` (its bundle manifest is unreadable: ``problem``)."""
    bundle = directory / MODEL_CONSOLIDATED
    with_checkpoint = any(not needed_to_resume(rel) for rel in manifest["files"])
    if not bundle.is_dir():
        return ("removed" if with_checkpoint else None), None, None
    if not (bundle / BUNDLE_MANIFEST).exists():
        return (None if with_checkpoint else "unverified"), None, None
    try:
        files = json.loads((bundle / BUNDLE_MANIFEST).read_text())["files"]
        if not isinstance(files, dict):
            raise TypeError("files is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return "failed", None, f"unreadable ({exc})"
    return "verified", files, None


def verify_checkpoint(directory: Path, manifest: dict[str, Any] | None, error: str | None, advance: Callable[[int], object]) -> dict[str, Any]:
    """Check every file ``manifest`` lists under ``directory``; every failure is reported.

    ``error`` is why the manifest could not be read (then ``manifest`` is None). ``advance(n)`` is
    called with the bytes read or skipped, for a progress bar. A Hugging Face bundle added after
    the checkpoint was published (``model/consolidate.sh``) is checked against its own
    ``bundle_manifest.json``; one without it is reported as unverified (not a failure). Returns
    ``{"name", "ok", "files_checked", "bytes_checked", "failures": [{"file", "problem"}],
    "marked_bad", "bundle", "producer"}`` (``bundle``: None, ``removed``, ``verified``, ``unverified`` or
    ``failed``; ``producer``: ``meta.producer``, the trainer whose own files a trainer integration saved).
    """
    result: dict[str, Any] = {
        "name": directory.name,
        "ok": True,
        "files_checked": 0,
        "bytes_checked": 0,
        "failures": [],
        "marked_bad": first_line(directory / BAD_MARKER) if (directory / BAD_MARKER).exists() else None,
        "bundle": None,
        "producer": None,
    }
    if manifest is None:
        result["failures"].append({"file": MANIFEST, "problem": error or "unreadable"})
    else:
        meta = manifest.get("meta")
        result["producer"] = meta.get("producer") if isinstance(meta, dict) else None  # a trainer's own layout (an integration's)
        files_at = manifest.get(FILES_AT, directory)
        state, files, problem = _bundle(files_at, manifest)
        # A bundle removed or built again since the save is checked by its own manifest, if at all.
        own = {rel: want for rel, want in manifest["files"].items() if state is None or needed_to_resume(rel)}
        _check_files(files_at, own, result, advance)
        result["bundle"] = state
        prefix = f"{MODEL_CONSOLIDATED}/"
        if problem is not None:
            result["failures"].append({"file": prefix + BUNDLE_MANIFEST, "problem": problem})
        elif files is not None:
            before = len(result["failures"])
            _check_files(files_at / MODEL_CONSOLIDATED, files, result, advance, prefix)
            if len(result["failures"]) > before:
                result["bundle"] = "failed"
    result["ok"] = not result["failures"]
    return result


def verify_path(path: Path, *, progress: bool = True) -> dict[str, Any]:
    """The ``verify`` document for ``path`` (a checkpoint directory or a root of them).

    A tqdm bar over the bytes to hash goes to stderr when ``progress``. Raises
    :class:`UsageError` when ``path`` is neither a checkpoint directory nor a root holding one.
    """
    from tqdm import tqdm

    from resilience.checkpoint.storage.manifest import CheckpointInvalid, all_files, data_dir, read_manifest

    directories, leftovers, set_aside = _targets(path)
    manifests: list[tuple[Path, dict[str, Any] | None, str | None]] = []
    for directory in directories:
        try:
            doc = read_manifest(directory)
            # every rank's own files too; a bad rank manifest fails as a file of the list, its ranks' files unchecked
            files_at = data_dir(directory, doc)  # on object storage, the prefix the manifest names
            manifests.append((directory, {**doc, "files": all_files(files_at, doc, skip_bad=True), FILES_AT: files_at}, None))
        except CheckpointInvalid as exc:
            problem = "missing (an incomplete save)" if not (directory / MANIFEST).exists() else within(str(exc), directory)
            manifests.append((directory, None, problem))
    total = sum(w.get("size", 0) for _, m, _ in manifests if m for w in m["files"].values() if isinstance(w, dict) and isinstance(w.get("size"), int))
    results = []
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, disable=not progress, leave=False) as bar:
        for directory, manifest, error in manifests:
            bar.set_description(directory.name)
            results.append(verify_checkpoint(directory, manifest, error, bar.update))
    ok = all(r["ok"] for r in results)
    return {"version": JSON_VERSION, "path": str(path), "ok": ok, "checkpoints": results, "skipped": leftovers, "set_aside": set_aside}


def format_verify(doc: dict[str, Any]) -> str:
    """The terminal form of a :func:`verify_path` document."""
    lines = []
    for r in doc["checkpoints"]:
        note = f" (marked bad: {r['marked_bad']})" if r["marked_bad"] is not None else ""
        note += f" (written by {r['producer']})" if r.get("producer") else ""
        if r["ok"]:
            lines.append(f"{r['name']}: ok, {r['files_checked']} files{note}")
        else:
            count = f", {len(r['failures'])} of {r['files_checked']} files" if r["files_checked"] else ""
            lines.append(f"{r['name']}: FAILED{count}{note}")
            lines += [f"  {f['file']}: {f['problem']}" for f in r["failures"]]
        if r.get("bundle") == "verified":
            lines.append(f"  {MODEL_CONSOLIDATED}/: verified against its {BUNDLE_MANIFEST} (written after the checkpoint)")
        elif r.get("bundle") == "removed":
            lines.append(f"  {MODEL_CONSOLIDATED}/: removed since the checkpoint was saved (not needed to resume; {MODEL_CONSOLIDATE_SH} builds it again)")
        elif r.get("bundle") == "unverified":
            lines.append(
                f"  {MODEL_CONSOLIDATED}/: unverified (written after the checkpoint, with no {BUNDLE_MANIFEST}; "
                f"remove it and run {MODEL_CONSOLIDATE_SH} again to get one)"
            )
    for name in doc["skipped"]:
        lines.append(f"{name}: skipped (not published)")
    for name in doc.get("set_aside", []):
        lines.append(f"{name}: skipped (set aside after a rollback, never resumed from; give its path to verify it)")
    failed = sum(not r["ok"] for r in doc["checkpoints"])
    total = len(doc["checkpoints"])
    lines.append(f"{total} checkpoint{'s' if total != 1 else ''} verified: {total - failed} ok, {failed} failed")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare ``PATH``, ``--json``, ``--no-progress``."""
    parser.add_argument("path", metavar="PATH", help="a checkpoint directory, or a checkpoint root (then every checkpoint in it)")
    add_json_flag(parser, instead_of="text")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def run(args: argparse.Namespace) -> int:
    """Verify ``args.path``: 0 when every checksum matches, 1 on any failure, 2 on bad arguments."""
    try:
        path = read_side(existing_dir(args.path, "PATH"))
        doc = verify_path(path, progress=not args.no_progress)
    except UsageError as exc:
        return usage_failed("verify", exc)
    print_doc(doc, args.json, format_verify)
    return int(ExitCode.DONE if doc["ok"] else ExitCode.FAILED)
