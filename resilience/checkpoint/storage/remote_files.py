"""Files whose bytes are read from an object store by range, where the readers expect a path.

A resume from object storage downloads the files each rank reads whole into a local directory,
and loads from there. The files a balanced load (:mod:`~resilience.checkpoint.formats.balanced_load`)
reads by ranges, each rank 1/N of them, are not downloaded: their local paths are registered here
(:func:`register`), and the two range readers (``balanced_load.read_range``, and
:func:`~resilience.checkpoint.storage.durable.file_digest`, which digests a file the loader did
not) serve them with range GETs (:func:`source_of`). An :class:`ObjectPath` is served the same way
(``resilience verify`` on a bucket). A reader that opens a file by name calls :func:`ensure_local`
first, which downloads a registered file whole the first time.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from resilience.checkpoint.storage.object_path import ObjectPath
from resilience.checkpoint.storage.object_store import ObjectStore

_CHUNK = 8 << 20  # 8 MiB range GETs when a whole object is streamed


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    """Object ``rel`` of ``store``, ``size`` bytes (``None``: ask the store)."""

    store: ObjectStore
    rel: str
    size: int | None = None

    def read_into(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the bytes from ``offset`` (one range GET). Raises ``ValueError`` when
        the object ends first, ``FileNotFoundError``, ``StoreError``."""
        data = self.store.get_bytes(self.rel, offset, len(view))
        if len(data) != len(view):
            raise ValueError(f"{self.store.url_of(self.rel)}: {len(data)} bytes from {offset}, expected {len(view)} (shorter than its manifest size)")
        view[:] = data

    def length(self) -> int:
        """The object's size (``size``, else one HEAD). Raises ``FileNotFoundError``, ``StoreError``."""
        if self.size is not None:
            return self.size
        info = self.store.head(self.rel)
        if info is None:
            raise FileNotFoundError(f"{self.store.url_of(self.rel)}: no such object")
        return info.size

    def stream(self) -> io.RawIOBase:
        """A seekable read-only binary stream over the object, each read one range GET (DCP's reader)."""
        return _RemoteStream(self)

    def chunks(self) -> Iterator[bytes]:
        """The whole object, :data:`_CHUNK` bytes a request."""
        size = self.length()
        for offset in range(0, size, _CHUNK):
            yield self.store.get_bytes(self.rel, offset, min(_CHUNK, size - offset))


class _RemoteStream(io.RawIOBase):
    """:meth:`RemoteFile.stream`."""

    def __init__(self, remote: RemoteFile):
        super().__init__()
        self._remote, self._size, self._pos = remote, remote.length(), 0

    def readable(self) -> bool:
        """Always True (``io.RawIOBase``)."""
        return True

    def seekable(self) -> bool:
        """Always True: every read is a range GET at the current offset."""
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move to ``offset`` bytes from ``whence`` (clamped at 0); returns the new position in bytes."""
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(base + offset, 0)
        return self._pos

    def tell(self) -> int:
        """The current position, in bytes."""
        return self._pos

    def readinto(self, buffer: Any) -> int:
        """Fill ``buffer`` from the current position with one range GET; returns the bytes read (0 at the end)."""
        view = memoryview(buffer).cast("B")
        n = max(min(len(view), self._size - self._pos), 0)
        if n:
            self._remote.read_into(self._pos, view[:n])
            self._pos += n
        return n


_registered: dict[str, RemoteFile] = {}
_lock = threading.Lock()
_download_lock = threading.Lock()


def register(local: Path, remote: RemoteFile) -> None:
    """Serve reads of the local path ``local`` (which need not exist) from ``remote``."""
    with _lock:
        _registered[os.fspath(local)] = remote


def forget(paths: Iterable[Path]) -> None:
    """Stop serving ``paths`` (the load is over)."""
    with _lock:
        for path in paths:
            _registered.pop(os.fspath(path), None)


def ensure_local(path: Any) -> None:
    """Before a reader opens ``path`` by name (safetensors' ``safe_open``, ``open``): a registered
    file not downloaded yet is downloaded whole, now (once; a resume from object storage fetches
    ahead only the files it knows each rank reads, and a sharded state's pieces may lie in another
    rank's file). Nothing for a plain local file. Raises ``StoreError``."""
    with _lock:
        remote = _registered.get(os.fspath(path)) if _registered else None
    if remote is None:
        return
    with _download_lock:
        if not os.path.exists(path):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            remote.store.get_file(remote.rel, Path(path))


def source_of(path: Any) -> RemoteFile | None:
    """Where the bytes of ``path`` come from when not from a local file: an :class:`ObjectPath`'s
    object, or a registered path's; ``None`` for a plain local file."""
    if isinstance(path, ObjectPath):
        return RemoteFile(path.store, path.rel)
    with _lock:
        return _registered.get(os.fspath(path)) if _registered else None
