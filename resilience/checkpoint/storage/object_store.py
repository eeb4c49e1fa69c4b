"""The small object-store interface checkpoints on ``s3://`` and ``msc://`` are written through.

Six operations, all relative to the checkpoint root's prefix: put a local file (multipart when
large; a failed upload is aborted), put bytes (optionally conditional: ``If-Match`` /
``If-None-Match``), get a byte range, list a prefix, delete keys or a prefix, and stat a key.
Two implementations: :class:`~resilience.checkpoint.storage.s3_store.S3Store` (boto3) for
``s3://bucket/prefix`` and :class:`~resilience.checkpoint.storage.msc_store.MscStore`
(NVIDIA's multi-storage-client) for ``msc://profile/prefix``. Pointers (``LATEST``,
``LOWEST_VAL``) are small objects written here with a conditional PUT (:meth:`ObjectStore.write_pointer`).

Endpoint and credentials come only from where users already keep them: botocore's chain for
``s3://`` (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``,
``~/.aws/config``, ``~/.aws/credentials``), msc's own configuration for ``msc://``
(``MSC_CONFIG``, ``~/.msc_config.yaml``, ...). Retries of 5xx and throttling, with backoff and a
bound, are the clients' own (botocore's ``standard`` mode, ``AWS_MAX_ATTEMPTS``; msc's profile
``retry``); what still fails is a :class:`StoreError`. Why not fsspec/s3fs: see docs/storage.md.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import os
import re
import threading
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("resilience.checkpoint")

SCHEMES = ("s3", "msc")
"""The URL schemes with an object-store backend."""
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")


class StoreError(OSError):
    """A request to the object store failed after the client's retries; the message names the
    URL and the operation."""


class PreconditionFailed(StoreError):
    """A conditional write found another version than expected: another writer moved the pointer."""


class StoreUnavailable(ValueError):
    """The store cannot be used as configured (no credentials, no such bucket or profile, client
    not installed); the message says what was tried. The configuration turns it into a ``ConfigError``."""


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One object: ``rel`` its key relative to the store's root prefix, ``size`` in bytes, ``etag``
    the store's version tag (``None`` where the store has none)."""

    rel: str
    size: int
    etag: str | None = None


def is_object_url(text: object) -> bool:
    """True for a string ``scheme://...`` whose scheme has a backend (:data:`SCHEMES`)."""
    match = _URL.match(text) if isinstance(text, str) else None
    return match is not None and match.group(1).lower() in SCHEMES


def split_url(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket_or_profile, prefix)`` of ``s3://bucket/prefix`` or ``msc://profile/prefix``
    (the prefix without surrounding slashes, ``""`` for a bucket's top).

    Raises:
        ValueError: not such a URL, or no bucket/profile named.
    """
    match = _URL.match(url)
    if not match or match.group(1).lower() not in SCHEMES:
        raise ValueError(f"{url!r}: not an object-store URL; accepted: {', '.join(s + '://bucket/prefix' for s in SCHEMES)}")
    scheme, rest = match.group(1).lower(), match.group(2)
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r}: names no {'bucket' if scheme == 's3' else 'profile'}; accepted: {scheme}://<name>/<prefix>")
    parts = [p for p in prefix.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ValueError(f"{url!r}: '.' and '..' are not allowed in an object-store prefix")
    return scheme, bucket, "/".join(parts)


class ObjectStore(abc.ABC):
    """A bucket (or msc profile) and a root prefix in it; every ``rel`` is a key relative to that
    prefix (``"epoch_0_step_20/manifest.json"``). Thread-safe: the save's background writer and
    retention's deleter use one store at once."""

    def __init__(self, url: str):
        self.scheme, self.bucket, self.prefix = split_url(url)
        self.url = f"{self.scheme}://{self.bucket}/{self.prefix}".rstrip("/")
        self._etags: dict[str, str | None] = {}
        """The version of each pointer this process last read or wrote (the ``If-Match`` of its next write)."""
        self._lock = threading.Lock()

    def key(self, rel: str) -> str:
        """The full key of ``rel`` in the bucket."""
        rel = rel.strip("/")
        return f"{self.prefix}/{rel}" if self.prefix and rel else (self.prefix or rel)

    def url_of(self, rel: str) -> str:
        """``scheme://bucket/prefix/rel``, for messages."""
        return f"{self.url}/{rel.strip('/')}" if rel.strip("/") else self.url

    # -- the interface ------------------------------------------------------------------------
    @abc.abstractmethod
    def put_file(self, rel: str, local: Path) -> None:
        """Upload the local file ``local`` as ``rel`` (multipart when large; a failed multipart
        upload is aborted). Raises :class:`StoreError`."""

    @abc.abstractmethod
    def put_bytes(self, rel: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> str | None:
        """Write ``data`` as ``rel`` in one request (atomic: a reader sees the old or the new
        object); ``if_match``: only over the version with that ETag, ``if_none_match``: only when
        no object exists (where the store enforces it; see :attr:`conditional`). Returns the new
        ETag (or None). Raises :class:`PreconditionFailed`, :class:`StoreError`."""

    @abc.abstractmethod
    def get_bytes(self, rel: str, offset: int = 0, length: int | None = None) -> bytes:
        """The bytes of ``rel`` from ``offset`` (``length`` of them, ``None``: to the end): a range
        GET. Raises ``FileNotFoundError`` when there is no such object, :class:`StoreError`."""

    @abc.abstractmethod
    def get_file(self, rel: str, local: Path) -> None:
        """Download ``rel`` whole into the new local file ``local``. Raises ``FileNotFoundError``, :class:`StoreError`."""

    @abc.abstractmethod
    def head(self, rel: str) -> ObjectInfo | None:
        """``rel``'s size and ETag, or ``None`` when there is no such object. Raises :class:`StoreError`."""

    @abc.abstractmethod
    def list(self, prefix: str, *, recursive: bool = True) -> tuple[list[ObjectInfo], list[str]]:
        """The objects under ``prefix/`` (``""``: the root); not ``recursive``: only those directly
        under it, and the names of the sub-prefixes (``"epoch_0_step_20"``). Raises :class:`StoreError`."""

    @abc.abstractmethod
    def delete(self, rels: Iterable[str]) -> None:
        """Delete the objects ``rels`` (missing ones are no error). Raises :class:`StoreError`."""

    @abc.abstractmethod
    def problem(self, *, saving: bool) -> str | None:
        """Why this store cannot hold checkpoints (credentials, bucket or profile, and when
        ``saving`` a write probe, put and deleted), naming what was tried; ``None`` when it can."""

    conditional: bool = True
    """Whether the store enforces ``If-Match``/``If-None-Match`` (msc's POSIX provider does not)."""

    def write_problem(self, where: str) -> str | None:
        """Why a write probe (a small object put, then deleted) fails, saying ``where`` the store
        was reached (``"at endpoint ..."``); ``None`` when it succeeds. For :meth:`problem`."""
        probe = f".write_probe.{os.getpid()}.{id(self)}"
        try:
            self.put_bytes(probe, b"")
            self.delete([probe])
        except OSError as exc:  # StoreError and PreconditionFailed included
            return f"cannot write in {self.url} {where}: {exc}"
        return None

    def abort_uploads(self, prefix: str) -> int:
        """Abort unfinished multipart uploads under ``prefix/`` (a save killed mid-upload); returns
        how many. The default: none to abort."""
        return 0

    # -- built on it ---------------------------------------------------------------------------
    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix/``; returns how many."""
        objects, _ = self.list(prefix, recursive=True)
        self.delete([o.rel for o in objects])
        return len(objects)

    def read_pointer(self, name: str) -> str | None:
        """The checkpoint name pointer ``name`` (``LATEST``) holds, or ``None`` when there is none;
        its ETag is remembered for :meth:`write_pointer`."""
        info = self.head(name)
        if info is None:
            with self._lock:
                self._etags[name] = None
            return None
        data = self.get_bytes(name)
        with self._lock:
            self._etags[name] = info.etag
        return data.decode("utf-8", "replace").strip()

    def write_pointer(self, name: str, target: str) -> None:
        """Point ``name`` at checkpoint ``target`` with a conditional PUT: ``If-None-Match: *`` when
        this process saw no pointer, else ``If-Match`` on the version it last read or wrote (read
        now when it never looked). So a second writer that moved it meanwhile makes this write fail.

        Raises:
            PreconditionFailed: another writer moved (or created) the pointer since.
            StoreError: the request failed.
        """
        with self._lock:
            known = name in self._etags
            etag = self._etags.get(name)
        if not known:
            info = self.head(name)
            etag = info.etag if info is not None else None
        try:
            new = self.put_bytes(name, (target + "\n").encode(), if_match=etag, if_none_match=etag is None)
        except PreconditionFailed as exc:
            raise PreconditionFailed(f"{self.url_of(name)} was moved by another writer since this run read it; not overwriting it ({exc})") from exc
        with self._lock:
            self._etags[name] = new

    def delete_pointer(self, name: str) -> None:
        """Remove pointer ``name`` (no error when absent)."""
        self.delete([name])
        with self._lock:
            self._etags[name] = None
