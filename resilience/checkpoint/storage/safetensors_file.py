"""Safetensors files written through a ``DurableFile`` (digested as written; one of 64 MiB or more
with ``O_DIRECT`` inside a local save, :mod:`~resilience.checkpoint.storage.direct_file`) and
read straight into the tensors they restore.

The format (https://github.com/huggingface/safetensors#format): an 8-byte little-endian header
length, a JSON header (``__metadata__`` and, per tensor, dtype, shape and ``data_offsets``)
padded with spaces to a multiple of 8, then the tensors' bytes back to back. Larger elements
come first, so every tensor starts at an offset aligned to its element size (as
``safetensors.torch.save_file`` does, byte for byte). We write and read it ourselves only for
speed, measured in bench/README.md: ``save_file`` hides its bytes, so digesting a shard meant
reading it back; ``load_file`` maps the file and copies every tensor once more into the model,
at about half the disk's cold read rate. Other readers (``resilience consolidate``, tests)
use the ``safetensors`` library. The dtype codes and the header reader here serve them all.
"""

from __future__ import annotations

import bisect
import json
import os
import queue
import struct
import threading
from pathlib import Path
from typing import Any, Protocol

import torch

from resilience.checkpoint.storage.direct_file import open_for_tensors
from resilience.checkpoint.storage.durable import Digest, FileRecord
from resilience.checkpoint.storage.remote_files import ensure_local

# safetensors header dtype codes -> torch dtype names (the names used in our JSON files).
ST_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",
    "C64": "complex64",
}
# Codes only ever named (original dtypes of a Hugging Face checkpoint), never in our own files:
# F4 packs two values per byte, so its bytes are not shape x element size.
_NAMED_ONLY = {"F8_E8M0", "F4"}
_DTYPES = {  # torch dtype -> safetensors code, for writing (the dtypes this torch has)
    getattr(torch, name): code for code, name in ST_DTYPES.items() if code not in _NAMED_ONLY and hasattr(torch, name)
}
_CODES = {code: dtype for dtype, code in _DTYPES.items()}  # safetensors code -> dtype, for reading


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], relpath: str, metadata: dict[str, str] | None = None) -> FileRecord:
    """Write ``tensors`` (CPU, contiguous, none sharing storage) to a new safetensors file at
    ``path``, fsync it, and return its manifest record under the name ``relpath``.

    The file loads with ``safetensors.torch.load_file``; ``metadata`` (str -> str) is its
    ``__metadata__``.

    Raises:
        TypeError: a dtype safetensors has no code for, or a tensor not on the CPU.
        ValueError: a non-contiguous tensor.
        OSError: from the writes or the fsync (e.g. ENOSPC); the file is then incomplete.
    """
    for key, t in tensors.items():
        if t.device.type != "cpu":
            raise TypeError(f"{key}: on {t.device}; copy it to the CPU first")
        if not t.is_contiguous():
            raise ValueError(f"{key}: not contiguous")
    text, order = safetensors_header({key: (t.dtype, list(t.shape)) for key, t in tensors.items()}, metadata)
    with open_for_tensors(path, len(text) + sum(t.numel() * t.element_size() for t in tensors.values())) as out:
        out.write(text)
        for key in order:
            t = tensors[key]
            if t.numel():
                out.write(t.reshape(-1).view(torch.uint8).numpy())
    return out.record(relpath)


def safetensors_header(specs: dict[str, tuple[torch.dtype, list[int]]], metadata: dict[str, str] | None = None) -> tuple[bytes, list[str]]:
    """The length prefix and JSON header of a safetensors file holding tensors of ``specs``
    (``{key: (dtype, shape)}``), and the order their bytes must follow it in: larger elements
    first, then by key, so each tensor is aligned to its element size (``save_file``'s layout).

    Raises:
        TypeError: a dtype safetensors has no code for.
    """
    order = sorted(specs, key=lambda key: (-specs[key][0].itemsize, key))
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key in order:
        dtype, shape = specs[key]
        if dtype not in _DTYPES:
            raise TypeError(f"{key}: dtype {dtype} has no safetensors code")
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        header[key] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def dtype_of(code: str) -> torch.dtype | None:
    """The torch dtype of a safetensors header dtype code (``"BF16"``), ``None`` for one this
    torch cannot hold (or one only ever named, such as packed ``F4``)."""
    return _CODES.get(code)


_MAX_HEADER = 100 << 20  # the safetensors library's own limit


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (``__metadata__`` included); reads no tensor data.

    Raises:
        ValueError: not a safetensors file (bad length prefix or header).
    """
    ensure_local(path)
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER:
            raise ValueError(f"{path}: not a safetensors file (header of {length} bytes)")
        try:
            return json.loads(fh.read(length))
        except ValueError as exc:
            raise ValueError(f"{path}: not a safetensors file ({exc})") from exc


def read_safetensors(path: Path, targets: dict[str, torch.Tensor] | None = None, digest: Digest | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file at ``path``, by name, read in file order.

    A tensor lands in ``targets[name]`` in place (no copy after the read) when that is a
    contiguous CPU tensor of the same dtype and shape; otherwise in a new tensor. Returns
    ``{name: tensor}`` for every tensor in the file (the targets themselves where used).

    The tensors' bytes are read :data:`READ_BYTES` at a time, several tensors per ``preadv``
    (one request spanning them, so the kernel reads that far ahead; measured in bench/README.md:
    8 MiB requests, one per tensor, with the digest between them ran at ~0.7-0.9 of 64 MiB ones on this disk).
    ``digest`` (a hash object with ``update``, e.g. ``xxhash.xxh3_128()``) is fed every byte of
    the file, in order, as it is read: the file's digest without a second read. For a file of
    :data:`DIGEST_BEHIND_BYTES` or more it runs on a thread behind the reads
    (:class:`_DigestBehind`), so the disk does not wait on it.

    Raises:
        ValueError: a malformed file (header, dtype, offsets outside the file or overlapping),
            or one that ends early.
        OSError: the file cannot be read.
    """
    targets = targets or {}
    ensure_local(path)
    with open(path, "rb", buffering=0) as fh:
        size = os.fstat(fh.fileno()).st_size
        if digest is not None and size >= DIGEST_BEHIND_BYTES:
            with _DigestBehind(digest) as behind:
                return _read_tensors(path, fh, size, targets, behind)
        return _read_tensors(path, fh, size, targets, digest)


def _read_tensors(path: Path, fh: Any, size: int, targets: dict[str, torch.Tensor], digest: _Feed | None) -> dict[str, torch.Tensor]:
    """The body of :func:`read_safetensors` on its open file ``fh`` of ``size`` bytes."""
    head = fh.read(8)
    (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
    if not 0 < length <= min(_MAX_HEADER, size - 8):
        raise ValueError(f"{path}: not a safetensors file (header length {length})")
    text = fh.read(length)
    if digest is not None:
        digest.update(head)
        digest.update(text)
    try:
        header = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path}: unreadable safetensors header ({exc})") from exc
    header.pop("__metadata__", None)
    data_start, end = 8 + length, 0
    out: dict[str, torch.Tensor] = {}
    views: list[memoryview] = []  # every tensor's bytes, in file order (back to back: checked below)
    used: list[tuple[int, int]] = []  # the memory they fill: a target shared by two names (tied) is read into once
    for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        dtype = _CODES.get(info.get("dtype"))
        begin, stop = info["data_offsets"]
        if dtype is None:
            raise ValueError(f"{path}: {name} has an unknown dtype {info.get('dtype')!r}")
        shape = list(info["shape"])
        nbytes = stop - begin
        if begin != end or nbytes != torch.Size(shape).numel() * dtype.itemsize or data_start + stop > size:
            raise ValueError(f"{path}: {name} has inconsistent data_offsets {info['data_offsets']}")
        end = stop
        target = targets.get(name)
        if not (
            isinstance(target, torch.Tensor)
            and target.device.type == "cpu"
            and target.is_contiguous()
            and target.dtype == dtype
            and list(target.shape) == shape
            and not _overlaps(target, used)
        ):
            target = torch.empty(shape, dtype=dtype)
        if nbytes:
            bisect.insort(used, (target.data_ptr(), target.data_ptr() + nbytes))
            views.append(target.reshape(-1).view(torch.uint8).numpy().data)
        out[name] = target
    if digest is not None and data_start + end < size:  # bytes past the last tensor: digested too
        views.append(memoryview(bytearray(size - data_start - end)))
    _read_views(fh.fileno(), data_start, views, digest, f"{path}: shorter than its header says")
    return out


def _overlaps(target: torch.Tensor, used: list[tuple[int, int]]) -> bool:
    """Whether ``target``'s bytes overlap memory another tensor of this file is read into (two
    names tied to one tensor: one request would fill both before either is digested). ``used``:
    the ``(start, stop)`` addresses taken so far, sorted, disjoint (bisected: O(log n) a tensor)."""
    start = target.data_ptr()
    stop = start + target.numel() * target.element_size()
    if start == stop:
        return False
    i = bisect.bisect_right(used, (start, stop))
    return (i > 0 and used[i - 1][1] > start) or (i < len(used) and used[i][0] < stop)


READ_BYTES = 64 << 20
"""The bytes one read request asks for (several tensors' at once, or a part of a larger one)."""
_MAX_BUFFERS = 512  # buffers per preadv, under Linux's IOV_MAX of 1024
DIGEST_BEHIND_BYTES = 64 << 20
"""Files of this size or more are digested on a thread behind the reads (:class:`_DigestBehind`)."""


def _read_views(fd: int, offset: int, views: list[memoryview], digest: _Feed | None, short: str) -> None:
    """Fill ``views`` (byte views, back to back in the file from ``offset``) from ``fd``, in
    requests of up to :data:`READ_BYTES`; feed ``digest`` (if any) each filled part in order.
    Raises ``ValueError(short)`` at an early end of file."""
    batch: list[memoryview] = []
    batch_bytes = 0
    for view in views:
        for start in range(0, len(view), READ_BYTES):
            part = view[start : start + READ_BYTES]
            if batch and (batch_bytes + len(part) > READ_BYTES or len(batch) >= _MAX_BUFFERS):
                offset = _read_batch(fd, offset, batch, digest, short)
                batch, batch_bytes = [], 0
            batch.append(part)
            batch_bytes += len(part)
    if batch:
        _read_batch(fd, offset, batch, digest, short)


def _read_batch(fd: int, offset: int, batch: list[memoryview], digest: _Feed | None, short: str) -> int:
    """Fill every view of ``batch`` from ``fd`` at ``offset`` (``preadv``, again after a short
    read); feed ``digest`` each view as it is filled. Returns the offset after them."""
    while batch:
        n = os.preadv(fd, batch, offset)  # as shard_pieces.read_rows: Linux, macOS 11 or later
        if not n:
            raise ValueError(short)
        offset += n
        while n and batch:
            filled = min(n, len(batch[0]))
            if digest is not None:
                digest.update(batch[0][:filled])
            batch[0] = batch[0][filled:]
            n -= filled
            if not batch[0]:
                batch.pop(0)
    return offset


class _Feed(Protocol):
    """What the reads feed: a digest, or :class:`_DigestBehind` feeding one on its thread."""

    def update(self, data: Any, /) -> None:
        """Feed the next bytes of the file, in order."""


class _DigestBehind:
    """A digest fed on its own thread, in order, with the buffers the reads have just filled: a
    request's bytes are hashed while the next ones are read (xxh3 releases the GIL), so the disk
    does not wait on it. The buffers must stay unchanged until :meth:`close`, which waits for the
    last update and raises the thread's error, if any (an error already on its way out of the
    ``with`` block wins; once the thread has failed, :meth:`update` raises it at once)."""

    def __init__(self, digest: Digest):
        self._digest = digest
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()  # views of the targets only: no copies held
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="resilience-read-digest", daemon=True)
        self._thread.start()

    def update(self, data: Any) -> None:
        """Queue ``data`` (a bytes-like view the caller leaves unchanged until :meth:`close`) for
        the digest. Raises the digest's own error, once it has failed, instead of queueing more."""
        if self._error is not None:
            raise self._error
        self._queue.put(data)

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._digest.update(data)
                except BaseException as exc:  # raised on the reader's thread
                    self._error = exc

    def close(self) -> None:
        """Wait until every queued view is digested (the digest is then complete); raise the
        digest's error, if it failed."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def __enter__(self) -> _DigestBehind:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is None:
            self.close()
            return
        self._queue.put(None)  # the read failed: its error is the one to raise
        self._thread.join()
