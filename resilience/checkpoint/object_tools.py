"""Copying a checkpoint between object storage and a local directory, for the command-line tools
(``resilience consolidate`` on a bucket) and the tests: :func:`download` lays a committed
checkpoint out locally as on a filesystem; :func:`upload_bundle` puts a bundle built there back
under the checkpoint's files, its ``bundle_manifest.json`` last (what ``verify`` checks it by)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from resilience.checkpoint.layout import BUNDLE_MANIFEST, MANIFEST
from resilience.checkpoint.object_save import transfer
from resilience.checkpoint.storage.manifest import all_files, data_dir, read_manifest
from resilience.checkpoint.storage.object_path import ObjectPath


def download(checkpoint: ObjectPath, dest: Path, keep: Callable[[str], bool] = lambda rel: True) -> Path:
    """Copy the committed ``checkpoint``'s manifest and its files that ``keep(rel)`` selects (every
    rank's own among them) into ``dest/<name>/``; returns that directory. Raises
    ``CheckpointInvalid`` (no manifest), ``StoreError``."""
    doc = read_manifest(checkpoint)
    files_at = data_dir(checkpoint, doc)
    target = dest / checkpoint.name
    target.mkdir(parents=True, exist_ok=True)
    (target / MANIFEST).write_bytes((checkpoint / MANIFEST).read_bytes())
    rels = sorted(rel for rel in all_files(files_at, doc, skip_bad=True) if keep(rel))
    for rel in rels:
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
    transfer(rels, lambda rel: checkpoint.store.get_file(f"{files_at.rel}/{rel}", target / rel))
    return target


def upload_bundle(local: Path, checkpoint: ObjectPath, subdir: str) -> int:
    """Upload every file under ``local`` to ``subdir/`` of ``checkpoint``'s files, ``bundle_manifest.json``
    last; returns how many. Raises ``StoreError``."""
    files_at = data_dir(checkpoint, read_manifest(checkpoint))
    rels = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    last = [rel for rel in rels if rel == BUNDLE_MANIFEST]
    transfer([rel for rel in rels if rel not in last], lambda rel: checkpoint.store.put_file(f"{files_at.rel}/{subdir}/{rel}", local / rel))
    for rel in last:
        checkpoint.store.put_file(f"{files_at.rel}/{subdir}/{rel}", local / rel)
    return len(rels)
