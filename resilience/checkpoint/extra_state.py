"""Additional state (NeMo AutoModel's "Save Additional States"): any ``state_dict()`` as files.

``extra/<name>.json`` holds the structure; tensors inside it are stored in
``extra/<name>.safetensors`` and referenced as ``{"__tensor__": "<key>"}``, so an EMA copy of
the weights costs its bytes, not a JSON list of numbers, and loading never unpickles anything.
Tuples and dicts with non-string keys (an optimizer-style ``{0: ...}``) keep their types through
``{"__tuple__": [...]}`` and ``{"__items__": [[key, value], ...]}``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from resilience.checkpoint.layout import EXTRA_DIR, extra_files

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_ITEMS = "__items__"
_FLOAT = "__float__"
_MARKERS = (_TENSOR, _TUPLE, _ITEMS, _FLOAT)


def _encode(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensor = obj.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensors[key] = tensor.contiguous().clone()  # safetensors refuses shared or strided storage
        return {_TENSOR: key}
    if isinstance(obj, float) and not math.isfinite(obj):
        return {_FLOAT: repr(obj)}  # strict JSON has no NaN/Inf
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not (len(obj) == 1 and next(iter(obj)) in _MARKERS):
            return {k: _encode(v, tensors, f"{where}.{k}") for k, v in obj.items()}
        return {_ITEMS: [[_encode(k, tensors, where), _encode(v, tensors, f"{where}[{k!r}]")] for k, v in obj.items()]}
    raise TypeError(
        f"{where}: {type(obj).__name__} cannot be checkpointed; a state_dict() may hold tensors, numbers, "
        "strings, booleans, None, and lists/tuples/dicts of these"
    )


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if len(obj) == 1:
            (marker, value), = obj.items()
            if marker == _TENSOR:
                return tensors[value]
            if marker == _TUPLE:
                return tuple(_decode(v, tensors) for v in value)
            if marker == _ITEMS:
                return {_decode(k, tensors): _decode(v, tensors) for k, v in value}
            if marker == _FLOAT:
                return float(value)
        return {k: _decode(v, tensors) for k, v in obj.items()}
    return obj


def save_extra_state(directory: Path, name: str, state: Any) -> list[str]:
    """Write ``state`` (a ``state_dict()``) under ``directory/extra/``; returns the relative paths.

    Raises:
        TypeError: a value that is not a tensor, number, string, bool, None or container of these
            (the message names where it is, e.g. ``extra.ema.shadow[2]``).
    """
    tensors: dict[str, torch.Tensor] = {}
    doc = _encode(state, tensors, f"{EXTRA_DIR}.{name}")
    (directory / EXTRA_DIR).mkdir(exist_ok=True)
    doc_file, tensor_file = extra_files(name)
    (directory / doc_file).write_text(json.dumps(doc))
    if tensors:
        save_file(tensors, str(directory / tensor_file))
    return [doc_file, tensor_file] if tensors else [doc_file]


def load_extra_state(directory: Path, name: str) -> Any:
    """The state saved by :func:`save_extra_state` (plain-JSON files of older checkpoints load too).

    Raises:
        FileNotFoundError: the checkpoint has no state of that name (registered after it was saved).
    """
    doc_file, tensor_file = extra_files(name)
    doc = json.loads((directory / doc_file).read_text())
    blob = directory / tensor_file
    tensors = load_file(str(blob)) if blob.exists() else {}
    return _decode(doc, tensors)
