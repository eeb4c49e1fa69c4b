"""RNG state of one rank: Python ``random``, NumPy's global generator, torch CPU and CUDA.

Saved as a safetensors file (tensors for the large states, JSON in the header metadata for the
rest), so loading never unpickles anything. A checkpoint's rank state file
(``rank_state/rank_<R>.safetensors``) holds the rank's data position too, as the JSON text of
header key :data:`DATA_POSITION_KEY`: one small file per rank and save instead of two.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, safe_open, save_file

DATA_POSITION_KEY = "data_position"
"""The header metadata key of a rank state file's data position (JSON text)."""


def capture_rng_state() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This process's RNG states as (tensors, JSON metadata): a snapshot, safe to write later."""
    py_version, py_state, py_gauss = random.getstate()
    tensors = {"torch_cpu": torch.get_rng_state(), "python": torch.tensor(py_state, dtype=torch.int64)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{index}"] = state
    meta = {"python": json.dumps({"version": py_version, "gauss_next": py_gauss})}
    # NumPy's global generator is MT19937 unless the user swapped it (np.random.set_bit_generator):
    # MT19937's 624 keys go in a tensor, any other generator's state dict in the JSON.
    np_state = np.random.get_state(legacy=False)
    if np_state["bit_generator"] == "MT19937":
        tensors["numpy_keys"] = torch.from_numpy(np_state["state"]["key"].astype(np.int64))
        np_meta = {"kind": "MT19937", "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])}
        meta["numpy"] = json.dumps(np_meta)
    else:
        meta["numpy"] = json.dumps({"kind": np_state["bit_generator"], "state": np_state}, default=_array_json)
    return tensors, meta


def _array_json(value: object) -> dict[str, Any]:
    """A NumPy array in a generator's state (Philox's counter, SFC64's words) as JSON data."""
    if isinstance(value, np.ndarray):
        return {"ndarray": value.tolist(), "dtype": str(value.dtype)}
    raise TypeError(f"cannot save a NumPy generator state holding {type(value).__name__}")


def _array_from_json(obj: dict[str, Any]) -> Any:
    return np.array(obj["ndarray"], dtype=obj["dtype"]) if set(obj) == {"ndarray", "dtype"} else obj


def write_rng_state(path: Path, captured: tuple[dict[str, torch.Tensor], dict[str, str]], *, data_position: str | None = None) -> None:
    """Write a :func:`capture_rng_state` snapshot to ``path`` (safetensors; the caller fsyncs),
    with ``data_position`` (JSON text, :func:`~resilience.state.data_position.data_position_json`)
    in its header when given; :func:`load_rng_state` reads the RNG states either way."""
    tensors, meta = captured
    if data_position is not None:
        meta = {**meta, DATA_POSITION_KEY: data_position}
    save_file(tensors, str(path), metadata=meta)


def read_data_position_text(path: Path) -> str | None:
    """The data position (JSON text) a rank state file at ``path`` holds, or None when it was
    written without one (no loader). Reads the header only."""
    with safe_open(str(path), framework="pt") as fh:
        return (fh.metadata() or {}).get(DATA_POSITION_KEY)


def save_rng_state(path: Path) -> None:
    """Write this process's RNG states to ``path`` (safetensors; the caller fsyncs)."""
    write_rng_state(path, capture_rng_state())


def load_rng_state(path: Path) -> None:
    """Restore this process's RNG states from ``path`` written by :func:`save_rng_state`.

    CUDA states are restored for as many devices as both the file and this process have.
    """
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata()
    restore_rng_state((tensors, meta))


def restore_rng_state(captured: tuple[dict[str, torch.Tensor], dict[str, str]]) -> None:
    """Set this process's RNG states to a :func:`capture_rng_state` snapshot (or what
    :func:`load_rng_state` read); CUDA states for as many devices as both have. Extra header
    entries (a data position) are ignored."""
    tensors, meta = captured
    py = json.loads(meta["python"])
    random.setstate((py["version"], tuple(int(x) for x in tensors["python"].tolist()), py["gauss_next"]))
    npm = json.loads(meta["numpy"], object_hook=_array_from_json)
    if "state" in npm:  # a generator other than MT19937: the global one becomes that kind again, then takes the state
        if np.random.get_state(legacy=False)["bit_generator"] != npm["kind"]:
            np.random.set_bit_generator(getattr(np.random, npm["kind"])())  # type: ignore[attr-defined]  # numpy's stubs omit it (numpy >= 1.25)
        np.random.set_state(npm["state"])
    else:
        np.random.set_state((npm["kind"], tensors["numpy_keys"].numpy().astype(np.uint32), npm["pos"], npm["has_gauss"], npm["gauss"]))
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            if f"cuda_{index}" in tensors:
                torch.cuda.set_rng_state(tensors[f"cuda_{index}"], device=index)
