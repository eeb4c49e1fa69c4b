"""Object storage: what a failed, killed or pruned save left, and removing it.

On a bucket a checkpoint is ``<name>/manifest.json`` (the commit point) and the files under the
prefix it names (``<name>/<checkpoint id>/``, :data:`~resilience.checkpoint.storage.manifest.OBJECTS`).
Anything else under a checkpoint's name is an *orphan*: a save killed or failed before its
manifest (``kill -9`` mid-upload), the files of a checkpoint a re-save replaced, or of one
retention removed. :func:`remove_orphans` deletes them at the start of a run (rank 0, before the
resume chooses, as the local ``.staging_*`` directories are removed); retention removes a
checkpoint by deleting its manifest first (:func:`uncommit`: it no longer exists for any reader)
and its files after, in the background (:func:`delete_files`).

Only what is certainly unreferenced goes: a prefix under a checkpoint-like name that no readable
manifest names, and that is a save id (32 hex digits); when any manifest cannot be read (the store
failed to answer, or its bytes are not a manifest), nothing is removed at that start.
"""

from __future__ import annotations

import json
import logging

from resilience.checkpoint.layout import ABANDONED_INFIX, MANIFEST, parse_checkpoint_name
from resilience.checkpoint.storage.manifest import OBJECTS
from resilience.checkpoint.storage.object_path import ObjectPath

log = logging.getLogger("resilience.checkpoint")

_SAVE_ID_LEN = 32


def _is_save_id(text: str) -> bool:
    return len(text) == _SAVE_ID_LEN and all(c in "0123456789abcdef" for c in text)


def _holds_checkpoints(name: str) -> bool:
    """A top-level prefix that may hold a manifest: ``epoch_<E>_step_<S>`` or one set aside from such a name."""
    return parse_checkpoint_name(name) is not None or parse_checkpoint_name(name.split(ABANDONED_INFIX)[0]) is not None


def referenced(root: ObjectPath, names: list[str]) -> dict[str, str] | None:
    """``{checkpoint name: prefix of its files}`` for every committed checkpoint among ``names``;
    ``None`` when a manifest exists but cannot be read (then nothing may be called an orphan)."""
    store = root.store
    out = {}
    for name in names:
        if not _holds_checkpoints(name):
            continue
        try:
            data = store.get_bytes(f"{name}/{MANIFEST}")
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("not removing orphaned objects under %s at this start: %s", root, exc)
            return None
        try:
            doc = json.loads(data)
            out[name] = str(doc.get(OBJECTS) or name).strip("/")
        except (ValueError, AttributeError):
            log.warning("not removing orphaned objects under %s at this start: %s/%s is not a manifest", root, name, MANIFEST)
            return None
    return out


def remove_orphans(root: ObjectPath) -> list[str]:
    """Delete what no committed checkpoint under ``root`` names (see the module docstring), and
    abort unfinished multipart uploads under it; returns the prefixes removed. Rank 0, at start.
    Raises ``StoreError`` when the store fails (the resume then fails too: nothing is chosen
    from a store that does not answer)."""
    store = root.store
    aborted = store.abort_uploads("")
    if aborted:
        log.info("aborted %d unfinished multipart uploads under %s", aborted, root)
    _, names = store.list("", recursive=False)
    committed = referenced(root, names)
    if committed is None:
        return []
    kept = set(committed.values())
    removed = []
    for name in names:
        if parse_checkpoint_name(name) is None:
            continue
        objects, subs = store.list(name, recursive=False)
        for sub in subs:
            prefix = f"{name}/{sub}"
            if _is_save_id(sub) and prefix not in kept:
                store.delete_prefix(prefix)
                removed.append(prefix)
        if name not in committed and objects and not any(k == name or k.startswith(name + "/") for k in kept):
            store.delete([o.rel for o in objects])  # a .bad marker of a checkpoint that is gone
            removed.append(f"{name}/")
    if removed:
        log.warning(
            "removed orphaned objects under %s (a save that never committed, or files of a replaced or pruned checkpoint): %s", root, ", ".join(removed)
        )
    return removed


def uncommit(root: ObjectPath, victims: list[ObjectPath]) -> dict[str, str]:
    """Retention, rank 0: delete each victim's manifest (from then on it is no checkpoint);
    returns ``{name: prefix of its files}`` for :func:`delete_files`. One that fails is logged
    and skipped (the next save's plan names it again)."""
    store = root.store
    out = {}
    for path in victims:
        try:
            doc = json.loads(store.get_bytes(f"{path.name}/{MANIFEST}"))
            store.delete([f"{path.name}/{MANIFEST}"])
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("retention: could not remove %s (%s); will retry at the next save", path.name, exc)
            continue
        out[path.name] = str(doc.get(OBJECTS) or path.name).strip("/")
        log.info("retention: removed %s", path.name)
    return out


def delete_files(root: ObjectPath, name: str, files_at: str) -> None:
    """Delete the files of checkpoint ``name`` (uncommitted, or replaced by a re-save) under
    ``files_at``, and the objects directly under ``name/`` (a ``.bad`` marker) unless a manifest is
    there again. Raises ``StoreError`` (retention's deleter logs it; the next start removes the rest)."""
    store = root.store
    objects, _ = store.list(name, recursive=False)
    recommitted = any(o.rel == f"{name}/{MANIFEST}" for o in objects)
    if files_at == name:  # a checkpoint laid out as on a filesystem (copied into the bucket)
        if not recommitted:
            store.delete_prefix(name)
        return
    store.delete_prefix(files_at)
    if not recommitted:
        store.delete([o.rel for o in objects])
