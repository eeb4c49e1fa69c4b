"""The one adapter to ``torch.distributed.checkpoint`` (DCP): save and load tensors only.

DCP stores non-tensor leaves by pickling them and loads them with ``weights_only=False``, and
its ``.metadata`` file is a pickle; so only tensors go in, and ``.metadata`` is read with an
unpickler that accepts DCP's own classes alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem

from resilience.checkpoint.layout import DCP_METADATA
from resilience.checkpoint.storage.durable import DurableFile, FileRecord
from resilience.checkpoint.storage.remote_files import source_of


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A DCP ``.metadata`` file asks to unpickle something other than DCP's own metadata."""


# What DCP's own .metadata pickle refers to (torch 2.4 - 2.13); anything else is refused, so a
# crafted checkpoint cannot run code when it is loaded.
_ALLOWED_MODULES = {"torch.distributed.checkpoint.metadata"}
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        """Resolve ``module.name`` only for DCP's own metadata classes and torch dtypes.

        Raises:
            UnsafeCheckpointError: any other global (e.g. ``os.system``).
        """
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"DCP metadata refers to {module}.{name}; refusing to unpickle it")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's reader with a restricted unpickler for ``.metadata``, refusing pickled (bytes)
    entries, which DCP would unpickle with weights_only=False. We never write any. The file is
    read and unpickled once per reader (our check, then DCP's ``load``, get the same object:
    O(N x tensors) bytes at N ranks); ``parses`` counts the parses of this process."""

    parses = 0

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = _ReadingFileSystem()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """DCP's ``Metadata`` from ``<path>/.metadata``, unpickled with the restricted unpickler
        (the first call; later calls return the same object).

        Raises:
            UnsafeCheckpointError: a foreign global, not a ``Metadata``, or a pickled-bytes entry.
        """
        cached = self.__dict__.get("_resilience_metadata")
        if cached is not None:
            cached.storage_meta.load_id = self.load_id
            return cached
        path = Path(self.path) / DCP_METADATA
        SafeFileSystemReader.parses += 1
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path}: not DCP metadata")
        for key, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, BytesStorageMetadata):
                raise UnsafeCheckpointError(f"{path}: entry {key!r} is pickled bytes; refusing to load it")
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        self._resilience_metadata = metadata
        return metadata


class _ReadingFileSystem(FileSystem):
    """DCP's local filesystem for reading, where a file a resume from object storage did not
    download is read from the store by ranges (:mod:`~resilience.checkpoint.storage.remote_files`)."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        """The file's stream; a registered remote file's range-reading stream."""
        remote = source_of(path) if mode == "rb" else None
        if remote is None:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with remote.stream() as stream:
            yield stream


class _DigestingFileSystem(FileSystem):
    """DCP's local filesystem, writing through :class:`DurableFile`: every file DCP writes is
    digested as its bytes pass and fsync'd, so the save need not read it back. ``records``
    maps each final path to its (size, digest) record; thread-safe (DCP may write with threads)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[Path, FileRecord] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        """DCP's stream for ``path``: a :class:`DurableFile` for ``"wb"`` (its record kept once
        closed), the plain file otherwise. Raises ``OSError`` from the writes or the fsync."""
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        with DurableFile(path) as stream:
            yield stream
        with self._lock:
            self.records[path] = stream.record(path.name)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        """Rename as DCP asks, carrying the file's record over to its new name."""
        super().rename(path, new_path)  # DCP writes .metadata.tmp, then renames it
        with self._lock:
            if (old := self.records.pop(Path(path), None)) is not None:
                self.records[Path(new_path)] = dataclasses.replace(old, path=Path(new_path).name)


def save_tensors(tensors: dict[str, torch.Tensor], target: Path, *, rank: int, group: Any) -> list[FileRecord]:
    """Write ``tensors`` as DCP files under ``target`` (a collective over ``group``: every rank
    calls it); returns the records (paths relative to ``target``, sizes, digests) of the files
    this rank wrote, each fsync'd and digested while written (rank 0 also owns ``.metadata``)."""
    target.mkdir(parents=True, exist_ok=True)
    writer = dcp.FileSystemWriter(str(target), sync_files=True, single_file_per_rank=True)
    writer.fs = _DigestingFileSystem()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        dcp.save(tensors, storage_writer=writer, planner=caching_planner(target.name), process_group=group)
    return sorted(writer.fs.records.values(), key=lambda rec: rec.path)


def caching_planner(role: str) -> DefaultSavePlanner:
    """DCP's default planner with its plan caching on: a rank whose local plan equals its last
    one sends none, and the coordinator reuses its global plan and metadata, so an unchanged
    layout is not planned again at each save. torch keys that cache by the planner's class name
    alone (``SavePlanner._cached_*[self._cached_plans_key]``, class-level, across checkpoint
    directories: the plans name no directory); ``role`` (``model``, ``optim``) gives each DCP
    state its own entry, so alternating saves of two states do not evict each other."""
    planner = DefaultSavePlanner(enable_plan_caching=True)
    if hasattr(planner, "_cached_plans_key"):
        planner._cached_plans_key = f"resilience.{role}"
    return planner


def load_tensors(tensors: dict[str, torch.Tensor], source: Path, *, group: Any) -> None:
    """Fill the pre-allocated ``tensors`` in place from DCP files under ``source`` (a collective).

    Raises:
        UnsafeCheckpointError: ``.metadata`` refers to anything but DCP's own classes.
    """
    reader = SafeFileSystemReader(str(source))
    reader.read_metadata()  # refuse a crafted .metadata here, with our error, before DCP wraps it
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(tensors, storage_reader=reader, process_group=group)
