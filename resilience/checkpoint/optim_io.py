"""Optimizer state via ``torch.distributed.checkpoint`` (DCP) under ``optim/``.

DCP stores non-tensor leaves by pickling them, and loads them with ``weights_only=False``; so
only tensors go to DCP, and everything else (param groups, Python scalars, tensor shapes and
dtypes needed to pre-allocate the load targets) goes to ``optim/skeleton.json``. This module is
the one place that talks to DCP.
"""

from __future__ import annotations

import io
import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

class UnsafeCheckpointError(pickle.UnpicklingError):
    """A DCP ``.metadata`` file asks to unpickle something other than DCP's own metadata."""


# What DCP's own .metadata pickle refers to (torch 2.4 - 2.13); anything else is refused, so a
# crafted checkpoint cannot run code when it is loaded.
_ALLOWED_MODULES = {"torch.distributed.checkpoint.metadata"}
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"DCP metadata refers to {module}.{name}; refusing to unpickle it")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's reader with a restricted unpickler for ``.metadata``, refusing pickled (bytes)
    entries, which DCP would unpickle with weights_only=False. We never write any."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self.path) / ".metadata"
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path}: not DCP metadata")
        for key, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, BytesStorageMetadata):
                raise UnsafeCheckpointError(f"{path}: entry {key!r} is pickled bytes; refusing to load it")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


OPTIM_DIR = "optim"
SKELETON = f"{OPTIM_DIR}/skeleton.json"
LR_SCHEDULER = f"{OPTIM_DIR}/lr_scheduler.json"


def _split(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors keyed ``state.<fqn>.<name>`` for DCP, and a JSON skeleton of everything."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton: dict[str, Any] = {"param_groups": state["param_groups"], "state": {}}
    for fqn, entries in state["state"].items():
        skel = skeleton["state"][fqn] = {}
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                key = f"state.{fqn}.{name}"
                tensors[key] = value
                skel[name] = {"tensor": key, "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
            else:
                skel[name] = {"value": value}
    return tensors, skeleton


def capture_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The optimizer state as (tensors for DCP, JSON skeleton); the tensors are the live ones
    (copy them before training continues if the save is asynchronous)."""
    return _split(get_optimizer_state_dict(model, optimizer))


def save_optimizer(staging: Path, captured: tuple[dict[str, torch.Tensor], dict[str, Any]], *, rank: int, group: Any) -> list[str]:
    """Write a :func:`capture_optimizer` state (collective over ``group``: every rank calls it).

    Returns the relative paths this rank wrote. DCP fsyncs its own files (``sync_files``).
    """
    tensors, skeleton = captured
    target = staging / OPTIM_DIR
    target.mkdir(exist_ok=True)
    writer = dcp.FileSystemWriter(str(target), sync_files=True, single_file_per_rank=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        dcp.save(tensors, storage_writer=writer, process_group=group)
    written = [f"{OPTIM_DIR}/{p.name}" for p in target.glob(f"__{rank}_*.distcp")]
    if rank == 0:
        (staging / SKELETON).write_text(json.dumps(skeleton))
        written += [f"{OPTIM_DIR}/.metadata", SKELETON]
    return written


def load_optimizer(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, group: Any) -> None:
    """Restore the optimizer state in place (collective over ``group``)."""
    skeleton = json.loads((directory / SKELETON).read_text())
    tensors = {}
    state: dict[str, Any] = {}
    for fqn, entries in skeleton["state"].items():
        state[fqn] = {}
        for name, spec in entries.items():
            if "tensor" in spec:
                tensors[spec["tensor"]] = torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]))
            else:
                state[fqn][name] = spec["value"]
    reader = SafeFileSystemReader(str(directory / OPTIM_DIR))
    reader.read_metadata()  # refuse a crafted .metadata here, with our error, before DCP wraps it
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(tensors, storage_reader=reader, process_group=group)
    for fqn, entries in skeleton["state"].items():
        for name, spec in entries.items():
            if "tensor" in spec:
                state[fqn][name] = tensors[spec["tensor"]]
    # JSON has no tuples: give back the tuple form the optimizer uses (AdamW's ``betas``), so the
    # restored param_groups equal the saved ones rather than holding lists.
    for saved, current in zip(skeleton["param_groups"], optimizer.param_groups):
        for key, value in saved.items():
            if isinstance(value, list) and isinstance(current.get(key), tuple):
                saved[key] = tuple(value)
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": skeleton["param_groups"]})


def lr_scheduler_json(scheduler: Any) -> str:
    """An LR scheduler's ``state_dict()`` as JSON text, captured now (functions are dropped by torch).

    Raises:
        TypeError: the state holds something JSON cannot represent.
    """
    try:
        return json.dumps(scheduler.state_dict())
    except TypeError as exc:
        raise TypeError(f"lr_scheduler.state_dict() must be JSON-serialisable to be checkpointed: {exc}") from exc


def load_lr_scheduler(directory: Path, scheduler: Any) -> None:
    """Restore an LR scheduler from :func:`save_lr_scheduler`'s JSON."""
    scheduler.load_state_dict(json.loads((directory / LR_SCHEDULER).read_text()))
