"""One Hugging Face bundle file written from shard pieces, a band of rows at a time.

A tensor of the output file is never held whole: it is written in bands of rows (dim 0) of at
most ``band_bytes`` (or one row, when a row is larger). Each band is filled from the pieces
(:mod:`~resilience.checkpoint.formats.shard_pieces`) that cross it, each read only for the rows
inside the band, cast to the export dtype, and appended to the file, which is written front to
back through :class:`~resilience.checkpoint.storage.durable.DurableFile` and so digested as it
is written. A replicated tensor (one piece, at offsets zero) is the same path with one piece.

torch's ``_consolidate_hf_safetensors`` places pieces byte-run by byte-run into a buffer of the
whole tensor; here tensor slicing places them into the band, so memory stays at a band per
file being written, whatever the tensor's size.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import torch

from resilience.checkpoint.formats.shard_pieces import Piece, TensorPieces, read_rows
from resilience.checkpoint.storage.durable import DurableFile, FileRecord
from resilience.checkpoint.storage.safetensors_file import safetensors_header

BAND_BYTES = 64 << 20
"""Default largest band (bytes of the saved dtype) a tensor is assembled in."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of an output file: written under ``key`` from ``source``'s pieces, in ``dtype``
    (a torch dtype name). ``key`` differs from ``source.key`` for a tied weight copied in."""

    key: str
    source: TensorPieces
    dtype: str


def write_file(
    path: Path,
    relpath: str,
    entries: list[Entry],
    model_dir: Path,
    *,
    band_bytes: int = BAND_BYTES,
    num_threads: int = 1,
    advance: Callable[[int], object] | None = None,
) -> FileRecord:
    """Write the safetensors file ``path`` holding ``entries`` (pieces read from ``model_dir``),
    fsync it, and return its record under ``relpath``. ``num_threads`` threads read the pieces of
    a band from their files at once; ``advance(n)`` is called after each ``n`` bytes written.

    Raises:
        ValueError: a shard file ends inside a piece.
        OSError: reading a shard or writing the output (e.g. ENOSPC).
    """
    header, order = safetensors_header(
        {e.key: (getattr(torch, e.dtype), list(e.source.shape)) for e in entries},
        {"format": "pt"},
    )
    by_key = {e.key: e for e in entries}
    with contextlib.ExitStack() as stack:
        files: dict[str, BinaryIO] = {}
        lock = threading.Lock()

        def handle(name: str) -> BinaryIO:  # one handle per shard file; reads use pread (thread-safe)
            with lock:
                if name not in files:
                    files[name] = stack.enter_context(open(model_dir / name, "rb"))  # noqa: SIM115 - closed by the stack
                return files[name]

        pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(max_workers=num_threads)) if num_threads > 1 else None
        out = stack.enter_context(DurableFile(path))
        out.write(header)
        for key in order:
            entry = by_key[key]
            for band in _bands(entry.source, band_bytes, handle, pool):
                data = band.to(getattr(torch, entry.dtype)).contiguous()
                out.write(data.reshape(-1).view(torch.uint8).numpy())
                if advance is not None:
                    advance(data.numel() * data.element_size())
    return out.record(relpath)


def _bands(tensor: TensorPieces, band_bytes: int, handle: Callable[[str], BinaryIO], pool: concurrent.futures.Executor | None) -> Iterator[torch.Tensor]:
    """The full tensor's rows, in order, as tensors of at most ``band_bytes`` (at least one row)."""
    shape = tensor.shape or (1,)  # a 0-d tensor: one row of one element, the same bytes
    if math.prod(shape) == 0:
        return
    rows = max(1, band_bytes // max(math.prod(shape[1:]) * tensor.torch_dtype.itemsize, 1))
    boxes = [(piece, *_box(piece)) for piece in tensor.pieces if piece.numel]
    for first in range(0, shape[0], rows):
        last = min(first + rows, shape[0])
        crossing = [(piece, at, size) for piece, at, size in boxes if at[0] < last and first < at[0] + size[0]]
        if len(crossing) == 1 and crossing[0][2][1:] == shape[1:]:  # whole rows of one piece: no assembly
            piece, at, _ = crossing[0]
            yield read_rows(handle(piece.name), tensor, piece, first - at[0], last - at[0])
            continue
        band = torch.empty((last - first, *shape[1:]), dtype=tensor.torch_dtype)

        def fill(item: tuple[Piece, tuple[int, ...], tuple[int, ...]], band: torch.Tensor = band, first: int = first, last: int = last) -> None:
            piece, at, size = item
            lo, hi = max(first, at[0]), min(last, at[0] + size[0])
            block = read_rows(handle(piece.name), tensor, piece, lo - at[0], hi - at[0])
            rows_cols = (slice(lo - first, hi - first), *(slice(o, o + n) for o, n in zip(at[1:], size[1:])))  # mypy takes band[(a, *b)] for 3.11 syntax
            band[rows_cols] = block

        list(pool.map(fill, crossing) if pool is not None else map(fill, crossing))
        yield band


def _box(piece: Piece) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, shape) of ``piece``, a 0-d one as one row of one element."""
    return piece.offsets or (0,), piece.shape or (1,)
