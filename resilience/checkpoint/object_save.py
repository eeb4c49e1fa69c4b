"""Saving a checkpoint to object storage (``s3://``, ``msc://``): atomic without a rename.

The formats write real files, as on a filesystem, into a local staging directory of each rank's
own (``checkpoint.local_dir``/``rank_<r>/``): fsync'd and digested while written, rank manifests
included. Then, in :func:`~resilience.checkpoint.writer.write_checkpoint` and :func:`publish`:

1. every rank uploads its files (:meth:`Sink.send`; multipart for large ones, a failed one
   aborted) under the save's own prefix ``<name>/<checkpoint id>/``, never over an object a
   committed manifest describes: a re-save of a step leaves the previous checkpoint whole until
   the new one is committed; one verdict, so a failure anywhere is a ``CheckpointSaveError`` on
   every rank;
2. rank 0 uploads ``<name>/manifest.json`` (sizes, digests, and the prefix of the files): the
   **commit point**, one PUT, atomic. A prefix without its manifest is no checkpoint to any
   reader (resume, ``status``, ``verify``); what a failed or killed save left is removed at the
   next start (:mod:`resilience.checkpoint.policy.orphans`);
3. then ``LATEST``, with a conditional PUT (:meth:`~resilience.checkpoint.storage.object_store.ObjectStore.write_pointer`).

A checkpoint another timeline holds at the same name is kept as ``<name>.abandoned-<time>``
(its manifest copied there, naming its files where they are); the previous files of a re-save are
deleted after the commit, in the background (:mod:`resilience.checkpoint.policy.pruning`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import getpass
import json
import logging
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from resilience.checkpoint.layout import ABANDONED_INFIX, BAD_MARKER, LATEST, MANIFEST, STAGING_PREFIX
from resilience.checkpoint.policy.lineage import is_checkpoint_named
from resilience.checkpoint.storage.durable import FileRecord
from resilience.checkpoint.storage.manifest import OBJECTS, write_manifest
from resilience.checkpoint.storage.object_path import ObjectPath
from resilience.checkpoint.storage.pointers import write_pointer
from resilience.checkpoint.writer import Written, follow_with_lowest_val, phase, save_failures

log = logging.getLogger("resilience.checkpoint")

TRANSFER_THREADS = 8
"""Files one rank uploads or downloads at once (each large one in parts besides)."""
SAVE_ID = re.compile(r"^[0-9a-f]{32}$")
"""A save's prefix under its checkpoint's name: its ``checkpoint_id`` (a uuid4's hex)."""


def local_root(local_dir: str | None, root: ObjectPath) -> Path:
    """The local directory for ``root``'s staging, downloads and logs: ``checkpoint.local_dir``,
    else ``<tmp>/resilience-<user>/<bucket>/<prefix>``."""
    if local_dir is not None:
        return Path(local_dir).absolute()
    store = root.store
    return Path(tempfile.gettempdir()) / f"resilience-{getpass.getuser()}" / store.scheme / store.bucket / (store.prefix or "_")


def transfer(jobs: list[Any], run: Any) -> None:
    """``run(job)`` for every job, :data:`TRANSFER_THREADS` at once; raises the first failure once all ended."""
    if len(jobs) <= 1:
        for job in jobs:
            run(job)
        return
    with concurrent.futures.ThreadPoolExecutor(min(TRANSFER_THREADS, len(jobs)), thread_name_prefix="resilience-transfer") as pool:
        for future in [pool.submit(run, job) for job in jobs]:
            future.result()


@dataclasses.dataclass
class Sink:
    """Where one save's files go: this rank's ``staging`` directory, then the store under
    ``data`` (``<name>/<checkpoint id>``, relative to ``root``)."""

    root: ObjectPath
    name: str
    data: str
    staging: Path

    @classmethod
    def for_save(cls, root: ObjectPath, local: Path, name: str, save_id: str, rank: int) -> Sink:
        """The sink of save ``save_id`` (rank 0's ``checkpoint_id``, the same on every rank) of checkpoint ``name``."""
        if not SAVE_ID.match(save_id):
            raise ValueError(f"checkpoint id {save_id!r} is not 32 hex digits")
        return cls(root, name, f"{name}/{save_id}", local / f"rank_{rank:05d}" / f"{STAGING_PREFIX}{name}")

    def send(self, records: list[FileRecord]) -> None:
        """Upload this rank's files ``records`` (paths relative to the staging directory). Raises ``StoreError``."""
        store = self.root.store
        transfer(records, lambda rec: store.put_file(f"{self.data}/{rec.path}", self.staging / rec.path))

    def fetch(self, directory: str) -> None:
        """Download the files under ``directory`` (of the checkpoint) that other ranks uploaded and
        this rank's staging lacks. Raises ``StoreError``."""
        store = self.root.store
        objects, _ = store.list(f"{self.data}/{directory}")
        missing = [o.rel[len(self.data) + 1 :] for o in objects if not (self.staging / o.rel[len(self.data) + 1 :]).exists()]
        for rel in missing:
            (self.staging / rel).parent.mkdir(parents=True, exist_ok=True)
        transfer(missing, lambda rel: store.get_file(f"{self.data}/{rel}", self.staging / rel))

    def discard(self) -> None:
        """Remove the local staging directory (its files are in the store, or the save failed)."""
        shutil.rmtree(self.staging, ignore_errors=True)


def publish(root: ObjectPath, name: str, written: Written, meta: dict[str, Any], sink: Sink) -> str | None:
    """Rank 0, once every rank's files are uploaded: set aside another timeline's checkpoint of
    this name, commit the manifest, then move ``LATEST``. Returns the prefix of the files of the
    checkpoint this one replaced (a re-save of the same step: delete them now), or ``None``.

    Raises what failed; before the commit this save's uploaded files are deleted first (best
    effort: what is left is an orphan, removed at the next start) and ``LATEST`` is unchanged.
    """
    store = root.store
    committed = False
    try:
        phase("manifest")
        write_manifest(sink.staging, written.listed, meta, written.rank_manifests, objects=sink.data)
        superseded = _make_room(root, name, meta.get("parent"))
        store.put_file(f"{name}/{MANIFEST}", sink.staging / MANIFEST)  # the commit point
        committed = True
        phase("pointer")
        write_pointer(root, LATEST, root / name)
    except save_failures():
        if not committed:
            try:
                store.delete_prefix(sink.data)
            except save_failures() as exc:  # noqa: BLE001 - the save's own failure is what is raised
                log.warning("could not delete the files of the failed save %s (%s); they are removed at the next start", sink.data, exc)
        raise
    return superseded if superseded != sink.data else None


def _make_room(root: ObjectPath, name: str, parent: Any) -> str | None:
    """Before committing ``name``: a checkpoint already there that this save continues (a re-save)
    is replaced, its files' prefix returned; another timeline's is kept as ``<name>.abandoned-<time>``
    (``LOWEST_VAL`` follows it); a stale ``.bad`` marker goes (it was the replaced checkpoint's)."""
    store = root.store
    try:
        old = store.get_bytes(f"{name}/{MANIFEST}")
    except FileNotFoundError:
        store.delete([f"{name}/{BAD_MARKER}"])
        return None
    try:
        doc = json.loads(old)
        files_at = doc.get(OBJECTS) or name
    except (ValueError, AttributeError):
        doc, files_at = None, name
    existing = root / name
    if doc is not None and is_checkpoint_named(existing, parent):
        store.delete([f"{name}/{BAD_MARKER}"])
        return files_at if files_at != name else None
    marked_bad = store.head(f"{name}/{BAD_MARKER}") is not None
    aside = _abandoned_name(root, name)
    if doc is not None:
        old = json.dumps({**doc, OBJECTS: files_at}, indent=1, sort_keys=True).encode()
    store.put_bytes(f"{aside}/{MANIFEST}", old)
    log.warning(
        "%s already held %s, not the one this run continues: kept as %s (delete it when it is not needed)",
        name,
        "a checkpoint marked bad" if marked_bad else "a checkpoint of another timeline",
        aside,
    )
    follow_with_lowest_val(root, existing, root / aside)
    store.delete([f"{name}/{BAD_MARKER}"])
    return None


def _abandoned_name(root: ObjectPath, name: str) -> str:
    base = f"{name}{ABANDONED_INFIX}{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    target, n = base, 1
    while root.store.head(f"{target}/{MANIFEST}") is not None:
        n += 1
        target = f"{base}-{n}"
    return target
