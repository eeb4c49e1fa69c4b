"""Additional state (NeMo AutoModel's "Save Additional States"): any ``state_dict()`` as files.

``extra/<name>.json`` holds the structure; tensors inside it are stored in
``extra/<name>.safetensors`` and referenced as ``{"__tensor__": "<key>"}``, so an EMA copy of
the weights costs its bytes, not a JSON list of numbers, and loading never unpickles anything.
Tuples and dicts with non-string keys (an optimizer-style ``{0: ...}``) keep their types through
``{"__tuple__": [...]}`` and ``{"__items__": [[key, value], ...]}``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from resilience.checkpoint.layout import EXTRA_DIR, extra_files
from resilience.state import tagged_json


def _to_cpu(tensors: dict[str, torch.Tensor]) -> Callable[[torch.Tensor], str]:
    """The encoder's tensor function: keep a CPU copy under a new key ``t<N>``, return the key."""

    def keep(obj: torch.Tensor) -> str:
        key = f"t{len(tensors)}"
        tensor = obj.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensors[key] = tensor.contiguous().clone()  # safetensors refuses shared or strided storage
        return key

    return keep


def save_extra_state(directory: Path, name: str, state: Any) -> list[str]:
    """Write ``state`` (a ``state_dict()``) under ``directory/extra/``; returns the relative paths.

    Raises:
        TypeError: a value that is not a tensor, number, string, bool, None or container of these
            (the message names where it is, e.g. ``extra.ema.shadow[2]``).
    """
    tensors: dict[str, torch.Tensor] = {}
    doc = tagged_json.encode(state, _to_cpu(tensors), f"{EXTRA_DIR}.{name}")
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
    return tagged_json.decode(doc, tensors.__getitem__)
