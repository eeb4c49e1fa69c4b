"""What a Hugging Face bundle holds besides the weights' bytes: export dtypes, index, side files.

Dtypes follow NeMo AutoModel's ``consolidate.sh``: each ordinary float tensor (fp16, bf16, fp32,
fp64) goes back to its original per-tensor dtype when the original Hugging Face headers were
known at save time, else keeps its saved dtype; ``cast_dtype`` (``CAST_DTYPE``: bf16, fp16, fp32,
fp64) overrides that for ordinary floats; FP8 and non-float tensors are never changed; a tensor
whose original was packed or quantized (integer or FP8 storage) but which was saved as float is
left as saved, with a warning.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from resilience.checkpoint.formats.sharded_model import ConsolidateError
from resilience.checkpoint.layout import HF_CONFIG, HF_INDEX, hf_file_name
from resilience.checkpoint.storage.safetensors_file import read_safetensors_header

ORDINARY_FLOATS = ("float16", "bfloat16", "float32", "float64")
CAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}


def parse_cast_dtype(value: str | None) -> str | None:
    """``CAST_DTYPE`` (``bf16``, ``fp16``, ``fp32``, ``fp64``, or a torch name such as ``bfloat16``)
    as a torch dtype name; empty or ``None`` -> ``None`` (no cast).

    Raises:
        ConsolidateError: any other value (the message lists the accepted ones).
    """
    if value is None or not str(value).strip():
        return None
    text = str(value).strip().lower()
    if text in CAST_DTYPES:
        return CAST_DTYPES[text]
    if text in ORDINARY_FLOATS:
        return text
    raise ConsolidateError(f"CAST_DTYPE={value!r}; accepted: {', '.join(CAST_DTYPES)} (or empty for the original dtypes)")


def target_dtype(key: str, saved: str, original: str | None, cast: str | None) -> tuple[str, str | None]:
    """(dtype to export ``key`` in, warning or ``None``) by the policy of the module docstring."""
    if saved not in ORDINARY_FLOATS:
        return saved, None  # FP8, integers, bool: exported exactly as saved
    if original is not None and original not in ORDINARY_FLOATS:
        return saved, (
            f"{key}: the original checkpoint stores it as {original} (packed or quantized) but it was saved as {saved}; exported as {saved}, not re-packed"
        )
    if cast is not None:
        return cast, None
    return (original or saved), None


def plan_dtypes(tensors: dict[str, dict[str, Any]], cast: str | None) -> tuple[dict[str, str], list[str]]:
    """Export dtype per key, plus the warnings, for ``{key: {"dtype": saved, "original_dtype": ...}}``."""
    targets, notes = {}, []
    for key, info in tensors.items():
        targets[key], note = target_dtype(key, info["dtype"], info.get("original_dtype"), cast)
        if note:
            notes.append(note)
    return targets, notes


def is_complete(out_dir: Path, keys: Iterable[str] | None = None) -> bool:
    """True when ``out_dir`` holds a whole bundle: the index, and every file it names with exactly
    the tensors the index gives it (headers only are read); and, given ``keys``, those keys."""
    try:
        weight_map = json.loads((out_dir / HF_INDEX).read_text())["weight_map"]
        if keys is not None and set(weight_map) != set(keys):
            return False
        by_file: dict[str, set[str]] = {}
        for key, name in weight_map.items():
            by_file.setdefault(name, set()).add(key)
        for name, want in by_file.items():
            header = read_safetensors_header(out_dir / name)
            if set(header) - {"__metadata__"} != want:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def write_index(out_dir: Path, layout: dict[str, dict[str, Any]], targets: dict[str, str], aliases: dict[str, str] | None) -> list[str]:
    """Write ``model.safetensors.index.json`` for ``layout`` exported in ``targets`` dtypes:
    ``{"metadata": {"total_size": bytes[, "tied_weights": aliases]}, "weight_map": {key: file}}``.
    Returns the output file names it maps to, then the index's own name."""
    num_files = max((info["num_files"] for info in layout.values()), default=1)
    weight_map = {key: hf_file_name(layout[key]["file_index"], num_files) for key in sorted(layout)}
    total = sum(_numel(layout[key]["shape"]) * _itemsize(targets[key]) for key in layout)
    index: dict[str, Any] = {"metadata": {"total_size": total}, "weight_map": weight_map}
    if aliases:
        index["metadata"]["tied_weights"] = dict(sorted(aliases.items()))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / HF_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return sorted(set(weight_map.values())) + [HF_INDEX]


def copy_sidecars(sidecar_dir: Path | None, out_dir: Path, targets: dict[str, str]) -> list[str]:
    """Copy ``sidecar_dir``'s files (config, tokenizer) into ``out_dir``; ``config.json``'s
    ``dtype`` becomes the most common exported float dtype. Returns the names written."""
    if sidecar_dir is None or not sidecar_dir.is_dir():
        return []
    written = []
    for src in sorted(p for p in sidecar_dir.rglob("*") if p.is_file()):
        rel = src.relative_to(sidecar_dir)
        dst = out_dir / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rel.as_posix() == HF_CONFIG:
            config = json.loads(src.read_text())
            dtype = _dominant_float(targets)
            if dtype is not None:  # the dtype from_pretrained(dtype="auto") will pick
                config["dtype"] = dtype
                if "torch_dtype" in config:
                    config["torch_dtype"] = dtype
            dst.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copyfile(src, dst)
        written.append(rel.as_posix())
    return written


def tensor_bytes(info: dict[str, Any], dtype: str) -> int:
    """Bytes of a layout entry (``{"shape": [...]}``) exported in ``dtype``."""
    return _numel(info["shape"]) * _itemsize(dtype)


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def _dominant_float(targets: dict[str, str]) -> str | None:
    counts: dict[str, int] = {}
    for dtype in targets.values():
        if dtype in ORDINARY_FLOATS:
            counts[dtype] = counts.get(dtype, 0) + 1
    return max(counts, key=lambda d: (counts[d], d)) if counts else None
