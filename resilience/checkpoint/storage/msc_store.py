"""``msc://profile/prefix`` through NVIDIA's multi-storage-client (:class:`MscStore`), as NeMo
AutoModel accepts for ``checkpoint.checkpoint_dir``.

The profile (its provider: S3, GCS, Azure, AIStore, a POSIX directory, ...; its credentials; its
``retry`` attempts and delay) is msc's own configuration (``MSC_CONFIG``, ``~/.msc_config.yaml``,
...). Conditional PUTs go to the profile's storage provider directly (msc's ``write`` takes no
condition); the POSIX provider ignores conditions (:attr:`MscStore.conditional` is False there:
a pointer is then written unconditionally, atomically by msc's temp file + rename).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from resilience.checkpoint.storage.object_store import ObjectInfo, ObjectStore, PreconditionFailed, StoreError, StoreUnavailable

T = TypeVar("T")


class MscStore(ObjectStore):
    """An msc profile and prefix (``msc://profile/prefix``); see the module docstring.

    Raises ``StoreUnavailable`` when multi-storage-client is missing or its configuration has no
    such profile (the message lists where msc looked).
    """

    def __init__(self, url: str):
        super().__init__(url)
        try:
            import multistorageclient as msc
        except ImportError as exc:  # pragma: no cover - the storage extra is not installed
            raise StoreUnavailable("msc:// needs multi-storage-client: pip install 'resilience[storage]'") from exc
        try:
            self._client, _ = msc.resolve_storage_client(f"msc://{self.bucket}/")
        except (ValueError, RuntimeError, OSError) as exc:
            raise StoreUnavailable(f"msc profile {self.bucket!r}: {exc}") from exc
        provider = getattr(self._client, "_storage_provider", None)
        self._provider = provider if provider is not None and hasattr(provider, "put_object") else None
        self.conditional = self._provider is not None and type(self._provider).__name__ != "PosixFileStorageProvider"
        self.endpoint = f"msc profile {self.bucket!r} ({type(provider).__name__ if provider is not None else 'composite'})"

    def _call(self, op: str, rel: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url_of(rel)}: no such object") from None
        except (StoreError, PreconditionFailed):
            raise
        except Exception as exc:  # msc wraps provider errors in RuntimeError and its own types
            if type(exc).__name__ == "PreconditionFailedError":
                raise PreconditionFailed(f"{self.url_of(rel)}: {op} refused: {exc}") from exc
            raise StoreError(f"{self.url_of(rel)}: {op} failed ({self.endpoint}): {type(exc).__name__}: {exc}") from exc

    def put_file(self, rel: str, local: Path) -> None:
        """See :meth:`ObjectStore.put_file` (msc's upload: multipart where its provider has it)."""
        self._call("upload", rel, lambda: self._client.upload_file(self.key(rel), str(local)))

    def put_bytes(self, rel: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> str | None:
        """See :meth:`ObjectStore.put_bytes`; conditions go to the provider (ignored by a POSIX one)."""
        provider = self._provider if self.conditional else None  # None: the POSIX provider, or msc's composite client
        if (if_match is not None or if_none_match) and provider is not None:
            condition: dict[str, Any] = {"if_match": if_match} if if_match is not None else {"if_none_match": "*"}
            self._call("PUT", rel, lambda: provider.put_object(self.key(rel), data, **condition))
        else:
            self._call("PUT", rel, lambda: self._client.write(self.key(rel), data))
        info = self.head(rel)
        return info.etag if info is not None else None

    def get_bytes(self, rel: str, offset: int = 0, length: int | None = None) -> bytes:
        """See :meth:`ObjectStore.get_bytes`."""
        from multistorageclient.types import Range

        if length == 0:
            return b""
        if not offset and length is None:
            return self._call("GET", rel, lambda: self._client.read(self.key(rel)))
        if length is None:
            info = self.head(rel)
            if info is None:
                raise FileNotFoundError(f"{self.url_of(rel)}: no such object")
            length = max(info.size - offset, 0)
        return self._call("GET", rel, lambda: self._client.read(self.key(rel), byte_range=Range(offset=offset, size=length)))

    def get_file(self, rel: str, local: Path) -> None:
        """See :meth:`ObjectStore.get_file`."""
        self._call("download", rel, lambda: self._client.download_file(self.key(rel), str(local)))

    def head(self, rel: str) -> ObjectInfo | None:
        """See :meth:`ObjectStore.head` (a directory of a POSIX profile is no object)."""
        try:
            info = self._call("HEAD", rel, lambda: self._client.info(self.key(rel)))
        except FileNotFoundError:
            return None
        if getattr(info, "type", "file") == "directory":
            return None
        return ObjectInfo(rel, int(info.content_length), getattr(info, "etag", None))

    def list(self, prefix: str, *, recursive: bool = True) -> tuple[list[ObjectInfo], list[str]]:
        """See :meth:`ObjectStore.list`."""
        base = self.key(prefix)
        base = base + "/" if base else ""
        skip = len(self.prefix) + 1 if self.prefix else 0

        def run() -> tuple[list[ObjectInfo], list[str]]:
            objects, prefixes = [], []
            for o in self._client.list(path=base, include_directories=not recursive):
                key = o.key.lstrip("/")
                if not key.startswith(base):
                    continue
                if o.type == "directory":
                    prefixes.append(key[len(base) :].rstrip("/"))
                else:
                    objects.append(ObjectInfo(key[skip:], int(o.content_length), getattr(o, "etag", None)))
            return objects, prefixes

        return self._call("LIST", prefix, run)

    def delete(self, rels: Iterable[str]) -> None:
        """See :meth:`ObjectStore.delete`."""
        keys = [self.key(rel) for rel in rels]
        if keys:
            self._call("DELETE", keys[0], lambda: self._client.delete_many(keys))

    def problem(self, *, saving: bool) -> str | None:
        """See :meth:`ObjectStore.problem`: a listing of the prefix, then a write probe."""
        try:
            self.list("", recursive=False)
        except (StoreError, OSError) as exc:
            return f"cannot list {self.url} through {self.endpoint}: {exc}"
        return self.write_problem(f"through {self.endpoint}") if saving else None
