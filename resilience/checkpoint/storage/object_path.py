"""A key in an object store seen as a read-mostly path (:class:`ObjectPath`), so that the code that
only *reads* a checkpoint root (choosing the checkpoint to resume from, lineage, manifests, size
checks, retention's plan, ``resilience status``) runs unchanged on a bucket.

It has the few ``pathlib.Path`` methods that code uses (``/``, ``name``, ``parent``, ``exists``,
``is_dir``, ``iterdir``, ``read_bytes``, ``read_text``, ``stat``, ...), each one request (or none).
It has no ``__fspath__`` on purpose: ``open()``, ``os.rename`` or ``Path(...)`` of one raise
``TypeError``, so nothing can silently turn a URL into a local folder; what must *change* a
bucket (publish, pointers, retention's deletes, leftovers) goes through
:mod:`resilience.checkpoint.storage.object_backend`, explicitly.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

from typing_extensions import TypeIs

from resilience.checkpoint.storage.object_store import ObjectStore, is_object_url
from resilience.checkpoint.storage.stores import open_store


@dataclasses.dataclass(frozen=True)
class _Stat:
    st_size: int


class ObjectPath:
    """``rel`` (a key relative to ``store``'s root prefix; ``""``: the root itself) in ``store``.

    ``kind`` is what a listing already said (``"dir"``: a prefix, ``"file"``: an object), sparing
    a request in :meth:`is_dir`/:meth:`is_file`; ``None``: ask the store.
    """

    def __init__(self, store: ObjectStore, rel: str = "", kind: str | None = None):
        self.store = store
        self.rel = rel.strip("/")
        self._kind = kind

    # -- names ---------------------------------------------------------------------------------
    def __truediv__(self, other: str | os.PathLike) -> ObjectPath:
        part = str(other).strip("/")
        if not part:
            return self
        if ".." in part.split("/"):
            raise ValueError(f"{self}: '..' in {part!r} would leave the checkpoint root")
        return ObjectPath(self.store, f"{self.rel}/{part}" if self.rel else part)

    @property
    def name(self) -> str:
        """The last part of the key (``""`` for the root)."""
        return posixpath.basename(self.rel)

    @property
    def parent(self) -> ObjectPath:
        """The prefix holding this key (the root is its own parent, as ``Path('/')``)."""
        return ObjectPath(self.store, posixpath.dirname(self.rel), "dir")

    @property
    def suffix(self) -> str:
        """The name's extension (``.json``), as ``PurePath.suffix``."""
        return Path(self.name).suffix if self.name else ""

    def with_name(self, name: str) -> ObjectPath:
        """A sibling named ``name``."""
        return self.parent / name

    def absolute(self) -> ObjectPath:
        """Itself: a store key is already absolute."""
        return self

    resolve = absolute

    @property
    def url(self) -> str:
        """``s3://bucket/prefix/rel``."""
        return self.store.url_of(self.rel)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"ObjectPath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and other.store.url == self.store.url and other.rel == self.rel

    def __hash__(self) -> int:
        return hash((self.store.url, self.rel))

    def __lt__(self, other: ObjectPath) -> bool:
        return (self.store.url, self.rel) < (other.store.url, other.rel)

    # -- reading ---------------------------------------------------------------------------------
    def is_symlink(self) -> bool:
        """Always False: a store has no links (pointers are small objects)."""
        return False

    def is_file(self) -> bool:
        """Whether an object has exactly this key."""
        if self._kind is not None:
            return self._kind == "file"
        return self.store.head(self.rel) is not None

    def is_dir(self) -> bool:
        """Whether any object lies under ``rel/`` (the root always counts: a bucket prefix)."""
        if self._kind is not None:
            return self._kind == "dir"
        if not self.rel:
            return True
        objects, prefixes = self.store.list(self.rel, recursive=False)
        return bool(objects or prefixes)

    def exists(self) -> bool:
        """An object of this key, or objects under it."""
        return self.is_file() or self.is_dir()

    def iterdir(self) -> Iterator[ObjectPath]:
        """The objects and prefixes directly under this one (one listing)."""
        objects, prefixes = self.store.list(self.rel, recursive=False)
        for name in prefixes:
            yield ObjectPath(self.store, f"{self.rel}/{name}" if self.rel else name, "dir")
        for info in objects:
            yield ObjectPath(self.store, info.rel, "file")

    def read_bytes(self) -> bytes:
        """The object's bytes. Raises ``FileNotFoundError``, ``StoreError``."""
        return self.store.get_bytes(self.rel)

    def read_text(self, encoding: str = "utf-8") -> str:
        """The object's text. Raises ``FileNotFoundError``, ``StoreError``."""
        return self.read_bytes().decode(encoding)

    def stat(self) -> _Stat:
        """``st_size`` of the object (one HEAD). Raises ``FileNotFoundError``, ``StoreError``."""
        info = self.store.head(self.rel)
        if info is None:
            raise FileNotFoundError(f"{self.url}: no such object")
        return _Stat(info.size)

    # -- the few writes of small records (.bad, .starts.json): one atomic PUT each ----------------
    def write_bytes(self, data: bytes) -> int:
        """Replace the object with ``data`` (one PUT: atomic). Raises ``StoreError``."""
        self.store.put_bytes(self.rel, bytes(data))
        return len(data)

    def write_text(self, text: str, encoding: str = "utf-8") -> int:
        """Replace the object with ``text`` (one PUT: atomic). Raises ``StoreError``."""
        return self.write_bytes(text.encode(encoding))

    def unlink(self, missing_ok: bool = True) -> None:
        """Delete the object (a missing one is no error: stores do not tell)."""
        self.store.delete([self.rel])

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing: a prefix exists as soon as an object lies under it."""


Location = Path | ObjectPath
"""A checkpoint root or directory: a local (or mounted) path, or a place in an object store."""

LocationT = TypeVar("LocationT", Path, ObjectPath)
"""One kind of :data:`Location` throughout a signature (what is listed under a root is of its kind)."""


def is_object(path: object) -> TypeIs[ObjectPath]:
    """True for an :class:`ObjectPath`."""
    return isinstance(path, ObjectPath)


def root_location(text: str | os.PathLike) -> Location:
    """``checkpoint_dir`` as a location: an :class:`ObjectPath` for ``s3://``/``msc://`` (through
    :func:`~resilience.checkpoint.storage.object_store.open_store`, which may raise
    ``StoreUnavailable``), else the absolute local path."""
    if is_object_url(text):
        return ObjectPath(open_store(str(text)), "", "dir")
    return Path(text).absolute()


Wire = str | tuple[str, str, str]
"""A :data:`Location` as a collective sends it (:func:`to_wire`): a local path's string, or
``("object", url, rel)``."""


def to_wire(path: Location) -> Wire:
    """``path`` in a form a collective can send (a store's client is not picklable): the local
    path's string, or ``("object", url, rel)``; :func:`from_wire` is its inverse. Never ``str()`` of
    an :class:`ObjectPath` turned back with ``Path()``: that would be a local folder named after the URL."""
    return ("object", path.store.url, path.rel) if isinstance(path, ObjectPath) else str(path)


def from_wire(wire: Wire) -> Location:
    """The location :func:`to_wire` sent."""
    if isinstance(wire, tuple):
        return ObjectPath(open_store(wire[1]), wire[2])
    return Path(wire)


def url_location(url: str) -> ObjectPath:
    """A URL given on a command line: the checkpoint root it names (:func:`root_location`), or, when
    a manifest lies directly under it, that one checkpoint, seen from its root (its parent prefix),
    so its name and the prefix of its files resolve as the loader's do."""
    from resilience.checkpoint.layout import MANIFEST

    root = root_location(url)
    if not isinstance(root, ObjectPath):
        raise ValueError(f"{url!r} is not an object storage URL (s3://, msc://)")
    store = root.store
    if store.prefix and store.head(MANIFEST) is not None:
        parent, _, name = store.prefix.rpartition("/")
        return ObjectPath(open_store(f"{store.scheme}://{store.bucket}/{parent}"), name, "dir")
    return root
