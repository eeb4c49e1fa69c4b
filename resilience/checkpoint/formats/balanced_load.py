"""Balanced resume of replicated state (``checkpoint.load_balanced``): each byte is read from
storage by one rank and reaches the others through the process group.

A replicated (plain or DDP) model's weight shards, and the optimizer's own files when every rank
holds the optimizer in full, are the same bytes on every rank. Their tensors' bytes laid end to
end (a *stream*: the files of one kind in name order, the tensors of a file in their order in it),
rank r of N reads the r-th N-th of the stream (:func:`~resilience.checkpoint.balance.stream_range`,
across file boundaries) and broadcasts it in buckets of at most :data:`BUCKET_BYTES`, which every
rank copies into its live tensors; so each rank reads 1/N of the replicated bytes and holds one
bucket more (plus any tensor that does not fit in place).

Receivers need no header: the tensors of each file come from ``shard_index.json`` /
``skeleton.json``, and in a file we wrote they follow the header in safetensors order (larger
elements first, then by key), so its data start at ``size - tensor bytes`` (the size from the
manifest). A file's *owner*, the rank whose 1/N of the files' bytes (manifest sizes, in the same
order: what :func:`~resilience.checkpoint.reader.checking_while_loading` plans the digest share
with) holds the file's first byte, reads its header, checks it against that layout (a mismatch is
the same error on every rank before any byte moves) and digests the file: the header, then the
data as it passes, read or received; so every file is digested once, by a rank that has it.

The group is the library's gloo group (``DistContext.group``) with CPU buckets: it exists
whatever the training's backend, and a tensor on a GPU gets its bytes by one copy from the
bucket (an NCCL broadcast would need GPU buckets and a device per rank, which a CPU run lacks).
"""

from __future__ import annotations

import bisect
import dataclasses
import fnmatch
import itertools
import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from resilience.checkpoint.balance import stream_owners, stream_range
from resilience.checkpoint.layout import MODEL_DIR, MODEL_SHARD_GLOB, is_optim_file
from resilience.checkpoint.storage.content_check import ContentCheck
from resilience.checkpoint.storage.remote_files import source_of
from resilience.checkpoint.storage.safetensors_file import dtype_of
from resilience.distributed import DistContext

BUCKET_BYTES = 64 << 20
"""The most bytes one broadcast moves (the bucket every rank holds while it passes): 64 MiB."""

Spec = tuple[torch.dtype, list[int]]


def streams(rels: Iterable[str]) -> dict[str, list[str]]:
    """The streams among ``rels`` (manifest paths), each in name order: ``"model"``, the weight
    shards; ``"optim"``, the optimizer's own files. The loaders take theirs from the manifest the
    same way (:func:`stream_files`), so who digests a file is who reads its first byte."""
    rels = sorted(rels)
    return {"model": [rel for rel in rels if fnmatch.fnmatch(rel, f"{MODEL_DIR}/{MODEL_SHARD_GLOB}")], "optim": [rel for rel in rels if is_optim_file(rel)]}


def stream_files(kind: str, check: ContentCheck | None, fallback: Iterable[str]) -> list[str]:
    """The ``kind`` stream of the checkpoint: from the manifest ``check`` holds, else ``fallback``
    (the files the index or skeleton names) in name order."""
    return streams(check.files)[kind] if check is not None else sorted(fallback)


def model_specs(layout: dict[str, dict[str, Any]], aliases: dict[str, str], live: dict[str, torch.Tensor]) -> tuple[dict[str, dict[str, Spec]], str | None]:
    """A replicated model's ``{rel: {key: (dtype, shape)}}`` from its ``read_layout`` and how
    this rank's model (``live``, its state dict) differs from it: missing or unexpected keys,
    other shapes (or None)."""
    missing = sorted(set(layout) - set(live))[:3]
    unexpected = sorted(set(live) - set(layout) - set(aliases))[:3]
    shapes = []
    for key, info in layout.items():
        if key in live and list(live[key].shape) != info["shape"]:
            shapes.append(f"{key} {list(live[key].shape)} (saved {info['shape']})")
    found = (("missing", missing), ("unexpected", unexpected), ("other shapes", shapes[:3]))
    problem = "; ".join(f"{what}: {', '.join(keys)}" for what, keys in found if keys) or None
    specs: dict[str, dict[str, Spec]] = {}
    for key, info in layout.items():
        specs.setdefault(f"{MODEL_DIR}/{info['shard']}", {})[key] = (getattr(torch, info["dtype"]), list(info["shape"]))
    return specs, problem


def load(
    ctx: DistContext,
    directory: Path,
    rels: list[str],
    specs: dict[str, dict[str, Spec]],
    targets: dict[str, torch.Tensor],
    check: ContentCheck | None,
) -> dict[str, torch.Tensor]:
    """Load the safetensors files ``rels`` (paths under ``directory``, a :func:`stream_files` list,
    the same on every rank) holding the tensors ``specs`` (``{rel: {key: (dtype, shape)}}``); a
    collective over ``ctx``. Returns ``{key: tensor}``: ``targets[key]`` itself, filled in place,
    when it is a contiguous tensor of the stored dtype and shape (any device), else a new CPU tensor.

    Raises, on every rank alike:
        ValueError: a file too small for its tensors, or a header other than the layout says.
        OSError: a rank could not read its range (named in the message).
    """
    sizes = [(rel, _size(directory, rel, check)) for rel in rels]
    files, problem = _files(sizes, specs)
    owners = stream_owners(sizes, ctx.world_size)
    hashers = {rel: check.claim(rel) for rel in rels if check is not None and owners[rel] == ctx.rank}
    for f in files:  # the owner reads and checks the header, the first bytes of its digest
        if problem is None and owners[f.rel] == ctx.rank:
            problem = _read_header(directory, f, specs.get(f.rel, {}), hashers.get(f.rel))
    ctx.gather_or_raise(problem, fail=ValueError)
    out = {}
    for key, (dtype, shape) in ((k, s) for per_file in specs.values() for k, s in per_file.items()):
        t = targets.get(key)
        fits = isinstance(t, torch.Tensor) and t.is_contiguous() and t.dtype == dtype and list(t.shape) == shape
        out[key] = t if fits and t is not None else torch.empty(shape, dtype=dtype)  # t is not None: for mypy, which fits does not narrow
    views = {key: _bytes_of(t) for key, t in out.items()}
    error = _broadcast_stream(ctx, directory, files, views, hashers, check)
    ctx.gather_or_raise(error, fail=OSError)
    return out


@dataclasses.dataclass
class _File:
    """One file of the stream: its data (the tensors' bytes, after the header) at stream bytes
    ``[start, stop)``, from byte ``data`` of the file on; its tensors' stream ranges."""

    rel: str
    data: int
    start: int
    stop: int
    tensors: list[tuple[int, int, str]]
    starts: list[int] = dataclasses.field(default_factory=list)
    """The tensors' stream starts, ascending (a bucket finds its first tensor by bisection)."""


def _size(directory: Path, rel: str, check: ContentCheck | None) -> int:
    """The manifest's size of ``rel`` (what the digest share was planned with), else the file's."""
    entry = check.files.get(rel) if check is not None else None
    return int(entry["size"]) if entry and "size" in entry else os.stat(directory / rel).st_size


def _order(specs: dict[str, Spec]) -> list[str]:
    """The order of the tensors' bytes in a file we wrote (``safetensors_header``'s)."""
    return sorted(specs, key=lambda key: (-specs[key][0].itemsize, key))


def _nbytes(spec: Spec) -> int:
    return torch.Size(spec[1]).numel() * spec[0].itemsize


def _files(sizes: list[tuple[str, int]], specs: dict[str, dict[str, Spec]]) -> tuple[list[_File], str | None]:
    """The stream's files in order, or a problem: a file too small for its tensors."""
    files, start = [], 0
    for rel, size in sizes:
        per_file = specs.get(rel, {})
        data, tensors, stop = size - sum(_nbytes(s) for s in per_file.values()), [], start
        if data < 8:
            return [], f"{rel}: {size} bytes, too few for its {len(per_file)} tensors"
        for key in _order(per_file):
            n = _nbytes(per_file[key])
            if n:
                tensors.append((stop, stop + n, key))
            stop += n
        files.append(_File(rel, data, start, stop, tensors, [t[0] for t in tensors]))
        start = stop
    return files, None


def _read_header(directory: Path, f: _File, specs: dict[str, Spec], hasher: Any) -> str | None:
    """Read ``f``'s header (its first ``f.data`` bytes), feed ``hasher``; why it is not the
    header of ``specs`` in order, or None."""
    head = bytearray(f.data)
    try:
        read_range(directory / f.rel, 0, memoryview(head))
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if hasher is not None:
        hasher.update(head)
    problem = _header_problem(bytes(head), specs)
    return None if problem is None else f"{directory / f.rel}: {problem}"


def _broadcast_stream(
    ctx: DistContext, directory: Path, files: list[_File], views: dict[str, Any], hashers: dict[str, Any], check: ContentCheck | None
) -> str | None:
    """Every rank's range of the data, bucket by bucket: read by its rank, broadcast, placed (and
    digested by the file's owner); this rank's read error (it still sends its buckets, so every
    rank issues the same broadcasts)."""
    total, ranks = (files[-1].stop if files else 0), ctx.world_size
    longest = -(-total // ranks)  # stream_range's lengths differ by at most one byte
    bucket = torch.empty(min(BUCKET_BYTES, longest), dtype=torch.uint8)
    chunks: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # bucket[:n] by length (the ranges differ by at most one byte), and its bytes
    error, first, starts = None, 0, [f.start for f in files]
    # One broadcast per (source rank, bucket): O(N + buckets) calls per rank, each of >= total / N
    # bytes; the loop body is kept to a few microseconds (8,192 sources: ~0.03 s of Python per stream),
    # its tensors found by bisection (a file of many tensors is touched by many sources).
    for src in range(ranks):
        lo, hi = stream_range(total, src, ranks)
        for a in range(lo, hi, BUCKET_BYTES):
            b = min(a + BUCKET_BYTES, hi)
            cached = chunks.get(b - a)
            if cached is None:
                cached = chunks[b - a] = (bucket[: b - a], bucket[: b - a].numpy())
            chunk, data = cached
            if src == ctx.rank and error is None:
                error = _read_part(directory, files, a, b, chunk)
            ctx.broadcast_tensor(chunk, src)
            while files[first].stop <= a:
                first += 1
            for i in range(first, bisect.bisect_left(starts, b, lo=first)):  # the files of [a, b)
                f = files[i]
                tensors, j = f.tensors, bisect.bisect_right(f.starts, a) - 1
                for start, stop, key in itertools.islice(tensors, j if j > 0 else 0, bisect.bisect_left(f.starts, b, lo=j if j > 0 else 0)):
                    if stop > a:
                        x, y = (start if start > a else a), (stop if stop < b else b)
                        place(views[key][x - start : y - start], data[x - a : y - a])
                hasher = hashers.get(f.rel)
                if check is not None and hasher is not None:
                    hasher.update(data[max(f.start, a) - a : min(f.stop, b) - a])
                    if f.stop <= b:
                        check.report(f.rel, hashers.pop(f.rel))
    for f in files:  # a file without data: its header was all of it
        if check is not None and f.start == f.stop and hashers.get(f.rel) is not None:
            check.report(f.rel, hashers.pop(f.rel))
    return error


def _read_part(directory: Path, files: list[_File], a: int, b: int, chunk: torch.Tensor) -> str | None:
    """Fill ``chunk`` with the data at stream bytes ``[a, b)``; a read error as a line (``chunk`` zeroed)."""
    try:
        for f in files:
            x, y = max(f.start, a), min(f.stop, b)
            if x < y:
                read_range(directory / f.rel, f.data + x - f.start, chunk[x - a : y - a].numpy().data.cast("B"))  # ndarray.data: its memoryview
    except (OSError, ValueError) as exc:
        chunk.zero_()
        return f"{type(exc).__name__}: {exc}"
    return None


def _bytes_of(t: torch.Tensor) -> Any:
    """``t``'s bytes as one flat uint8 view: a NumPy array for a CPU tensor (slicing it per source
    costs ~0.2 us, a tensor's ~2 us: 8,192 sources slice twice each per stream), else a tensor."""
    flat = t.detach().reshape(-1).view(torch.uint8)
    return flat.numpy() if flat.device.type == "cpu" else flat


def place(view: Any, part: np.ndarray) -> None:
    """Copy the bucket's bytes ``part`` into a tensor's bytes ``view`` (:func:`_bytes_of`; the scale
    bench replaces it: it moves tensor bytes)."""
    if isinstance(view, np.ndarray):
        view[:] = part
    else:
        view.copy_(torch.from_numpy(part))


def read_range(path: Path, offset: int, view: memoryview) -> None:
    """Fill ``view`` with the bytes of ``path`` from ``offset`` (the scale bench counts these).

    A path registered by a resume from object storage is read with a range GET instead
    (:mod:`~resilience.checkpoint.storage.remote_files`).

    Raises:
        OSError: the file cannot be read; ValueError: it ends before ``view`` is full.
    """
    remote = source_of(path)
    if remote is not None:
        remote.read_into(offset, view)
        return
    with open(path, "rb", buffering=0) as fh:
        fh.seek(offset)
        while view:
            n = fh.readinto(view)
            if not n:
                raise ValueError(f"{path}: shorter than its manifest size")
            view = view[n:]


def _header_problem(head: bytes, specs: dict[str, Spec]) -> str | None:
    """Why ``head`` (a file's bytes before its data) is not the header of ``specs`` in order, or None."""
    (length,) = struct.unpack("<Q", head[:8])
    if 8 + length != len(head):
        return f"header of {length} bytes, the layout leaves {len(head) - 8}"
    try:
        header = json.loads(head[8:])
    except ValueError as exc:
        return f"unreadable safetensors header ({exc})"
    header.pop("__metadata__", None)
    offset = 0
    for key in _order(specs):
        dtype, shape = specs[key]
        info = header.pop(key, None)
        n = _nbytes(specs[key])
        if info is None or dtype_of(info.get("dtype")) != dtype or info.get("shape") != list(shape) or info.get("data_offsets") != [offset, offset + n]:
            return f"{key} is stored otherwise than its index says ({info})"
        offset += n
    return f"tensors not in the index: {sorted(header)[:3]}" if header else None
