"""Write a safetensors file through :class:`DurableFile`, digesting its bytes as they are written.

The format (https://github.com/huggingface/safetensors#format): an 8-byte little-endian header
length, a JSON header (``__metadata__`` and, per tensor, dtype, shape and ``data_offsets``)
padded with spaces to a multiple of 8, then the tensors' bytes back to back. Larger elements
come first, so every tensor starts at an offset aligned to its element size (as
``safetensors.torch.save_file`` does). We write it ourselves only because ``save_file`` hides
its bytes: digesting a shard afterwards meant reading it back, a second pass over every byte
(bench/README.md). Reading stays with the ``safetensors`` library.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from resilience.checkpoint.durable import DurableFile, FileRecord

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code


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
    order = sorted(tensors, key=lambda key: (-tensors[key].element_size(), key))
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key in order:
        t = tensors[key]
        if t.dtype not in _DTYPES:
            raise TypeError(f"{key}: dtype {t.dtype} has no safetensors code")
        if t.device.type != "cpu":
            raise TypeError(f"{key}: on {t.device}; copy it to the CPU first")
        if not t.is_contiguous():
            raise ValueError(f"{key}: not contiguous")
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with DurableFile(path) as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for key in order:
            t = tensors[key]
            if t.numel():
                out.write(t.reshape(-1).view(torch.uint8).numpy())
    return out.record(relpath)
