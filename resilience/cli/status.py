"""``resilience status DIR``: a read-only table of the checkpoints under a checkpoint root.

It tabulates every checkpoint (published, incomplete, corrupt, marked bad, abandoned), the pointers
(``LATEST``, ``LOWEST_VAL``, any other top-level symlink or ``NAME.txt`` pointer), and which
checkpoint a resume would pick and why, with the loader's own chooser
(:func:`~resilience.checkpoint.resume_choice.choose`). It never writes: the loader marks the
invalid checkpoints it skips ``.bad``; status only reports them.

Only the standard library is imported at import time, so registering the command in
:mod:`resilience.cli` costs ``resilience run`` nothing; the checkpoint modules are imported
inside the functions.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from resilience.checkpoint.layout import LATEST, LOWEST_VAL, MANIFEST, POINTER_SUFFIX, pointer_text_name
from resilience.cli.output import JSON_VERSION, UsageError, add_json_flag, existing_dir, first_line, print_doc, read_side, saved_section, usage_failed, within
from resilience.cli.status_text import format_status
from resilience.exit_codes import ExitCode

if TYPE_CHECKING:  # annotations only: status on a local root loads no store client
    from resilience.checkpoint.storage.object_path import Location, ObjectPath

HELP = (
    "a table of the checkpoints under CHECKPOINT_DIR (complete, incomplete, corrupt, marked bad; pointers; metric) "
    "and which one a resume would pick and why; never writes"
)

_POINTER_ORDER = (LATEST, LOWEST_VAL)


def iso_utc(timestamp: Any) -> str | None:
    """Unix time (seconds) as ``2024-05-01T12:00:00Z``; ``None`` when not a finite number."""
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or not math.isfinite(timestamp):
        return None
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _tree_size(path: Path) -> int:
    """Bytes of every regular file under ``path`` (symlinks not followed); on object storage the
    objects under the checkpoint's name and under the prefix of its files."""
    if _is_object(path):
        prefixes = {path.rel, _files_at(path).rel}
        return sum(o.size for prefix in prefixes for o in path.store.list(prefix)[0] if prefix == path.rel or not o.rel.startswith(path.rel + "/"))
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass  # removed while we walk (retention on a live run)
    return total


def _is_object(path: object) -> TypeGuard[ObjectPath]:
    return type(path).__name__ == "ObjectPath"  # no import: status on a local root loads no store client


def _files_at(checkpoint: Any) -> Any:
    """Where a checkpoint's files lie (on object storage, the prefix its manifest names), else itself."""
    from resilience.checkpoint.storage.manifest import CheckpointInvalid, data_dir, read_manifest

    try:
        return data_dir(checkpoint, read_manifest(checkpoint))
    except (CheckpointInvalid, OSError):
        return checkpoint


def _relative(message: str, root: Path) -> str:
    """``message`` with ``root/`` stripped from the paths in it (shorter, and stable across roots).
    Only absolute forms of ``root`` are stripped: a relative one (``ck``) would also match
    inside an absolute path (``/x/ck/...``) and cut it wrongly."""
    for form in {str(root.resolve()), str(root.absolute())}:
        message = message.replace(form + os.sep, "")
    return message


def _check(path: Path, deep: bool) -> tuple[str, str | None, dict[str, Any]]:
    """``(state, problem, meta)`` of a published-looking directory; state is ``complete``,
    ``incomplete`` (no manifest) or ``corrupt``; ``.bad`` is not looked at here."""
    from resilience.checkpoint.layout import MANIFEST
    from resilience.checkpoint.storage.manifest import CheckpointInvalid, read_manifest, validate

    if not path.is_dir():
        return "missing", "no such directory", {}
    if not (path / MANIFEST).exists():
        return "incomplete", f"no {MANIFEST} (an interrupted or partial save)", {}
    meta: dict[str, Any] = {}
    try:
        meta = read_manifest(path).get("meta") or {}
        validate(path, checksums=deep, resume=True)  # as the resume checks it: the bundle is not needed
    except CheckpointInvalid as exc:
        return "corrupt", within(str(exc), path), meta if isinstance(meta, dict) else {}
    return "complete", None, meta if isinstance(meta, dict) else {}


def _model_info(path: Path) -> dict[str, Any]:
    """What ``path/model/`` holds, from its file names: ``model_format`` (``safetensors``,
    ``torch_save`` or None), ``model_weights`` (``full``, ``adapters`` for a PEFT model, or None)
    and ``hf_bundle`` (True when ``model/consolidated/`` has a Hugging Face index). A checkpoint a
    trainer wrote in its own layout (a Hugging Face ``Trainer``'s: ``model.safetensors`` or its
    index at the top) is itself a Hugging Face directory: ``safetensors full``, ``hf_bundle`` True."""
    from resilience.checkpoint.layout import (
        ADAPTER_WEIGHTS,
        CONSOLIDATED,
        DCP_METADATA,
        DCP_SUFFIX,
        HF_INDEX,
        HF_SINGLE_FILE,
        MODEL_DIR,
        SAFETENSORS_SUFFIX,
        SHARD_INDEX,
    )

    path = _files_at(path) if _is_object(path) else path
    if not (path / MODEL_DIR).is_dir() and any((path / name).is_file() for name in (HF_SINGLE_FILE, HF_INDEX, ADAPTER_WEIGHTS)):
        return {"model_format": "safetensors", "model_weights": "adapters" if (path / ADAPTER_WEIGHTS).is_file() else "full", "hf_bundle": True}
    model = path / MODEL_DIR
    try:
        names = {child.name for child in model.iterdir()} if _is_object(model) else set(os.listdir(model))
    except OSError:
        names = set()
    fmt: str | None = None
    weights: str | None = None
    if ADAPTER_WEIGHTS in names:
        fmt, weights = "safetensors", "adapters"
    elif SHARD_INDEX in names or any(n.endswith(SAFETENSORS_SUFFIX) for n in names):
        fmt, weights = "safetensors", "full"
    elif DCP_METADATA in names or any(n.endswith(DCP_SUFFIX) for n in names):
        fmt, weights = "torch_save", "full"  # DCP files
    return {"model_format": fmt, "model_weights": weights, "hf_bundle": (model / CONSOLIDATED / HF_INDEX).is_file()}


def _pointer_names(root: Path) -> list[str]:
    """``LATEST``, ``LOWEST_VAL`` and every other top-level pointer: a symlink to a bare name, or a
    ``NAME.txt`` holding a checkpoint name (or the name of a directory under ``root``)."""
    from resilience.checkpoint.layout import parse_checkpoint_name

    names = set()
    for child in root.iterdir():
        name = child.name
        if name.startswith(".") or parse_checkpoint_name(name):
            continue  # .NAME.tmp.PID: a pointer swap in progress
        if _is_object(root):  # a pointer is a small object: LATEST, LOWEST_VAL, or NAME.txt
            if child.is_file() and (name in _POINTER_ORDER or name.endswith(POINTER_SUFFIX)):
                names.add(name)
            continue
        if child.is_symlink():
            if name in _POINTER_ORDER or "/" not in os.readlink(child).strip("/"):
                names.add(name)
        elif name.endswith(POINTER_SUFFIX) and child.is_file() and len(name) > len(POINTER_SUFFIX):
            try:
                with open(child, "rb") as fh:
                    text = fh.read(4097).decode().strip()
            except (OSError, UnicodeDecodeError):
                continue
            if (
                text
                and len(text) <= 4096
                and not any(c.isspace() for c in text)
                and (name.removesuffix(POINTER_SUFFIX) in _POINTER_ORDER or parse_checkpoint_name(text) or (root / text).is_dir())
            ):
                names.add(name.removesuffix(POINTER_SUFFIX))
    order = {name: i for i, name in enumerate(_POINTER_ORDER)}
    return sorted(names, key=lambda n: (order.get(n, len(order)), n))


def _read_pointers(root: Path) -> dict[str, dict[str, Any]]:
    from resilience.checkpoint.storage.pointers import PointerError, read_pointer

    pointers = {}
    for name in _pointer_names(root):
        form = "object" if _is_object(root) else "symlink" if (root / name).is_symlink() else pointer_text_name(name)
        entry: dict[str, Any] = {"form": form, "target": None, "error": None}
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
    from resilience.checkpoint.layout import (
        ABANDONED_INFIX,
        BAD_MARKER,
        STAGING_PREFIX,
        TRASH_PREFIX,
        list_checkpoints,
        parse_checkpoint_name,
    )

    found: list[tuple[str, Path]] = [("checkpoint", path) for path in list_checkpoints(root)]
    for child in root.iterdir():
        if child.is_dir() and not child.is_symlink():
            if child.name.startswith(STAGING_PREFIX):
                found.append(("staging", child))
            elif child.name.startswith(TRASH_PREFIX):
                found.append(("trash", child))
            elif ABANDONED_INFIX in child.name and parse_checkpoint_name(child.name.split(ABANDONED_INFIX)[0]):
                found.append(("abandoned", child))
    entries = []
    for kind, path in found:
        prefix = {"checkpoint": "", "staging": STAGING_PREFIX, "trash": TRASH_PREFIX, "abandoned": ""}[kind]
        parsed = parse_checkpoint_name(path.name[len(prefix) :].split(ABANDONED_INFIX)[0])
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
            **_model_info(path),
            "run_id": None,
            "producer": None,
            "val_metric": None,
            "marked_bad": None,
            "pointers": [],
        }
        state: str
        problem: str | None
        meta: dict[str, Any]
        if kind == "staging":
            state, problem, meta = "incomplete", "a save in progress or interrupted (removed at the next start)", {}
        elif kind == "trash":
            state, problem, meta = "incomplete", "set aside while being replaced or deleted (restored or removed at the next start)", {}
        elif kind == "abandoned":
            _, problem, meta = _check(path, deep)
            state = "abandoned"
            why = "another timeline's checkpoint, moved aside after a rollback"
            if (path / BAD_MARKER).exists():
                why = "marked bad, moved aside when its step was saved again"
            problem = problem or f"{why} (never resumed or pruned; delete it when not needed)"
        else:
            state, problem, meta = _check(path, deep)
        if kind in ("checkpoint", "abandoned") and (path / BAD_MARKER).exists():
            entry["marked_bad"] = _relative(first_line(path / BAD_MARKER), root)
        entry["state"] = "marked bad" if entry["marked_bad"] is not None else state
        entry["checked_state"] = state
        entry["problem"] = _relative(problem, root) if problem else None
        entry["saved_at_unix"] = meta.get("saved_at") if iso_utc(meta.get("saved_at")) else None
        entry["saved_at"] = iso_utc(meta.get("saved_at"))
        for key in ("reason", "world_size", "run_id", "val_metric", "producer"):
            entry[key] = meta.get(key)
        entries.append(entry)
    kinds = {"checkpoint": 0, "abandoned": 1, "trash": 2, "staging": 3}
    entries.sort(key=lambda e: (e["global_step"] is None, -(e["global_step"] or 0), -(e["epoch"] or 0), kinds[e["kind"]], e["name"]))
    return entries


def _resume_choice(root: Path, entries: list[dict[str, Any]], deep: bool) -> dict[str, Any]:
    """What a resume would pick (without ``restore_from``): the loader's own chooser
    (:func:`resilience.checkpoint.resume_choice.choose`) over the states computed for the table,
    which writes nothing (no ``.bad`` markers)."""
    from resilience.checkpoint.resume_choice import choose
    from resilience.checkpoint.storage.manifest import CheckpointInvalid

    by_name = {e["name"]: e for e in entries if e["kind"] == "checkpoint"}

    def check(path: Location) -> dict[str, Any]:
        entry = by_name.get(path.name)
        state, problem = (entry["checked_state"], entry["problem"]) if entry else _check(read_side(path), deep)[:2]
        if state != "complete":
            raise CheckpointInvalid(f"{state}" + (f": {_relative(problem, root)}" if problem else ""))
        return {}

    choice = choose(root, check)
    skipped = [{"name": s.path.name, "why": "marked bad" if s.marked_bad else s.why} for s in choice.skipped]
    notes = [f"{LATEST} ignored ({choice.latest_problem})"] if choice.latest_problem else []
    if choice.latest is None and not choice.latest_problem:
        notes.append(f"no {LATEST} pointer")
    candidates, latest = choice.candidates, choice.latest
    chosen = choice.chosen.name if choice.chosen is not None else None

    sizes_only = "" if deep else "; sizes checked, checksums not (--deep checks them, as a resume does)"
    latest_name = latest.name if latest is not None else None
    skips = ", ".join(f"{s['name']} ({LATEST + ', ' if s['name'] == latest_name else ''}{s['why'].split(':')[0]})" for s in skipped)
    skips = f"skipped {skips}; " if skips else ""
    noted = "".join(f"{note}; " for note in notes)
    if chosen is None:
        reason = f"fresh start: {noted}{skips}no valid checkpoint left" if candidates else f"fresh start: {noted}no checkpoints under {root}"
    elif chosen == latest_name:
        reason = f"{LATEST} -> {chosen}, which is complete"
    elif latest_name is not None:
        reason = f"{skips}{chosen} is the newest older valid checkpoint"
    else:
        reason = f"{noted}{skips}{chosen} is the most recently saved valid checkpoint"
    if chosen is not None:
        reason += sizes_only
    return {"checkpoint": chosen, "fresh_start": chosen is None, "reason": reason, "skipped": skipped, "checksums_checked": deep}


def inspect_root(root: Path, *, deep: bool = False) -> dict[str, Any]:
    """The ``status`` document of checkpoint root ``root`` (an existing directory). Read-only.

    ``deep`` also compares digests (reads every byte); otherwise a checkpoint counts as
    complete when its manifest is readable and every listed file has the listed size.
    """
    pointers = _read_pointers(root)
    entries = _entries(root, deep)
    for name, pointer in pointers.items():
        for entry in entries:
            if entry["kind"] == "checkpoint" and entry["name"] == pointer["target"]:
                entry["pointers"].append(name)
    resume = _resume_choice(root, entries, deep)
    for entry in entries:
        entry.pop("checked_state")
    return {
        "version": JSON_VERSION,
        "root": str(root),
        "deep": deep,
        "checkpoints": entries,
        "pointers": pointers,
        "resume": resume,
        "restart_guard": _restart_guard(root, resume["checkpoint"]),
        "held_stop": _held_stop(root),
    }


def _held_stop(root: Path) -> dict[str, Any] | None:
    """The stop signal ``resilience run --checkpoint-dir`` last delivered after holding it for ranks
    that never got ready (:mod:`resilience.launch.held_stops`), with ``at_utc``; ``None``: none."""
    from resilience.launch.held_stops import read_record

    if _is_object(root):
        return None  # written by `resilience run --checkpoint-dir`, for local roots only
    record = read_record(root)
    return None if record is None else {**record, "at_utc": iso_utc(record["at"])}


def _restart_guard(root: Path, pick: str | None) -> dict[str, Any] | None:
    """The requeue-loop guard's counts (``.starts.json``, :mod:`resilience.checkpoint.policy.progress_guard`) and
    whether, and why, the next start from ``pick`` would exit 76; ``None`` when nothing is counted."""
    from resilience.checkpoint.layout import STARTS_FILE
    from resilience.checkpoint.policy.progress_guard import before_next_start, read, starts, verdict

    doc = read(root)
    if doc is None:
        return None
    saved = saved_section(_files_at(root / pick) if _is_object(root) else root / pick, "checkpoint") if pick is not None else {}
    limit = saved.get("max_restarts_without_progress", 3)  # the defaults when the checkpoint does not say
    preemption_limit = saved.get("max_preemptions_without_progress", 10)
    limit = limit if isinstance(limit, int) else None
    preemption_limit = preemption_limit if isinstance(preemption_limit, int) else None
    failed, preempted = before_next_start(doc, pick)
    why = verdict(failed, preempted, limit, preemption_limit)
    return {
        "file": str(root / STARTS_FILE),
        "resume_point": doc["resume_point"],
        "starts": starts(doc),
        "failed": doc["failed"],
        "preempted": doc["preempted"],
        "running": doc["running"],
        "refused": doc["refused"],
        "limit": limit,
        "preemption_limit": preemption_limit,
        "next_start_exits_no_progress": why is not None,
        "why": why,
    }


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare ``CHECKPOINT_DIR``, ``--deep``, ``--json``."""
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="the checkpoint root (checkpoint.checkpoint_dir)")
    parser.add_argument("--deep", action="store_true", help="also compare every file's digest (reads every byte)")
    add_json_flag(parser, instead_of="the table")
    return parser


def run(args: argparse.Namespace) -> int:
    """Print the status of ``args.checkpoint_dir``; 0, or 2 when it is not a directory or is one
    checkpoint (it holds ``manifest.json``) rather than the root that holds them."""
    try:
        root = read_side(existing_dir(args.checkpoint_dir, "CHECKPOINT_DIR"))
        if (root / MANIFEST).is_file():
            raise UsageError(
                f"{root} is one checkpoint, not a checkpoint root: run 'resilience status {root.parent}' for the table, "
                f"or 'resilience verify {root}' to check this checkpoint"
            )
    except UsageError as exc:
        return usage_failed("status", exc)
    doc = inspect_root(root, deep=args.deep)
    print_doc(doc, args.json, format_status)
    return int(ExitCode.DONE)
