"""Optimizer state under ``optim/``: the tensors in our own safetensors files when every rank
holds them in full (:mod:`~resilience.checkpoint.formats.optim_files`), as per-rank pieces like
the model's shards when they are ``DTensor`` tensors (:mod:`~resilience.checkpoint.formats.optim_shards`:
FSDP2, TP, 2-D meshes; loaded by overlap, so they reshard), else via
``torch.distributed.checkpoint`` (DCP: plain state the ranks hold differently; and the sharded
state of checkpoints written before, which still load).

Everything but the tensors (param groups, Python scalars, tensor shapes and dtypes needed to
pre-allocate the load targets, the file of each tensor) goes to ``optim/skeleton.json``. Only
tensors go to DCP (see :mod:`resilience.checkpoint.storage.dcp_io`). Loading tells the two apart
by the files present (DCP's ``optim/.metadata``), so checkpoints written before the optimizer
had its own files load as they did.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from resilience.checkpoint.formats import optim_files, optim_shards
from resilience.checkpoint.formats.plan_cache import LayoutCache
from resilience.checkpoint.formats.state_dicts import get_model_state_dict, get_optimizer_state_dict, set_optimizer_state_dict
from resilience.checkpoint.layout import DCP_METADATA, LR_SCHEDULER, OPTIM_DIR, SKELETON
from resilience.checkpoint.storage.content_check import ContentCheck
from resilience.checkpoint.storage.durable import FileRecord
from resilience.config.checks import ConfigError
from resilience.distributed import DistContext
from resilience.sharded_types import any_dtensor, is_dtensor
from resilience.state import tagged_json

log = logging.getLogger("resilience.checkpoint")

# A tensor inside another value of the state (LBFGS's ``old_dirs``, a list of tensors) is stored
# as an entry of its own named NESTED + "<name>.<i>", with ``part_of`` naming the value.
NESTED = "__nested__."


class ParamGroupsChanged(ConfigError):
    """The optimizer's param groups are not those it was saved with (another count, or other
    parameters in a group): loading would map the saved groups onto other ones and put their
    hyperparameters on them (the first step then fails, e.g. ``KeyError: 'betas'``). Raised at the
    resume, before any step; the loop exits 2 (``CONFIG_ERROR``)."""


def _split(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors keyed ``state.<fqn>.<name>`` for DCP, and a JSON skeleton of everything. Any other
    value is tagged JSON (:mod:`resilience.state.tagged_json`: tuples stay tuples), each tensor
    inside it an entry of its own (see ``NESTED``).

    Raises:
        TypeError: a state value the codec cannot hold (naming where).
    """
    tensors: dict[str, torch.Tensor] = {}
    # param groups are tagged JSON too: a tensor lr (Adam(..., lr=torch.tensor(1e-3))) is kept inline
    groups = tagged_json.encode(state["param_groups"], tagged_json.tensor_to_json, "optimizer.param_groups")
    skeleton: dict[str, Any] = {"param_groups": groups, "state": {}}
    for fqn, entries in state["state"].items():
        skel: dict[str, Any] = {}
        skeleton["state"][fqn] = skel

        def add(name: str, value: torch.Tensor, part_of: str | None = None, fqn: str = fqn, skel: dict = skel) -> str:
            key = f"state.{fqn}.{name}"
            tensors[key] = value
            skel[name] = {"tensor": key, "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
            if part_of is not None:
                skel[name]["part_of"] = part_of
            return name

        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                add(name, value)
            else:
                parts = itertools.count()
                nest = lambda t, name=name, parts=parts: add(f"{NESTED}{name}.{next(parts)}", t, part_of=name)  # noqa: E731
                skel[name] = {"tagged": tagged_json.encode(value, nest, f"optimizer.state[{fqn!r}].{name}")}
    return tensors, skeleton


def capture_optimizer(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    world_size: int = 1,
    gather: Callable[[Any], list[Any]] | None = None,
    same: Callable[[str], bool] | None = None,
    state: dict[str, Any] | None = None,
    rank: int = 0,
    cache: LayoutCache | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The optimizer state as (tensors, JSON skeleton); the tensors are the live ones (copy them
    before training continues if the save is asynchronous). ``state``:
    ``get_optimizer_state_dict(model, optimizer)`` when the caller has it already. Decides where
    they go: our own files when every rank holds them alike (:func:`optim_files.replicated`: a
    collective through ``same``, ``DistContext.same_everywhere``, else ``gather``,
    ``DistContext.all_gather_object``, when ``world_size > 1``),
    per-rank pieces when they are ``DTensor`` tensors (:func:`optim_shards.capture`: planned now, on
    this thread, rank ``rank``; reused from ``cache`` while the layout is unchanged), else DCP;
    :func:`uses_dcp` tells which (the replicated files are assigned when written)."""
    tensors, skeleton = _split(get_optimizer_state_dict(model, optimizer) if state is None else state)
    if optim_files.replicated(tensors, world_size, gather, same):
        skeleton["storage"] = optim_files.STORAGE
    elif any_dtensor(tensors.values()):
        optim_shards.capture(tensors, skeleton, rank=rank, world_size=world_size, gather=gather or (lambda obj: [obj]), cache=cache)
    return tensors, skeleton


def uses_dcp(captured: tuple[dict[str, torch.Tensor], dict[str, Any]]) -> bool:
    """Whether a :func:`capture_optimizer` state is saved through DCP (a collective over every
    rank) rather than as each rank's own file."""
    return captured[1].get("storage") not in (optim_files.STORAGE, optim_shards.STORAGE)


def is_replicated(captured: tuple[dict[str, torch.Tensor], dict[str, Any]]) -> bool:
    """Whether a :func:`capture_optimizer` state is one every rank holds in full (its own files,
    each rank writing ~1/N of the tensors, every rank reading them all), not a sharded one."""
    return captured[1].get("storage") == optim_files.STORAGE


def save_optimizer(
    staging: Path, captured: tuple[dict[str, torch.Tensor], dict[str, Any]], *, rank: int, world_size: int = 1, group: Any = None
) -> list[str | FileRecord]:
    """Write a :func:`capture_optimizer` state: this rank's file, or (DCP) its part of a
    collective over ``group`` that every rank calls.

    Returns what this rank wrote: records of the tensor files (digested while written) and the
    relative path of ``skeleton.json`` (rank 0).
    """
    tensors, skeleton = captured
    if uses_dcp(captured):
        from resilience.checkpoint.storage import dcp_io  # DCP, imported only for DCP's files

        written: list[str | FileRecord] = [rec.under(OPTIM_DIR) for rec in dcp_io.save_tensors(tensors, staging / OPTIM_DIR, rank=rank, group=group)]
    elif skeleton.get("storage") == optim_shards.STORAGE:
        written = list(optim_shards.save(staging, tensors, skeleton, rank))
    else:
        optim_files.assign(tensors, skeleton, world_size)  # the same on every rank: no collective
        written = list(optim_files.save(staging, tensors, skeleton, rank, world_size))
    if rank == 0:
        (staging / SKELETON).write_text(json.dumps(optim_shards.json_view(skeleton)))
        written.append(SKELETON)
    return written


def load_optimizer(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    group: Any,
    check: ContentCheck | None = None,
    balanced: DistContext | None = None,
) -> None:
    """Restore the optimizer state in place (collective over ``group`` for DCP's files).

    The state is read into the optimizer's current state tensors where they match in shape and
    dtype (an optimizer that has stepped), else into new ones (a fresh optimizer has no state
    yet), sharded like their parameter where it is a ``DTensor`` (DCP reshards: each rank reads
    its own shard, whatever the saving mesh was). Our own files are read whole by every rank,
    those of ``check``'s share digested as they pass; with ``balanced`` (a collective over it)
    each rank reads 1/N of their bytes and receives the rest.

    The saved param groups must be this optimizer's: the same count and the same parameters in
    each. Their saved hyperparameters then replace the current ones (the LR schedule's ``lr``);
    any other that changes is a warning. Checked before anything is read, by each rank from the
    same skeleton and its own optimizer (the same verdict on every rank, whose optimizers are built alike).

    Raises:
        ParamGroupsChanged: the groups differ (see :func:`param_groups_change`).
        ValueError: a state tensor missing from the files.
        UnsafeCheckpointError: DCP's ``.metadata`` asks to unpickle anything but DCP's classes.
    """
    skeleton = json.loads((directory / SKELETON).read_text())
    live = get_optimizer_state_dict(model, optimizer)
    skeleton["param_groups"] = tagged_json.decode(skeleton["param_groups"], tagged_json.tensor_from_json)
    if (change := param_groups_change(skeleton["param_groups"], live["param_groups"])) is not None:
        raise ParamGroupsChanged(
            f"optimizer: {directory.name} was saved with {change}. Loading would put the saved groups' hyperparameters "
            "on other groups. Resume with the param groups it was saved with, or load only its weights: "
            f"checkpoint.restore_from={str(directory)!r} with checkpoint.no_load_optim=true (a fresh optimizer; "
            "step counters, data order and RNG start fresh)"
        )
    if replaced := replaced_hyperparameters(skeleton["param_groups"], live["param_groups"]):
        log.warning("optimizer: %s's saved hyperparameters replace this optimizer's: %s", directory.name, "; ".join(replaced))
    current = live["state"]
    params: dict[str, Any] = {}  # the model's, fetched only for a target that does not fit (~20 ms on 200 tensors)
    tensors = {}
    state: dict[str, Any] = {}
    for fqn, entries in skeleton["state"].items():
        state[fqn] = {}
        for name, spec in entries.items():
            if "tensor" in spec:
                shape, dtype = spec["shape"], getattr(torch, spec["dtype"])
                mine = current.get(fqn, {}).get(name)
                fits = isinstance(mine, torch.Tensor) and mine.device.type == "cpu" and list(mine.shape) == shape and mine.dtype == dtype
                if not fits and not params:
                    params = get_model_state_dict(model)
                tensors[spec["tensor"]] = mine if fits else _target(params.get(fqn), shape, dtype)
            elif "value" in spec:  # written before values were tagged
                state[fqn][name] = spec["value"]
    if skeleton.get("storage") == optim_shards.STORAGE:
        optim_shards.load(directory, skeleton, tensors, check)  # each rank reads the pieces overlapping its blocks
    elif (directory / OPTIM_DIR / DCP_METADATA).is_file():
        from resilience.checkpoint.storage import dcp_io  # DCP, imported only for DCP's files

        dcp_io.load_tensors(tensors, directory / OPTIM_DIR, group=group)
    else:
        optim_files.load(directory, skeleton, tensors, check, balanced)
    for fqn, entries in skeleton["state"].items():
        for name, spec in entries.items():
            if "tensor" in spec and "part_of" not in spec:
                state[fqn][name] = tensors[spec["tensor"]]
            elif "tagged" in spec:

                def part_tensor(part: str, entries: dict[str, Any] = entries) -> torch.Tensor:  # a def: mypy infers no lambda with a default
                    return tensors[entries[part]["tensor"]]

                state[fqn][name] = tagged_json.decode(spec["tagged"], part_tensor)
    # Skeletons written before param groups were tagged hold lists where the optimizer uses tuples
    # (AdamW's ``betas``): give back the tuple form, so the restored groups equal the saved ones.
    for saved, current in zip(skeleton["param_groups"], optimizer.param_groups):
        for key, value in saved.items():
            if isinstance(value, list) and isinstance(current.get(key), tuple):
                saved[key] = tuple(value)
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": skeleton["param_groups"]})


def param_groups_change(saved: list[dict[str, Any]], current: list[dict[str, Any]]) -> str | None:
    """How the ``saved`` param groups differ from the ``current`` ones (both as
    ``get_optimizer_state_dict`` gives them: ``params`` as parameter names), or ``None`` when they
    have the same count and the same parameters in each group. Names each current group that
    differs, the saved group(s) its parameters were in and the hyperparameters whose values
    differ from those (saved -> current), and any saved parameter no group holds now."""
    if len(saved) == len(current) and all(list(a["params"]) == list(b["params"]) for a, b in zip(saved, current)):
        return None
    sizes = [[len(g["params"]) for g in groups] for groups in (saved, current)]
    parts = [f"{len(saved)} param group(s) of sizes {sizes[0]}, this optimizer has {len(current)} of sizes {sizes[1]}"]
    owner = {name: j for j, group in enumerate(saved) for name in group["params"]}
    for i, group in enumerate(current):
        if i < len(saved) and list(saved[i]["params"]) == list(group["params"]):
            continue
        sources = sorted({owner[n] for n in group["params"] if n in owner})
        origins = [f"from saved group {j}" + (f" ({', '.join(c)})" if (c := _value_changes(saved[j], group)) else "") for j in sources]
        new = [n for n in group["params"] if n not in owner]
        parts.append(f"group {i} {_names(group['params'])}: " + ", ".join(origins + ([f"{_names(new)} not in the checkpoint"] if new else [])))
    held = {name for group in current for name in group["params"]}
    for j, group in enumerate(saved):
        if gone := [n for n in group["params"] if n not in held]:
            parts.append(f"saved group {j}: {_names(gone)} in no group now")
    return "; ".join(parts) + " (saved -> current)"


def replaced_hyperparameters(saved: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[str]:
    """For groups that match (see :func:`param_groups_change`): each hyperparameter whose saved
    value replaces another current one, as ``"group I: KEY CURRENT -> SAVED"``; ``lr`` and
    ``initial_lr`` are left out (an LR schedule moves them), and so are ``momentum``/``betas`` in a
    group a momentum-cycling schedule manages (``OneCycleLR``/``CyclicLR`` add ``max_momentum``)."""
    return [f"group {i}: {change}" for i, (old, new) in enumerate(zip(saved, current)) for change in _value_changes(new, old, skip=_scheduled(old))]


def _scheduled(group: dict[str, Any]) -> tuple[str, ...]:
    cycled = ("momentum", "betas") if "max_momentum" in group else ()
    return ("lr", "initial_lr", *cycled)


def _value_changes(old: dict[str, Any], new: dict[str, Any], skip: tuple[str, ...] = ()) -> list[str]:
    """``"KEY OLD -> NEW"`` for each hyperparameter of either group whose values differ."""
    a, b = _hyper(old), _hyper(new)
    keys = sorted((a.keys() | b.keys()) - set(skip))
    return [f"{key} {a.get(key, '(none)')!r} -> {b.get(key, '(none)')!r}" for key in keys if key not in a or key not in b or not _equal(a[key], b[key])]


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key not in ("params", "param_names")}


def _names(params: list[Any], limit: int = 4) -> str:
    names = [str(n) for n in params]
    return repr(names) if len(names) <= limit else f"[{', '.join(map(repr, names[:limit]))}, ... {len(names)} in all]"


def _equal(a: Any, b: Any) -> bool:
    """Equal hyperparameter values (a tensor ``lr`` compared by value; a list equals a tuple,
    as skeletons written before tagged JSON hold AdamW's ``betas``)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _target(param: Any, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A new load target of ``shape`` and ``dtype`` for a state entry of ``param``: a ``DTensor``
    laid out like ``param`` when it is one of the same global shape (Adam's moments), else a
    plain tensor (a step counter, or a replicated model's state)."""
    if is_dtensor(param) and list(param.shape) == shape:
        return torch.empty_like(param, dtype=dtype)
    return torch.empty(shape, dtype=dtype)


def lr_scheduler_json(scheduler: Any) -> str:
    """An LR scheduler's ``state_dict()`` as JSON text (:mod:`resilience.state.tagged_json`),
    captured now (functions are dropped by torch). Plain ``json`` would turn ``MultiStepLR``'s
    milestones (a ``Counter`` keyed by step) into string keys, and the schedule would never
    decay again after a resume.

    Raises:
        TypeError: the state holds something the codec cannot represent (naming where).
    """
    return json.dumps(tagged_json.encode(scheduler.state_dict(), tagged_json.tensor_to_json, "lr_scheduler.state_dict()"))


def load_lr_scheduler(directory: Path, scheduler: Any) -> None:
    """Restore an LR scheduler from the JSON :func:`lr_scheduler_json` captured (saved as
    ``LR_SCHEDULER``; plain JSON of older checkpoints loads as it was written)."""
    state = tagged_json.decode(json.loads((directory / LR_SCHEDULER).read_text()), tagged_json.tensor_from_json)
    scheduler.load_state_dict(_int_keys_back(scheduler.state_dict(), state))


def _int_keys_back(live: Any, loaded: Any) -> Any:
    """``loaded`` with each dict whose keys plain JSON made strings (``{"6": 1}``) turned back into
    the live state's type with int keys, where the live state has int keys there: checkpoints
    written before the LR scheduler's state was tagged hold ``MultiStepLR``'s milestones so, and
    loading them as they are silently stops the decay."""
    if isinstance(live, dict) and type(loaded) is dict:  # a Counter the codec gave back is right already
        if live and all(isinstance(k, int) for k in live) and loaded and all(isinstance(k, str) and k.lstrip("-").isdigit() for k in loaded):
            return type(live)({int(k): v for k, v in loaded.items()})
        return {k: _int_keys_back(live[k], v) if k in live else v for k, v in loaded.items()}
    if isinstance(live, list) and isinstance(loaded, list) and len(live) == len(loaded):
        return [_int_keys_back(a, b) for a, b in zip(live, loaded)]
    return loaded
