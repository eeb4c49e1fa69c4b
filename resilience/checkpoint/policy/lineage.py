"""Timelines: which checkpoint each checkpoint continues, and what a run does when it meets
another timeline's checkpoint.

Every manifest's meta records ``checkpoint_id`` (a fresh id per save) and ``parent``: the
``{"name", "checkpoint_id"}`` of the checkpoint the saving process continued from (the one it
resumed from, then its own previous save), or null for a run that started at step 0 (or from
another root's weights). Following ``parent`` from a checkpoint gives its lineage, newest first.

A run resumed from an older checkpoint (``LATEST`` rolled back, ``restore_from``) starts a new
timeline next to the abandoned one. When it reaches a step whose directory holds a checkpoint of
another timeline, that directory is moved aside to ``<name>.abandoned-<UTC time>`` (never
deleted, never followed by a reader, never removed by retention) with a warning naming it;
only a re-save of the very checkpoint being continued replaces it in place. Retention keeps the
newest checkpoints of the lineage being trained first (:mod:`resilience.checkpoint.policy.retention`),
and a start without ``LATEST`` picks the most recently saved checkpoint, not the highest step
(:mod:`resilience.checkpoint.reader`). Checkpoints written before this metadata existed have no
parent: their lineage is themselves alone, and they load as before.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from resilience.checkpoint.layout import ABANDONED_INFIX, parse_checkpoint_name
from resilience.checkpoint.storage.durable import fsync_dir
from resilience.checkpoint.storage.manifest import CheckpointInvalid, read_manifest
from resilience.checkpoint.storage.object_path import Location


def meta_of(directory: Location) -> dict[str, Any]:
    """The manifest meta of ``directory``; empty when it has no readable manifest."""
    try:
        meta = read_manifest(directory).get("meta")
    except CheckpointInvalid:
        return {}
    return meta if isinstance(meta, dict) else {}


def parent_ref(directory: Location, meta: dict[str, Any], root: Location) -> dict[str, Any]:
    """The ``parent`` entry naming ``directory`` (its ``meta``), for checkpoints saved under ``root``.
    A checkpoint outside ``root`` (``load_path``, an absolute ``restore_from``) is named by id only."""
    inside = directory.parent.absolute() == root.absolute()
    return {"name": directory.name if inside else None, "checkpoint_id": meta.get("checkpoint_id")}


def is_checkpoint_named(directory: Location, ref: Any) -> bool:
    """True when ``ref`` (a ``parent`` entry) names ``directory``: same name, and the same
    ``checkpoint_id`` when the entry has one (the name may now hold another timeline's checkpoint)."""
    if not isinstance(ref, dict) or not ref.get("name") or ref["name"] != directory.name:
        return False
    return ref.get("checkpoint_id") is None or meta_of(directory).get("checkpoint_id") == ref["checkpoint_id"]


def lineage(root: Location, head: Location) -> list[Location]:
    """``head`` and its ancestors present under ``root``, newest first; the chain stops at a parent
    that is missing, outside ``root``, or replaced by another timeline's checkpoint."""
    chain, names = [head], {head.name}
    meta = meta_of(head)
    while True:
        ref = meta.get("parent")
        if not isinstance(ref, dict) or not ref.get("name") or ref["name"] in names:
            return chain
        path = root / ref["name"]
        if parse_checkpoint_name(path.name) is None or path.is_symlink() or not path.is_dir() or not is_checkpoint_named(path, ref):
            return chain
        chain.append(path)
        names.add(path.name)
        meta = meta_of(path)


def descends_from(root: Location, head: Location, ancestor: Location) -> bool:
    """True when checkpoint ``head`` (under ``root``) is ``ancestor`` or continues it: its
    ``checkpoint_id`` is that of ``head`` or of one of its ancestors under ``root``, or the parent
    the oldest of them names (a checkpoint outside ``root``, named by id only)."""
    wanted = meta_of(ancestor).get("checkpoint_id")
    if not wanted:
        return False
    chain = lineage(root, head)
    ids = {meta_of(path).get("checkpoint_id") for path in chain}
    oldest_parent = meta_of(chain[-1]).get("parent")
    if isinstance(oldest_parent, dict):
        ids.add(oldest_parent.get("checkpoint_id"))
    return wanted in ids


def set_aside(root: Path, directory: Path) -> Path:
    """Rename ``directory`` to ``<name>.abandoned-<UTC time>[-N]`` under ``root`` (durably); returns the new path."""
    base = f"{directory.name}{ABANDONED_INFIX}{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    target, n = root / base, 1
    while target.exists() or target.is_symlink():
        n += 1
        target = root / f"{base}-{n}"
    os.rename(directory, target)
    fsync_dir(root)
    return target


def describe(directory: Path) -> str:
    """``run <id>, saved <UTC time>`` from the manifest, for messages."""
    meta = meta_of(directory)
    saved = meta.get("saved_at")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(saved)) if isinstance(saved, (int, float)) else "unknown time"
    return f"run {meta.get('run_id') or 'unknown'}, saved {when}"
