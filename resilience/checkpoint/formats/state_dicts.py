"""The model's and optimizer's state dicts by canonical names: DCP's five state-dict helpers, the
same names and signatures, importing DCP only for the models that need it.

``get_model_state_dict``, ``get_optimizer_state_dict``, ``get_state_dict``,
``set_model_state_dict`` and ``set_optimizer_state_dict`` of
``torch.distributed.checkpoint.state_dict`` are what the checkpoint's formats call. For a model
:func:`~resilience.checkpoint.formats.state_dict_names.needs_dcp` sends to DCP (sharded, FSDP,
anything unusual) they are DCP's, imported at the first call. For the others (plain, DDP,
``torch.compile``'d, activation-checkpointed) they run a transcription of DCP's code for that case
(torch 2.13: ``_get_model_state_dict``, ``_load_model_state_dict``, ``_init_optim_state``,
``_get_optim_state_dict``, ``_split_optim_state_dict``, ``_load_optim_state_dict`` and
``_verify_state_dict``, with DCP's default options, without the FSDP, full-state and broadcast
branches that case never takes): the same keys in the same order, the same values (the live
tensors), the same side effects (a fresh optimizer gets its state from a zero-gradient ``step()``
at lr 0, as DCP gives it) and the same errors. A flattened optimizer state dict (no ``"state"``
key) goes to DCP too.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
from collections.abc import Iterator
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.module import _IncompatibleKeys

from resilience.checkpoint.formats.state_dict_names import EXTRA_STATE, NameMaps, fqn, needs_dcp, valid_model_state

_STATE, _PG, _PARAMS = "state", "param_groups", "params"


def _dcp() -> Any:
    """``torch.distributed.checkpoint.state_dict``, imported now (DTensor, FSDP and sympy with it)."""
    return importlib.import_module("torch.distributed.checkpoint.state_dict")


@contextlib.contextmanager
def _gc_off() -> Iterator[None]:
    """DCP's ``_gc_context``: no garbage collection while the maps are built."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def get_model_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """DCP's ``get_model_state_dict(model)``: ``model.state_dict()`` keyed by canonical names.

    Raises:
        RuntimeError: the model has no state (DCP's error).
    """
    if needs_dcp(model):
        return _dcp().get_model_state_dict(model)
    with _gc_off():
        state = _model_state(model)
        _verify(state, None, model=True)
        return state


def get_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """DCP's ``get_optimizer_state_dict(model, optimizer)``: ``optimizer.state_dict()`` with every
    parameter id replaced by its canonical name (a fresh optimizer's state created first, see the module docstring).

    Raises:
        KeyError: state for a parameter the model does not hold (as DCP).
    """
    if needs_dcp(model, (optimizer,)):
        return _dcp().get_optimizer_state_dict(model, optimizer)
    with _gc_off():
        osd = _optim_state(model, (optimizer,))
        _verify({}, osd, model=False)
        return osd


def get_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's ``get_state_dict(model, optimizer)``: both of the above in one call."""
    if needs_dcp(model, (optimizer,)):
        return _dcp().get_state_dict(model, optimizer)
    with _gc_off():
        state = _model_state(model)
        osd = _optim_state(model, (optimizer,))
        _verify(state, osd, model=True)
        return state, osd


def set_model_state_dict(model: torch.nn.Module, model_state_dict: dict[str, Any]) -> _IncompatibleKeys:
    """DCP's ``set_model_state_dict(model, state)`` (strict): ``model.load_state_dict`` after
    giving each canonical key back the name the model spells it with (``module.``, ``_orig_mod.``);
    ``model_state_dict`` is changed in place, as DCP does.

    Raises:
        RuntimeError: an empty state, or a missing key (DCP's and ``load_state_dict``'s errors).
    """
    if needs_dcp(model):
        return _dcp().set_model_state_dict(model, model_state_dict)
    with _gc_off():
        _verify(model_state_dict, None, model=True)
        return _load_model_state(model, model_state_dict)


def set_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, optim_state_dict: dict[str, Any]) -> None:
    """DCP's ``set_optimizer_state_dict(model, optimizer, state)`` (strict): the state keyed by
    canonical names split into this optimizer's groups and loaded with ``optimizer.load_state_dict``.

    Raises:
        RuntimeError: an empty state, or a parameter that requires grad without saved state.
        ValueError: groups without parameters DCP cannot match.
    """
    if needs_dcp(model, (optimizer,)) or (optim_state_dict and _STATE not in optim_state_dict):
        _dcp().set_optimizer_state_dict(model, optimizer, optim_state_dict)
        return
    with _gc_off():
        names = NameMaps(model)
        _verify({}, optim_state_dict, model=False)
        with torch.no_grad():
            _init_optim_state(optimizer)
            osd = _split_optim_state(optimizer, optim_state_dict, names) if optim_state_dict else {}
            optimizer.load_state_dict(state_dict=osd)


# -- DCP's code for models without DTensor or FSDP (torch 2.13) -----------------------------------
def _verify(model_state: dict[str, Any], optim_state: dict[str, Any] | None, *, model: bool) -> None:
    """DCP's ``_verify_state_dict`` with its default options."""
    if model and not model_state:
        raise RuntimeError(f"The option indicates that model state_dict is required to save or load, but model state_dict is empty.rank = {dist.get_rank()=}.")
    if optim_state is not None and not optim_state:
        raise RuntimeError(f"The option indicates that model state_dict is required to save, or load but optim state_dict is empty. {optim_state}")
    for key in model_state:
        if "_flat_param" in key:
            raise RuntimeError(f"{key} contains _flat_param. This can happen if the model is not the root module.")


@torch.no_grad()
def _model_state(model: torch.nn.Module) -> dict[str, Any]:
    """DCP's ``_get_model_state_dict``: renamed keys are moved to the end, in order, as DCP does."""
    state = model.state_dict()
    for key in list(state.keys()):
        name = fqn(model, key)
        if name != key:
            if not _wrapper_prefixes_only(key, name):
                raise RuntimeError(f"An unexpected key, {key}, exists. FQN is {name}")
            state[name] = state.pop(key)
    return state


def _wrapper_prefixes_only(key: str, name: str) -> bool:
    """DCP's ``verify``: ``key`` is ``name`` with only ``module``/``_orig_mod`` parts added."""
    if len(name) >= len(key):
        return False
    name_split, key_split = name.split("."), key.split(".")
    at = 0
    for key_idx, part in enumerate(key_split):
        if part == name_split[at]:
            at += 1
            if at == len(name_split):
                return key_idx == len(key_split) - 1
        elif part in ("module", "_orig_mod"):
            continue
        else:
            return False
    return True


@torch.no_grad()
def _load_model_state(model: torch.nn.Module, state_dict: dict[str, Any]) -> _IncompatibleKeys:
    """DCP's ``_load_model_state_dict`` (strict, no broadcast, not full)."""
    if not state_dict:
        return _IncompatibleKeys({}, {})
    for key, _ in valid_model_state(model):
        plain, spelled = fqn(model, key), fqn(model, key, skip_ddp_prefix=False, skip_compiler_prefix=False)
        if plain != spelled:
            value = state_dict.pop(plain, None)
            if value is None:
                raise RuntimeError(f"Missing key: {plain}.")
            state_dict[spelled] = value
    return model.load_state_dict(state_dict=state_dict, strict=True, assign=False)


def _init_optim_state(optim: torch.optim.Optimizer) -> None:
    """DCP's ``_init_optim_state``: a fresh optimizer's state from one ``step()`` with zero
    gradients at lr 0 (nothing changes where gradients exist or state does)."""
    if optim.state:
        return
    for group in optim.param_groups:
        for param in group[_PARAMS]:
            if param.grad is not None:
                return
    for group in optim.param_groups:
        for param in group[_PARAMS]:
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    lrs = []
    for group in optim.param_groups:
        if "lr" in group:
            lrs.append(group["lr"])
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optim.step(closure=None)
    for group in optim.param_groups:
        if "lr" in group:
            group["lr"] = lrs.pop(0)
    optim.zero_grad(set_to_none=True)


@torch.no_grad()
def _optim_state(model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]) -> dict[str, Any]:
    """DCP's ``_get_optim_state_dict`` for a model without FSDP."""
    out: dict[str, Any] = {_STATE: {}, _PG: []}
    for optim in optimizers:
        _init_optim_state(optim)
        osd = optim.state_dict()
        params = list(chain.from_iterable(g[_PARAMS] for g in optim.param_groups))
        position = {id(p): i for i, p in enumerate(params)}
        by: dict[Any, Any] = {}
        for key, param in model.named_parameters():
            name = fqn(model, key)
            if id(param) not in position:
                continue
            pid = position[id(param)]
            by[name] = pid
            by[pid] = name
        for key in list(osd[_STATE].keys()):
            osd[_STATE][by[key]] = osd[_STATE].pop(key)
        for group in osd[_PG]:
            group[_PARAMS] = [by[pid] for pid in group[_PARAMS]]
        if not osd:
            continue
        out[_STATE].update(osd[_STATE])
        out[_PG].extend(osd[_PG])
    return out


def _split_optim_state(optim: torch.optim.Optimizer, osd: dict[str, Any], names: NameMaps) -> dict[str, Any]:
    """DCP's ``_split_optim_state_dict`` (strict): the part of ``osd`` for ``optim``'s groups."""
    state: dict[str, Any] = {}
    pg_state: list[dict[str, Any]] = []
    out = {_STATE: state, _PG: pg_state}
    pg_mapping: dict[int, int] = {}
    if all(isinstance(k, int) for k in osd[_STATE]):
        return osd
    loaded_group: Any = None
    for group in optim.param_groups:
        pg_state.append({_PARAMS: []})
        for param in group[_PARAMS]:
            for name in names.of(param):
                if name in names.shared and not any(name in g[_PARAMS] for g in osd[_PG]):
                    continue
                pg_state[-1][_PARAMS].append(name)
                if param.requires_grad:
                    if name in osd[_STATE]:
                        state[name] = osd[_STATE][name]
                    else:
                        raise RuntimeError(
                            f"Missing optimizer state for parameter '{name}' in checkpoint. "
                            "The parameter requires gradients but has no saved optimizer state. "
                            "To load anyway, use StateDictOptions(strict=False)."
                        )
                for loaded_group in osd[_PG]:
                    if name in loaded_group[_PARAMS]:
                        pg_mapping[id(loaded_group)] = len(pg_state) - 1
        if len(group[_PARAMS]) == 0:
            empty = []
            for loaded_group in osd[_PG]:  # DCP maps the last loaded group below (its loop variable)
                if len(loaded_group[_PARAMS]) == 0:
                    empty.append(loaded_group)
            if len(empty) != 1:
                raise ValueError(
                    "There are param groups that have zero parameters. In such a case, DSD only support exactly one param group "
                    "with zero parameters.But the loaded state_dict has zero or more than one param groups that have zero parameters."
                )
            if len(osd[_PG]) != len(optim.param_groups):
                raise ValueError("When there is a parameter group that has zero parameters, multiple optimizers are not supported.")
            pg_mapping[id(loaded_group)] = len(pg_state) - 1
    for loaded in osd[_PG]:
        at = pg_mapping.get(id(loaded), -1)
        if at == -1:
            continue
        for key, value in loaded.items():
            if key != _PARAMS:
                pg_state[at][key] = value
    return out


__all__ = ["EXTRA_STATE", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict", "set_model_state_dict", "set_optimizer_state_dict"]
