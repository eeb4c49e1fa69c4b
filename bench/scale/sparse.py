"""The byte level, replaced: files at their real sizes with no tensor bytes, reads counted, not done.

Everything above these functions is the library's (and DCP's) own code; these replace only the
calls that would move tensor bytes, with the same signatures and the same results apart from the
bytes:

* ``write_safetensors`` (as ``shard_files`` and ``optim_files`` call it): the real header
  (:func:`~resilience.checkpoint.storage.safetensors_file.safetensors_header`, metadata included),
  then ``ftruncate`` to header + tensor bytes (a sparse file of the real size), fsync'd; the
  record's digest is a stand-in (nothing reads it back: the resume's digests are accounted, not run).
* ``read_safetensors`` (as ``model_io`` and ``optim_files`` call it): the header is read and parsed
  for real; the tensor bytes are counted (the whole file, as the real reader reads it), the live
  targets returned as the real reader fills them in place.
* ``balanced_load.read_range`` and ``place`` (a balanced resume of replicated state): a file's
  header is read for real (its owner checks it); this rank's 1/N of the tensor bytes is counted,
  not read, and nothing is copied into the live tensors (``SimContext.broadcast_tensor`` moves
  nothing either, counting what the rank would receive).
* ``safe_open`` (as ``shard_files.load_by_slices`` calls it): the header for real; each slice asked
  for is counted and returned as a ``meta`` tensor of its shape.
* DCP's ``_write_files_from_queue`` (the writer thread body of ``FileSystemWriter.write_data``):
  one sparse ``__<rank>_0.distcp`` per rank, each item's length its bytes + torch.save's framing
  (measured on an empty tensor of the same rank and dtype: within a few bytes), the
  ``WriteResult``\\ s as the real one builds them; the file's record goes to our digesting
  filesystem's records as its ``create_stream`` would have put it.
* DCP's ``FileSystemReader.read_data``: each read item's stored length is counted, as the real one
  reads it (``torch.load`` of the whole stored chunk, then narrowed).
* ``reader.ContentCheck``: :class:`AccountingCheck` shares the files out exactly as the real one is
  given them and counts what its thread would digest (the files of its share the loader does not
  claim), without reading.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import queue
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from bench.scale.probe import PROBE
from resilience.checkpoint import reader as ckpt_reader
from resilience.checkpoint.formats import balanced_load, model_io, optim_files, shard_files
from resilience.checkpoint.storage.content_check import ContentCheck
from resilience.checkpoint.storage.durable import FileRecord
from resilience.checkpoint.storage.safetensors_file import dtype_of, safetensors_header


def sparse_file(path: Path | str, head: bytes, size: int, *, fsync: bool = True) -> None:
    """A new file of ``size`` bytes whose first bytes are ``head`` and the rest a hole."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if head:
            os.write(fd, head)
        os.ftruncate(fd, size)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def stand_in_digest(head: bytes, size: int) -> str:
    """A digest-shaped string for a file whose bytes are not digested (nothing checks it)."""
    return xxhash.xxh3_128_hexdigest(head + struct.pack("<Q", size))


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], relpath: str, metadata: dict[str, str] | None = None) -> FileRecord:
    """``safetensors_file.write_safetensors`` without the tensor bytes (see the module docstring)."""
    head, _ = safetensors_header({key: (t.dtype, list(t.shape)) for key, t in tensors.items()}, metadata)
    size = len(head) + sum(t.numel() * t.element_size() for t in tensors.values())
    sparse_file(path, head, size)
    return FileRecord(path=relpath, size=size, digest=stand_in_digest(head, size))


def _header(path: Path | str) -> tuple[dict[str, Any], int, int]:
    """(header, its length with the 8-byte prefix, file size), read for real."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        header = json.loads(os.pread(fd, length, 8))
    finally:
        os.close(fd)
    return header, 8 + length, size


def read_safetensors(path: Path, targets: dict[str, torch.Tensor] | None = None, digest: Any = None) -> dict[str, torch.Tensor]:
    """``safetensors_file.read_safetensors`` counting the bytes instead of reading them (whole-file
    reads: every rank that loads this way reads the same file, so they count as replicated)."""
    header, head_len, size = _header(path)
    header.pop("__metadata__", None)
    targets = targets or {}
    out = {}
    for name, info in header.items():
        dtype, shape = dtype_of(info["dtype"]), list(info["shape"])
        target = targets.get(name)
        fits = isinstance(target, torch.Tensor) and target.is_contiguous() and target.dtype == dtype and list(target.shape) == shape
        out[name] = target if fits else torch.empty(shape, dtype=dtype, device="meta")
    PROBE.add_read("replicated", size)
    return out


SMALL_ELEMENTS = 4096


def read_range(path: Path, offset: int, view: memoryview) -> None:
    """``balanced_load.read_range`` counting the bytes: a header (from byte 0) is read for real
    (its owner checks it), a range of tensor data only counted (this rank's 1/N of the stream)."""
    if offset == 0:
        with open(path, "rb", buffering=0) as fh:
            fh.readinto(view)
        PROBE.add_read("headers", len(view))
    else:
        PROBE.add_read("balanced", len(view))


def place(view: Any, part: Any) -> None:
    """``balanced_load.place`` moving nothing (the broadcast brought no bytes either)."""


class SafeOpen:
    """``safetensors.safe_open`` for ``load_by_slices``: the header is read, each slice counted."""

    def __init__(self, path: str, framework: str = "pt"):
        self.header, head_len, _ = _header(path)
        PROBE.add_read("headers", head_len)

    def _meta(self, name: str) -> torch.Tensor:
        info = self.header[name]
        return torch.empty(info["shape"], dtype=dtype_of(info["dtype"]), device="meta")

    def get_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor (counted), as a meta tensor; a small one (an optimizer's step
        counter, loaded into a plain CPU tensor) as zeros on the CPU."""
        t = self._meta(name)
        if t.numel() <= SMALL_ELEMENTS:
            t = torch.zeros_like(t, device="cpu")
        PROBE.add_read("own", t.numel() * t.element_size())
        return t

    def get_slice(self, name: str) -> _Slice:
        """A sliceable view; the bytes of the slice taken are counted."""
        return _Slice(self._meta(name))


class _Slice:
    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __getitem__(self, index: Any) -> torch.Tensor:
        part = self.tensor[index]
        PROBE.add_read("own", part.numel() * part.element_size())
        return part


_FRAMING: dict[tuple[int, torch.dtype], int] = {}


def _saved_length(shape: torch.Size, dtype: torch.dtype) -> int:
    """torch.save's length for a tensor: its bytes + the framing of one of the same rank and dtype."""
    key = (len(shape), dtype)
    if key not in _FRAMING:
        with PROBE.excluded():
            one = torch.zeros([1] * len(shape), dtype=dtype)
            buffer = io.BytesIO()
            torch.save(one, buffer)
            _FRAMING[key] = buffer.tell() - one.element_size()
    return math.prod(shape) * dtype.itemsize + _FRAMING[key]


def dcp_results(items: list[Any], storage_key: str) -> tuple[list[WriteResult], int]:
    """The ``WriteResult``\\ s of one DCP file holding ``items`` in the real writer's order (bytes
    first, then tensors as queued), and the file's size."""
    ordered = [wi for wi in items if wi.type == WriteItemType.BYTE_IO] + [wi for wi in items if wi.type != WriteItemType.BYTE_IO]
    results, offset = [], 0
    for wi in ordered:
        if wi.type == WriteItemType.BYTE_IO:
            raise NotImplementedError("the scale bench's state holds tensors only")
        length = _saved_length(wi.tensor_data.chunk.sizes, wi.tensor_data.properties.dtype)
        results.append(WriteResult(index=wi.index, size_in_bytes=length, storage_data=dcp_fs._StorageInfo(storage_key, offset, length)))
        offset += length
    return results, offset


def dcp_file(fs: Any, path: Path, items: list[Any]) -> list[WriteResult]:
    """Make one rank's DCP data file at ``path`` (sparse) and record it in our filesystem ``fs``."""
    results, size = dcp_results(items, path.name)
    sparse_file(path, b"", size)
    fs.records[path] = FileRecord(path=path.name, size=size, digest=stand_in_digest(path.name.encode(), size))
    return results


def _write_files_from_queue(create_stream: Any, file_queue: queue.Queue, result_queue: queue.Queue, planner: Any, *args: Any, **kwargs: Any) -> None:
    fs = create_stream.__self__  # our _DigestingFileSystem: its create_stream records every file written
    while True:
        try:
            file_name, _storage_key, write_items = file_queue.get_nowait()
        except queue.Empty:
            return
        result_queue.put(dcp_file(fs, Path(file_name), write_items))


def _read_data(self: Any, plan: Any, planner: Any) -> Any:
    from torch.distributed.tensor import DTensor
    from torch.futures import Future

    flat = getattr(planner, "state_dict", {})
    for item in plan.items:  # each item's stored chunk is read whole, as torch.load reads it
        info = self.storage_data[item.storage_index]
        PROBE.add_read("own" if isinstance(flat.get(item.dest_index.fqn), DTensor) else "replicated", info.length)
    fut: Future = Future()
    fut.set_result(None)
    return fut


class AccountingCheck(ContentCheck):
    """The loader's content check given the same share, counting what its thread would read."""

    def start(self) -> None:
        """No thread: nothing is digested."""

    def claim(self, rel: str) -> Any:
        """Take ``rel`` as the real one does; no hash object, so the loader digests nothing."""
        with self._lock:
            if rel in self._share and rel not in self._taken:
                self._taken.add(rel)
        return None

    def finish(self) -> None:
        """Count the files of the share nobody claimed: the real thread reads them whole."""
        left = [rel for rel in self.rels if rel not in self._taken]
        PROBE.add_read("own", sum(int(self.files[rel].get("size", 0)) for rel in left))

    def abandon(self) -> None:
        """Nothing to stop."""


@contextlib.contextmanager
def byte_level_replaced() -> Iterator[None]:
    """Install the replacements above for the duration."""
    swaps = [
        (shard_files, "write_safetensors", write_safetensors),
        (optim_files, "write_safetensors", write_safetensors),
        (model_io, "read_safetensors", read_safetensors),
        (optim_files, "read_safetensors", read_safetensors),
        (balanced_load, "read_range", read_range),
        (balanced_load, "place", place),
        (shard_files, "safe_open", SafeOpen),
        (dcp_fs, "_write_files_from_queue", _write_files_from_queue),
        (dcp_fs.FileSystemReader, "read_data", _read_data),
        (ckpt_reader, "ContentCheck", AccountingCheck),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in swaps]
    for owner, name, value in swaps:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
