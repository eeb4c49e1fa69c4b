"""``resilience status``, ``resilience verify`` and ``resilience advise``: read-only views of a checkpoint root.

* ``status DIR`` tabulates every checkpoint (published, incomplete, corrupt, marked bad), the
  pointers (``LATEST``, ``LOWEST_VAL``, any other top-level symlink or ``NAME.txt`` pointer), and
  which checkpoint a resume would pick and why. It never writes: it calls
  :func:`~resilience.checkpoint.manifest.validate` itself instead of the reader's ``_choose``,
  which marks invalid checkpoints ``.bad``.
* ``verify PATH`` checks every file's size and sha256 against its manifest, reporting every
  failure, not just the first.
* ``advise DIR`` turns the step and save times recorded in the manifests into a Slurm
  ``--signal=B:USR1@N`` lead time.

This module imports only the standard library at import time, so registering it in
:mod:`resilience.cli` costs ``resilience run`` nothing; the checkpoint modules and tqdm are
imported inside the commands. The text output is for people; ``--json`` prints a document
with ``"version": 1`` whose keys only ever get added to.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

from resilience.exit_codes import ExitCode

JSON_VERSION = 1
SLURM_SIGNAL_INTERVAL_S = 30
"""Slurm checks ``--signal`` times about every 30 s, so a signal asked for ``@N`` arrives
between N and N + 30 s before the end (sbatch(1), ``--signal``)."""

_POINTER_ORDER = ("LATEST", "LOWEST_VAL")
_CHUNK = 8 << 20  # hash in 8 MiB reads (as resilience.checkpoint.durable does)


class UsageError(ValueError):
    """Bad command-line input (exit code 2); the message names the argument."""


# -- small helpers ------------------------------------------------------------------------------


def human_size(size: int | None) -> str:
    """``size`` bytes as ``"812 B"``, ``"12.3 KiB"``, ``"4.0 GiB"`` (powers of 1024); ``"-"`` for None."""
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def iso_utc(timestamp: Any) -> str | None:
    """Unix time (seconds) as ``2024-05-01T12:00:00Z``; ``None`` when not a finite number."""
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or not math.isfinite(timestamp):
        return None
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _tree_size(path: Path) -> int:
    """Bytes of every regular file under ``path`` (symlinks not followed)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass  # removed while we walk (retention on a live run)
    return total


def _relative(message: str, root: Path) -> str:
    """``message`` with ``root/`` stripped from the paths in it (shorter, and stable across roots)."""
    return message.replace(str(root) + os.sep, "")


def _within(message: str, directory: Path) -> str:
    """``message`` about a file of ``directory``, with the directory's own path taken out."""
    if message.startswith(f"{directory}: "):
        message = message[len(str(directory)) + 2:]
    return message.replace(str(directory) + os.sep, "")


def _first_line(path: Path) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    return text.splitlines()[0] if text else "(empty)"


def _format_metric(metric: Any) -> str:
    if not isinstance(metric, dict) or "key" not in metric:
        return "-"
    value = metric.get("value")
    shown = f"{value:.6g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else ("-" if value is None else str(value))
    return f"{metric['key']}={shown}"


def _table(headers: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    """Plain text columns two spaces apart; columns in ``right`` right-aligned."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = []
    for row in [headers, *rows]:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return lines


def _emit(text: str) -> None:
    """Print ``text``; a reader that went away (``| head``) is not an error."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python's documented recipe: point stdout at devnull so the flush at exit stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _print_json(doc: dict[str, Any]) -> None:
    _emit(json.dumps(doc, indent=2, sort_keys=True))


def _existing_dir(text: str, what: str) -> Path:
    path = Path(text)
    if not path.exists():
        raise UsageError(f"{what} {text!r}: no such directory")
    if not path.is_dir():
        raise UsageError(f"{what} {text!r}: not a directory")
    return path


# -- status -------------------------------------------------------------------------------------


def _check(path: Path, deep: bool) -> tuple[str, str | None, dict[str, Any]]:
    """``(state, problem, meta)`` of a published-looking directory; state is ``complete``,
    ``incomplete`` (no manifest) or ``corrupt``; ``.bad`` is not looked at here."""
    from resilience.checkpoint.layout import MANIFEST
    from resilience.checkpoint.manifest import CheckpointInvalid, read_manifest, validate

    if not path.is_dir():
        return "missing", "no such directory", {}
    if not (path / MANIFEST).exists():
        return "incomplete", f"no {MANIFEST} (an interrupted or partial save)", {}
    meta: dict[str, Any] = {}
    try:
        meta = read_manifest(path).get("meta") or {}
        validate(path, checksums=deep)
    except CheckpointInvalid as exc:
        return "corrupt", _within(str(exc), path), meta if isinstance(meta, dict) else {}
    return "complete", None, meta if isinstance(meta, dict) else {}


def _pointer_names(root: Path) -> list[str]:
    """``LATEST``, ``LOWEST_VAL`` and every other top-level pointer: a symlink to a bare name, or a
    ``NAME.txt`` holding a checkpoint name (or the name of a directory under ``root``)."""
    from resilience.checkpoint.layout import parse_checkpoint_name

    names = set()
    for child in root.iterdir():
        name = child.name
        if name.startswith(".") or parse_checkpoint_name(name):
            continue  # .NAME.tmp.PID: a pointer swap in progress
        if child.is_symlink():
            if name in _POINTER_ORDER or "/" not in os.readlink(child).strip("/"):
                names.add(name)
        elif name.endswith(".txt") and child.is_file() and len(name) > 4:
            try:
                with open(child, "rb") as fh:
                    text = fh.read(4097).decode().strip()
            except (OSError, UnicodeDecodeError):
                continue
            if text and len(text) <= 4096 and not any(c.isspace() for c in text) and (
                name[:-4] in _POINTER_ORDER or parse_checkpoint_name(text) or (root / text).is_dir()
            ):
                names.add(name[:-4])
    order = {name: i for i, name in enumerate(_POINTER_ORDER)}
    return sorted(names, key=lambda n: (order.get(n, len(order)), n))


def _read_pointers(root: Path) -> dict[str, dict[str, Any]]:
    from resilience.checkpoint.pointers import PointerError, read_pointer

    pointers = {}
    for name in _pointer_names(root):
        entry: dict[str, Any] = {"form": "symlink" if (root / name).is_symlink() else f"{name}.txt", "target": None, "error": None}
        try:
            target = read_pointer(root, name)
        except PointerError as exc:
            entry["error"] = _relative(str(exc), root)
        else:
            if target is not None:
                entry["target"] = target.name
                if not target.is_dir():
                    entry["error"] = f"target {target.name} does not exist"
        pointers[name] = entry
    return pointers


def _entries(root: Path, deep: bool) -> list[dict[str, Any]]:
    """One entry per checkpoint-like directory under ``root``, newest step first."""
    from resilience.checkpoint.layout import BAD_MARKER, STAGING_PREFIX, TRASH_PREFIX, list_checkpoints, parse_checkpoint_name

    found: list[tuple[str, Path]] = [("checkpoint", path) for path in list_checkpoints(root)]
    for child in root.iterdir():
        if child.is_dir() and not child.is_symlink():
            if child.name.startswith(STAGING_PREFIX):
                found.append(("staging", child))
            elif child.name.startswith(TRASH_PREFIX):
                found.append(("trash", child))
    entries = []
    for kind, path in found:
        prefix = {"checkpoint": "", "staging": STAGING_PREFIX, "trash": TRASH_PREFIX}[kind]
        parsed = parse_checkpoint_name(path.name[len(prefix):])
        entry: dict[str, Any] = {
            "name": path.name,
            "kind": kind,
            "epoch": parsed[0] if parsed else None,
            "global_step": parsed[1] if parsed else None,
            "size_bytes": _tree_size(path),
            "saved_at": None,
            "saved_at_unix": None,
            "reason": None,
            "world_size": None,
            "run_id": None,
            "val_metric": None,
            "marked_bad": None,
            "pointers": [],
        }
        if kind == "staging":
            state, problem, meta = "incomplete", "a save in progress or interrupted (removed at the next start)", {}
        elif kind == "trash":
            state, problem, meta = "incomplete", "set aside while being replaced or deleted (restored or removed at the next start)", {}
        else:
            state, problem, meta = _check(path, deep)
            if (path / BAD_MARKER).exists():
                entry["marked_bad"] = _relative(_first_line(path / BAD_MARKER), root)
        entry["state"] = "marked bad" if entry["marked_bad"] is not None else state
        entry["checked_state"] = state
        entry["problem"] = _relative(problem, root) if problem else None
        entry["saved_at_unix"] = meta.get("saved_at") if iso_utc(meta.get("saved_at")) else None
        entry["saved_at"] = iso_utc(meta.get("saved_at"))
        for key in ("reason", "world_size", "run_id", "val_metric"):
            entry[key] = meta.get(key)
        entries.append(entry)
    kinds = {"checkpoint": 0, "trash": 1, "staging": 2}
    entries.sort(key=lambda e: (e["global_step"] is None, -(e["global_step"] or 0), -(e["epoch"] or 0), kinds[e["kind"]], e["name"]))
    return entries


def _resume_choice(root: Path, entries: list[dict[str, Any]], pointers: dict[str, dict[str, Any]], deep: bool) -> dict[str, Any]:
    """What :func:`resilience.checkpoint.reader._choose` would pick (without ``restore_from``),
    computed without writing ``.bad`` markers."""
    from resilience.checkpoint.layout import BAD_MARKER, LATEST, list_checkpoints, parse_checkpoint_name

    by_name = {e["name"]: e for e in entries if e["kind"] == "checkpoint"}
    skipped: list[dict[str, str]] = []
    notes: list[str] = []
    latest_entry = pointers.get(LATEST)
    latest: Path | None = None
    if latest_entry is None:
        notes.append("no LATEST pointer")
    elif latest_entry["target"] is None:
        notes.append(f"LATEST ignored ({latest_entry['error']})")
    else:
        latest = root / latest_entry["target"]
    candidates: list[Path] = [latest] if latest is not None else []
    parsed = parse_checkpoint_name(latest.name) if latest is not None else None
    newest_step = parsed[1] if parsed else None
    for path in list_checkpoints(root):
        if path not in candidates and (newest_step is None or parse_checkpoint_name(path.name)[1] <= newest_step):
            candidates.append(path)

    chosen = None
    for path in candidates:
        if (path / BAD_MARKER).exists():
            skipped.append({"name": path.name, "why": "marked bad"})
            continue
        entry = by_name.get(path.name)
        state, problem = (entry["checked_state"], entry["problem"]) if entry else _check(path, deep)[:2]
        if state != "complete":
            skipped.append({"name": path.name, "why": f"{state}" + (f": {_relative(problem, root)}" if problem else "")})
            continue
        chosen = path.name
        break

    sizes_only = "" if deep else "; sizes checked, checksums not (--deep checks them, as a resume does)"
    latest_name = latest.name if latest is not None else None
    skips = ", ".join(f"{s['name']} ({'LATEST, ' if s['name'] == latest_name else ''}{s['why'].split(':')[0]})" for s in skipped)
    skips = f"skipped {skips}; " if skips else ""
    noted = "".join(f"{note}; " for note in notes)
    if chosen is None:
        reason = f"fresh start: {noted}{skips}no valid checkpoint left" if candidates else f"fresh start: {noted}no checkpoints under {root}"
    elif chosen == latest_name:
        reason = f"LATEST -> {chosen}, which is complete"
    elif latest_name is not None:
        reason = f"{skips}{chosen} is the newest older valid checkpoint"
    else:
        reason = f"{noted}{skips}{chosen} is the newest valid checkpoint"
    if chosen is not None:
        reason += sizes_only
    return {"checkpoint": chosen, "fresh_start": chosen is None, "reason": reason, "skipped": skipped, "checksums_checked": deep}


def inspect_root(root: Path, *, deep: bool = False) -> dict[str, Any]:
    """The ``status`` document of checkpoint root ``root`` (an existing directory). Read-only.

    ``deep`` also compares sha256 checksums (reads every byte); otherwise a checkpoint counts as
    complete when its manifest is readable and every listed file has the listed size.
    """
    pointers = _read_pointers(root)
    entries = _entries(root, deep)
    for name, pointer in pointers.items():
        for entry in entries:
            if entry["kind"] == "checkpoint" and entry["name"] == pointer["target"]:
                entry["pointers"].append(name)
    resume = _resume_choice(root, entries, pointers, deep)
    for entry in entries:
        entry.pop("checked_state")
    return {"version": JSON_VERSION, "root": str(root), "deep": deep, "checkpoints": entries, "pointers": pointers, "resume": resume}


def format_status(doc: dict[str, Any]) -> str:
    """The terminal form of an :func:`inspect_root` document."""
    checks = "sizes and sha256 checked" if doc["deep"] else "sizes checked; --deep also checks sha256"
    lines = [f"Checkpoints in {doc['root']} ({checks})", ""]
    if doc["checkpoints"]:
        rows = [
            [e["name"], "-" if e["global_step"] is None else str(e["global_step"]), "-" if e["epoch"] is None else str(e["epoch"]),
             e["saved_at"] or "-", human_size(e["size_bytes"]), e["state"], ",".join(e["pointers"]) or "-", _format_metric(e["val_metric"])]
            for e in doc["checkpoints"]
        ]
        lines += _table(["NAME", "STEP", "EPOCH", "SAVED (UTC)", "SIZE", "STATE", "POINTERS", "VAL METRIC"], rows, right={1, 2, 4})
        problems = []
        for e in doc["checkpoints"]:
            if e["marked_bad"] is not None:
                problems.append(f"  {e['name']}: marked bad: {e['marked_bad']}")
            if e["problem"]:
                problems.append(f"  {e['name']}: {e['problem']}")
        if problems:
            lines += ["", "Problems:", *problems]
    else:
        lines.append("(no checkpoints)")
    if doc["pointers"]:
        width = max(len(n) for n in doc["pointers"])
        lines += ["", "Pointers:"]
        for name, p in doc["pointers"].items():
            target = p["target"] or "?"
            lines.append(f"  {name.ljust(width)} -> {target} ({p['form']})" + (f": {p['error']}" if p["error"] else ""))
    resume = doc["resume"]
    lines += ["", f"Resume would pick: {resume['checkpoint'] or 'fresh start'}", f"  why: {resume['reason']}"]
    return "\n".join(lines)


def add_status_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare ``CHECKPOINT_DIR``, ``--deep``, ``--json``."""
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="the checkpoint root (checkpoint.checkpoint_dir)")
    parser.add_argument("--deep", action="store_true", help="also compare every file's sha256 (reads every byte)")
    parser.add_argument("--json", action="store_true", help="print a JSON document instead of the table")
    return parser


def run_status(args: argparse.Namespace) -> int:
    """Print the status of ``args.checkpoint_dir``; 0, or 2 when it is not a directory."""
    try:
        root = _existing_dir(args.checkpoint_dir, "CHECKPOINT_DIR")
    except UsageError as exc:
        print(f"resilience status: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    doc = inspect_root(root, deep=args.deep)
    if args.json:
        _print_json(doc)
    else:
        _emit(format_status(doc))
    return int(ExitCode.DONE)


# -- verify -------------------------------------------------------------------------------------


def _targets(path: Path) -> tuple[list[Path], list[str]]:
    """(checkpoint directories to verify, names of unpublished leftovers skipped)."""
    from resilience.checkpoint.layout import MANIFEST, STAGING_PREFIX, TRASH_PREFIX, list_checkpoints, parse_checkpoint_name

    if (path / MANIFEST).exists() or parse_checkpoint_name(path.name) or path.name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
        return [path], []
    found = list_checkpoints(path)
    if not found:
        raise UsageError(
            f"PATH {str(path)!r}: neither a checkpoint directory (no manifest.json) nor a checkpoint root "
            "(no epoch_<E>_step_<S> directories in it)"
        )
    leftovers = sorted(c.name for c in path.iterdir() if c.is_dir() and c.name.startswith((STAGING_PREFIX, TRASH_PREFIX)))
    return found, leftovers


def _hash(path: Path, advance: Callable[[int], object]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            advance(len(chunk))
    return digest.hexdigest()


def _entry_ok(rel: Any, want: Any) -> bool:
    return (
        isinstance(rel, str) and rel and not os.path.isabs(rel) and ".." not in Path(rel).parts
        and isinstance(want, dict) and isinstance(want.get("size"), int) and isinstance(want.get("sha256"), str)
    )


def verify_checkpoint(directory: Path, manifest: dict[str, Any] | None, error: str | None, advance: Callable[[int], object]) -> dict[str, Any]:
    """Check every file ``manifest`` lists under ``directory``; every failure is reported.

    ``error`` is why the manifest could not be read (then ``manifest`` is None). ``advance(n)`` is
    called with the bytes read or skipped, for a progress bar. Returns ``{"name", "ok",
    "files_checked", "bytes_checked", "failures": [{"file", "problem"}], "marked_bad"}``.
    """
    from resilience.checkpoint.layout import BAD_MARKER

    result: dict[str, Any] = {"name": directory.name, "ok": True, "files_checked": 0, "bytes_checked": 0, "failures": [],
                              "marked_bad": _first_line(directory / BAD_MARKER) if (directory / BAD_MARKER).exists() else None}
    failures = result["failures"]
    if manifest is None:
        failures.append({"file": "manifest.json", "problem": error or "unreadable"})
    else:
        for rel, want in sorted(manifest["files"].items()):
            if not _entry_ok(rel, want):
                failures.append({"file": str(rel), "problem": "malformed manifest entry (needs a relative path, an integer size and a sha256)"})
                continue
            path = directory / rel
            result["files_checked"] += 1
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                failures.append({"file": rel, "problem": "missing"})
                advance(want["size"])
                continue
            except OSError as exc:
                failures.append({"file": rel, "problem": f"unreadable ({exc.strerror})"})
                advance(want["size"])
                continue
            if size != want["size"]:
                failures.append({"file": rel, "problem": f"{size} bytes, manifest says {want['size']} (truncated?)"})
                advance(want["size"])
                continue
            try:
                digest = _hash(path, advance)
            except OSError as exc:
                failures.append({"file": rel, "problem": f"unreadable ({exc.strerror})"})
                continue
            result["bytes_checked"] += size
            if digest != want["sha256"]:
                failures.append({"file": rel, "problem": "checksum mismatch (corrupted bytes)"})
    result["ok"] = not failures
    return result


def verify_path(path: Path, *, progress: bool = True) -> dict[str, Any]:
    """The ``verify`` document for ``path`` (a checkpoint directory or a root of them).

    A tqdm bar over the bytes to hash goes to stderr when ``progress``. Raises
    :class:`UsageError` when ``path`` is neither a checkpoint directory nor a root holding one.
    """
    from tqdm import tqdm

    from resilience.checkpoint.layout import MANIFEST
    from resilience.checkpoint.manifest import CheckpointInvalid, read_manifest

    directories, leftovers = _targets(path)
    manifests: list[tuple[Path, dict[str, Any] | None, str | None]] = []
    for directory in directories:
        try:
            manifests.append((directory, read_manifest(directory), None))
        except CheckpointInvalid as exc:
            error = "missing (an incomplete save)" if not (directory / MANIFEST).exists() else _within(str(exc), directory)
            manifests.append((directory, None, error))
    total = sum(w.get("size", 0) for _, m, _ in manifests if m for w in m["files"].values() if isinstance(w, dict) and isinstance(w.get("size"), int))
    results = []
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, disable=not progress, leave=False) as bar:
        for directory, manifest, error in manifests:
            bar.set_description(directory.name)
            results.append(verify_checkpoint(directory, manifest, error, bar.update))
    return {"version": JSON_VERSION, "path": str(path), "ok": all(r["ok"] for r in results), "checkpoints": results, "skipped": leftovers}


def format_verify(doc: dict[str, Any]) -> str:
    """The terminal form of a :func:`verify_path` document."""
    lines = []
    for r in doc["checkpoints"]:
        note = f" (marked bad: {r['marked_bad']})" if r["marked_bad"] is not None else ""
        if r["ok"]:
            lines.append(f"{r['name']}: ok, {r['files_checked']} files{note}")
        else:
            count = f", {len(r['failures'])} of {r['files_checked']} files" if r["files_checked"] else ""
            lines.append(f"{r['name']}: FAILED{count}{note}")
            lines += [f"  {f['file']}: {f['problem']}" for f in r["failures"]]
    for name in doc["skipped"]:
        lines.append(f"{name}: skipped (not published)")
    failed = sum(not r["ok"] for r in doc["checkpoints"])
    total = len(doc["checkpoints"])
    lines.append(f"{total} checkpoint{'s' if total != 1 else ''} verified: {total - failed} ok, {failed} failed")
    return "\n".join(lines)


def add_verify_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare ``PATH``, ``--json``, ``--no-progress``."""
    parser.add_argument("path", metavar="PATH", help="a checkpoint directory, or a checkpoint root (then every checkpoint in it)")
    parser.add_argument("--json", action="store_true", help="print a JSON document instead of text")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def run_verify(args: argparse.Namespace) -> int:
    """Verify ``args.path``: 0 when every checksum matches, 1 on any failure, 2 on bad arguments."""
    try:
        path = _existing_dir(args.path, "PATH")
        doc = verify_path(path, progress=not args.no_progress)
    except UsageError as exc:
        print(f"resilience verify: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    if args.json:
        _print_json(doc)
    else:
        _emit(format_verify(doc))
    return int(ExitCode.DONE if doc["ok"] else ExitCode.FAILED)


# -- advise -------------------------------------------------------------------------------------


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def _recorded_timings(root: Path) -> list[dict[str, Any]]:
    """``{"name", "saved_at", "step_s", "save_s"}`` of every readable manifest under ``root``
    (or of ``root`` itself when it is a checkpoint), newest first."""
    from resilience.checkpoint.layout import MANIFEST, list_checkpoints
    from resilience.checkpoint.manifest import CheckpointInvalid, read_manifest

    directories = [root] if (root / MANIFEST).exists() else list_checkpoints(root)
    rows = []
    for order, directory in enumerate(directories):
        try:
            meta = read_manifest(directory).get("meta") or {}
        except CheckpointInvalid:
            continue
        timings = meta.get("timings") if isinstance(meta.get("timings"), dict) else {}
        rows.append({"name": directory.name, "saved_at": _number(meta.get("saved_at")), "order": order,
                     "step_s": _number(timings.get("step_s")), "save_s": _number(timings.get("save_s"))})
    rows.sort(key=lambda r: (r["saved_at"] is None, -(r["saved_at"] or 0), r["order"]))
    return rows


def advise(root: Path, *, safety: float = 1.5, agreement_every_steps: int = 1, median: bool = False) -> dict[str, Any]:
    """The recommended Slurm lead time from the timings recorded under ``root``.

    Uses the newest checkpoint (by ``saved_at``) that recorded both ``step_s`` and ``save_s``
    (else the newest with ``step_s``, counting a save as one step, as
    :func:`resilience.timing.must_stop` does), or with ``median`` the medians over all
    checkpoints. ``lead_s = ceil(seconds_needed + 30)``: Slurm checks signal times every 30 s.

    Raises:
        LookupError: no manifest under ``root`` recorded a step time.
    """
    from resilience.timing import seconds_needed

    rows = _recorded_timings(root)
    with_step = [r for r in rows if r["step_s"] is not None]
    if not with_step:
        raise LookupError(
            f"no step times recorded in the manifests under {root} ({len(rows)} readable): timings are recorded by "
            "resilient_loop from the second step on; run training a little longer, or choose --signal=...@N by hand"
        )
    notes = []
    if median:
        step_s = statistics.median(r["step_s"] for r in with_step)
        saves = [r["save_s"] for r in rows if r["save_s"] is not None]
        save_s = statistics.median(saves) if saves else None
        source = f"median over {len(with_step)} checkpoint{'s' if len(with_step) != 1 else ''}"
    else:
        both = [r for r in with_step if r["save_s"] is not None]
        row = both[0] if both else with_step[0]
        step_s, save_s = row["step_s"], row["save_s"]
        source = row["name"]
    if save_s is None:
        save_s = step_s
        notes.append("no save time recorded yet: a save is counted as one step (as the loop's deadline rule does)")
    needed = seconds_needed(step_s, save_s, agreement_every_steps=agreement_every_steps, safety=safety)
    lead_s = math.ceil(needed + SLURM_SIGNAL_INTERVAL_S)
    return {"version": JSON_VERSION, "root": str(root), "source": source, "step_s": step_s, "save_s": save_s,
            "safety": safety, "agreement_every_steps": agreement_every_steps, "seconds_needed": needed,
            "slurm_signal_interval_s": SLURM_SIGNAL_INTERVAL_S, "lead_s": lead_s,
            "sbatch": f"#SBATCH --signal=B:USR1@{lead_s}", "notes": notes}


def format_advice(doc: dict[str, Any]) -> str:
    """The terminal form of an :func:`advise` document, with the arithmetic."""
    k = doc["agreement_every_steps"]
    steps = 2 * k - 1
    return "\n".join([
        f"Timings from {doc['source']}: step {doc['step_s']:.3f} s, save {doc['save_s']:.3f} s",
        *[f"  note: {n}" for n in doc["notes"]],
        "A stop needs (steps the agreement may still run + one save) x safety:",
        f"  ((2 x {k} - 1) x {doc['step_s']:.3f} s + {doc['save_s']:.3f} s) x {doc['safety']:g}"
        f" = ({steps} x {doc['step_s']:.3f} + {doc['save_s']:.3f}) x {doc['safety']:g} = {doc['seconds_needed']:.3f} s",
        f"Slurm checks signal times every {doc['slurm_signal_interval_s']} s, so the signal comes between N and "
        f"N + {doc['slurm_signal_interval_s']} s before the end:",
        f"  N = ceil({doc['seconds_needed']:.3f} + {doc['slurm_signal_interval_s']}) = {doc['lead_s']}",
        "",
        doc["sbatch"],
        f"(in the training YAML: slurm.signal_lead_s: {doc['lead_s']})",
    ])


def add_advise_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare ``CHECKPOINT_DIR``, ``--safety``, ``--agreement-every-steps``, ``--median``, ``--json``."""
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="the checkpoint root (or one checkpoint directory)")
    parser.add_argument("--safety", default="1.5", help="factor on step + save time (default 1.5, as step_scheduler.deadline_safety)")
    parser.add_argument("--agreement-every-steps", default="1", help="the stop agreement's cadence k in steps (step_scheduler.agreement_every_steps, default 1): a stop may run 2k - 1 more steps")
    parser.add_argument("--median", action="store_true", help="the median over all checkpoints instead of the newest timings")
    parser.add_argument("--json", action="store_true", help="print a JSON document instead of text")
    return parser


def _parse_advise(args: argparse.Namespace) -> tuple[Path, float, int]:
    try:
        safety = float(args.safety)
    except ValueError:
        safety = float("nan")
    if not math.isfinite(safety) or safety <= 0:
        raise UsageError(f"--safety: expected a number > 0, e.g. 1.5, got {args.safety!r}")
    try:
        every = int(args.agreement_every_steps)
    except ValueError:
        every = 0
    if every < 1:
        raise UsageError(f"--agreement-every-steps: expected an integer >= 1, got {args.agreement_every_steps!r}")
    return _existing_dir(args.checkpoint_dir, "CHECKPOINT_DIR"), safety, every


def run_advise(args: argparse.Namespace) -> int:
    """Print the recommended lead time; 1 when no timings are recorded, 2 on bad arguments."""
    try:
        root, safety, every = _parse_advise(args)
    except UsageError as exc:
        print(f"resilience advise: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    try:
        doc = advise(root, safety=safety, agreement_every_steps=every, median=args.median)
    except LookupError as exc:
        print(f"resilience advise: {exc}", file=sys.stderr)
        return int(ExitCode.FAILED)
    if args.json:
        _print_json(doc)
    else:
        _emit(format_advice(doc))
    return int(ExitCode.DONE)
