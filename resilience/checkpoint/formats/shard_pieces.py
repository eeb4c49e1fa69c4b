"""Where each tensor's pieces lie in a ``model/`` directory of per-rank safetensors shards.

Two kinds of shard file share the name ``shard-0000K-model-0000I-of-0000N.safetensors`` (writer
rank K-1; ``I-of-N`` the consolidated output file the tensors belong to):

- a replicated model's: every tensor whole, in exactly one file;
- a sharded (DTensor) model's, in the format of torch's ``HuggingFaceStorageWriter(save_distributed=True)``:
  each rank's local pieces, the file's ``__metadata__`` holding ``"DCP_SHARDING_INFO"``, a JSON
  ``{key: {"saved_offsets": [...]}}`` giving each piece's offsets in the full tensor (and, when
  the writer recorded it, ``"global_shape"``; otherwise the full shape is the largest
  offset + size over the pieces, as torch's consolidation computes it).

A whole tensor is the special case of one piece at offsets zero, so both read alike. Only the
headers are read to list the pieces (:func:`list_pieces`); :func:`read_rows` reads a band of one
piece's rows, so a consumer (consolidation, a loader) never needs more than the band in memory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

import torch

from resilience.checkpoint.formats.sharded_model import ConsolidateError, shard_files
from resilience.checkpoint.storage.remote_files import ensure_local
from resilience.checkpoint.storage.safetensors_file import ST_DTYPES, dtype_of, read_safetensors_header

# torch.distributed.checkpoint._hf_utils's keys (its CUSTOM_METADATA_KEY, SAVED_OFFSETS_KEY): the
# file format, spelled here so this reader needs no private torch module (a test compares them).
SHARDING_INFO = "DCP_SHARDING_INFO"
SAVED_OFFSETS = "saved_offsets"
GLOBAL_SHAPE = "global_shape"
ORIGINAL_DTYPES = "original_dtypes"  # ours: {key: the original Hugging Face dtype}, JSON


@dataclasses.dataclass(frozen=True)
class Piece:
    """One stored block of a tensor: ``shape`` elements at ``offsets`` of the full tensor, stored
    row-major from byte ``start`` (absolute, in bytes) of the file ``name`` in the model directory."""

    name: str
    start: int
    shape: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class TensorPieces:
    """A tensor of a shard directory: its ``key``, saved ``dtype`` (a torch dtype name such as
    ``"bfloat16"``), full ``shape``, output file ``file_index`` of ``num_files`` (1-based), its
    ``original_dtype`` (the original Hugging Face dtype recorded at save time, or ``None``) and
    its ``pieces``, disjoint and covering it."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    file_index: int
    num_files: int
    original_dtype: str | None
    pieces: tuple[Piece, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The saved dtype as a ``torch.dtype``."""
        return getattr(torch, self.dtype)


def list_pieces(model_dir: Path) -> dict[str, TensorPieces]:
    """Every tensor of the shard files in ``model_dir`` with its pieces, from the files' headers only.

    Raises:
        ConsolidateError: no shard files (the message says what the directory holds instead); a
            malformed header; a tensor whose pieces disagree (dtype, output file, rank), overlap,
            fall outside its shape or leave part of it uncovered (a missing shard file).
    """
    found: dict[str, dict[str, Any]] = {}
    for path in shard_files(model_dir):
        file_index, num_files = _output_file(path)
        try:
            header, data_start = _header(path)
        except (OSError, ValueError) as exc:
            raise ConsolidateError(f"{path}: unreadable safetensors header ({exc})") from exc
        meta = header.pop("__metadata__", None) or {}
        sharding = _json(path, meta, SHARDING_INFO)
        originals = _json(path, meta, ORIGINAL_DTYPES)
        for key, info in header.items():
            shape = tuple(int(n) for n in info["shape"])
            where = sharding.get(key) or {}
            offsets = tuple(int(n) for n in where.get(SAVED_OFFSETS, [0] * len(shape)))
            dtype, itemsize = ST_DTYPES.get(info["dtype"], info["dtype"]), getattr(dtype_of(info["dtype"]), "itemsize", 0)
            begin, stop = info["data_offsets"]
            if not itemsize or len(offsets) != len(shape) or stop - begin != math.prod(shape) * itemsize:
                raise ConsolidateError(f"{path}: {key} has an unreadable entry {info} (offsets {list(offsets)})")
            entry = found.setdefault(key, {"dtype": dtype, "file": (file_index, num_files), "pieces": [], "global": None, "original": None})
            if (entry["dtype"], entry["file"]) != (dtype, (file_index, num_files)):
                raise ConsolidateError(f"{key}: its pieces disagree on dtype or output file ({path.name}: {dtype}, {file_index}-of-{num_files})")
            entry["pieces"].append(Piece(path.name, data_start + begin, shape, offsets))
            if GLOBAL_SHAPE in where:
                entry["global"] = tuple(int(n) for n in where[GLOBAL_SHAPE])
            entry["original"] = entry["original"] or originals.get(key)
    return {key: _assemble(key, entry) for key, entry in sorted(found.items())}


def read_rows(fh: BinaryIO, tensor: TensorPieces, piece: Piece, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` (along dim 0, of the piece, not of the full tensor) of ``piece`` read from
    ``fh`` (its file, opened ``rb``): a new tensor of shape ``(stop - start, *piece.shape[1:])``
    (a 0-d piece reads as one row of one element). Positioned reads (``pread``): threads may
    share ``fh``.

    Raises:
        ValueError: the file ends inside the rows.
    """
    shape = piece.shape or (1,)
    out = torch.empty((stop - start, *shape[1:]), dtype=tensor.torch_dtype)
    if out.numel() == 0:
        return out
    view = out.reshape(-1).view(torch.uint8).numpy().data.cast("B")  # ndarray.data: its memoryview (numpy types ndarray a Buffer on 3.12+ only)
    where = piece.start + start * math.prod(shape[1:]) * out.element_size()
    while view:
        n = os.preadv(fh.fileno(), [view], where)
        if not n:
            raise ValueError(f"{piece.name}: ends inside {tensor.key}")
        view, where = view[n:], where + n
    return out


def _assemble(key: str, entry: dict[str, Any]) -> TensorPieces:
    unique = {(p.offsets, p.shape): p for p in entry["pieces"]}  # a block written twice (replicated) counts once
    pieces = sorted(unique.values(), key=lambda p: p.offsets)
    rank = len(pieces[0].shape)
    shape = entry["global"] or tuple(max(p.offsets[d] + p.shape[d] for p in pieces) for d in range(rank))
    for p in pieces:
        if len(p.shape) != len(shape) or any(o + n > s for o, n, s in zip(p.offsets, p.shape, shape)):
            raise ConsolidateError(f"{key}: a piece at {list(p.offsets)} of shape {list(p.shape)} ({p.name}) lies outside its shape {list(shape)}")
    covered, total = sum(p.numel for p in pieces), math.prod(shape)
    if covered != total or _overlap(pieces):
        raise ConsolidateError(
            f"{key}: its pieces cover {covered} of its {total} elements or overlap ({', '.join(sorted({p.name for p in pieces}))}); is a shard file missing?"
        )
    file_index, num_files = entry["file"]
    return TensorPieces(key, entry["dtype"], shape, file_index, num_files, entry["original"], tuple(pieces))


def _overlap(pieces: list[Piece]) -> bool:
    """True when two non-empty pieces share an element (boxes intersecting in every dimension);
    ``pieces`` sorted by offsets, so a sweep along dim 0 compares only pieces that meet there."""
    boxes = [p for p in pieces if p.numel]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if a.shape and b.offsets[0] >= a.offsets[0] + a.shape[0]:
                break  # this and every later piece start below a's last row
            if all(ao < bo + bn and bo < ao + an for ao, an, bo, bn in zip(a.offsets, a.shape, b.offsets, b.shape)):
                return True
    return False


def _output_file(path: Path) -> tuple[int, int]:
    """``(I, N)`` of ``shard-0000K-model-0000I-of-0000N.safetensors``."""
    parts = path.stem.split("-")
    try:
        return int(parts[3]), int(parts[5])
    except (IndexError, ValueError):
        raise ConsolidateError(f"{path.name}: not a shard-0000K-model-0000I-of-0000N.safetensors name") from None


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """The header and the absolute offset where the tensors' bytes start."""
    header = read_safetensors_header(path)
    ensure_local(path)
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
    if os.path.getsize(path) < 8 + length:
        raise ValueError("shorter than its header")
    return header, 8 + length


def _json(path: Path, meta: dict[str, Any], name: str) -> dict[str, Any]:
    text = meta.get(name)
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConsolidateError(f"{path}: __metadata__[{name!r}] is not JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ConsolidateError(f"{path}: __metadata__[{name!r}] is not a JSON object")
    return value
