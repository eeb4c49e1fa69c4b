"""Canonical parameter names (FQNs) as ``torch.distributed.checkpoint.state_dict`` (DCP) gives
them, for the models whose names depend on nothing but their module tree; and which models those are.

DCP's state-dict helpers strip the names wrappers add: DDP's ``module.``, ``torch.compile``'s
``_orig_mod.`` and activation checkpointing's ``_checkpoint_wrapped_module.``, so a checkpoint
loads whatever wraps the model. Importing them imports DTensor, FSDP and sympy (~0.5 s, ~1 s with
two ranks starting on two cores, on every restart). :func:`needs_dcp` says when a model needs
DCP's own helpers: a ``DTensor`` or ``ShardedTensor`` in its parameters, buffers or optimizer state,
an FSDP module (1 or 2), a module with DCP's ``_fqn_modifiers`` hook, or a state-dict function DCP
patched. Every other model is mapped here by a transcription of DCP's code for that case (torch
2.13 ``torch/distributed/checkpoint/state_dict.py``: ``_get_fqns`` without its FSDP branch and
``_fqn_modifiers``, ``_iterate_valid_model_state``, the name maps of ``_verify_options``), so the
names are DCP's; ``tests/checkpoint/test_state_dict_names.py`` compares both for every wrapper.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX
from torch.nn.parallel import DistributedDataParallel

from resilience.sharded_types import compiled_module_class, dtensor_class, fsdp_module_classes, loaded_class

CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."
"""``torch.distributed.algorithms._checkpoint.checkpoint_wrapper._CHECKPOINT_PREFIX`` (a test checks they agree)."""
FQN_MODIFIERS = "_fqn_modifiers"
"""DCP's ``StateDictOptions.dsd_fqn_modifiers``: a module hook that renames keys; DCP handles those models."""
DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict"


class ExtraState:
    """Stands for a module's ``get_extra_state()`` entry (DCP's ``_EXTRA_STATE``)."""


EXTRA_STATE = ExtraState()


def needs_dcp(model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...] = ()) -> bool:
    """Whether ``model`` (and ``optimizers``) need DCP's own state-dict helpers (see the module
    docstring); False means :func:`fqn` gives the names DCP would. Imports nothing."""
    patched = getattr(sys.modules.get(DCP_STATE_DICT), "_patched_state_dict", None)
    if patched:
        return True
    fsdp = fsdp_module_classes()
    for module in model.modules():
        if (fsdp and isinstance(module, fsdp)) or hasattr(module, FQN_MODIFIERS):
            return True
    special = tuple(cls for cls in (dtensor_class(), loaded_class("torch.distributed._shard.sharded_tensor", "ShardedTensor")) if cls is not None)
    if not special:
        return False
    if any(isinstance(t, special) for t in itertools.chain(model.parameters(), model.buffers())):
        return True
    return any(isinstance(v, special) for optim in optimizers for entries in optim.state.values() for v in entries.values())


def fqn(model: torch.nn.Module, name: str, *, skip_ddp_prefix: bool = True, skip_compiler_prefix: bool = True) -> str:
    """The canonical name of ``name`` (a key of ``model.state_dict()`` or ``named_parameters()``):
    DCP's ``_get_fqns`` for a model :func:`needs_dcp` turns away (one name, not a set).

    Raises:
        AssertionError: a DDP or compiled module's child is not ``module`` / ``_orig_mod``.
        AttributeError: a name that is not an attribute path of the model (DCP's error too).
    """
    name = name.replace(CHECKPOINT_PREFIX, "")
    if "." not in name:
        return name
    compiled: type[Any] | None = compiled_module_class()  # type[Any]: isinstance then narrows obj to Any (a bare type narrows it to object)
    obj_names = name.split(".")
    kept: list[str] = []
    obj: Any = model
    for i, part in enumerate(obj_names):
        if isinstance(obj, DistributedDataParallel):
            if part != "module":
                raise AssertionError(f"Expected 'module', got '{part}'")
            obj = obj.module
            if not skip_ddp_prefix:
                kept.append(part)
        elif compiled is not None and isinstance(obj, compiled):
            if part != "_orig_mod":
                raise AssertionError(f"Expected '_orig_mod', got '{part}'")
            obj = obj._orig_mod
            if not skip_compiler_prefix:
                kept.append(part)
        else:
            kept.append(part)
            if part == _EXTRA_STATE_KEY_SUFFIX:
                if i != len(obj_names) - 1:
                    raise RuntimeError("Expect `_extra_state` to be the last obj name")
            else:
                obj = getattr(obj, part)
    return ".".join(kept).replace(CHECKPOINT_PREFIX, "")


def valid_model_state(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` for every persistent buffer and parameter, each module once, and
    ``(name, EXTRA_STATE)`` for a module with its own ``get_extra_state``: DCP's
    ``_iterate_valid_model_state`` (names as the module tree spells them, wrappers included)."""
    visited: set[torch.nn.Module] = set()

    def recurse(module: torch.nn.Module, prefix: str) -> Iterator[tuple[str, Any]]:
        visited.add(module)
        prefix = f"{prefix}." if prefix else ""
        for name, child in module.named_children():
            if child in visited:
                continue
            yield from recurse(child, f"{prefix}{name}")
        for name, obj in itertools.chain(module.named_buffers(recurse=False), module.named_parameters(recurse=False)):
            if name in module._non_persistent_buffers_set:
                continue
            yield f"{prefix}{name}", obj
        if getattr(module.__class__, "get_extra_state", torch.nn.Module.get_extra_state) != torch.nn.Module.get_extra_state:
            yield f"{prefix}{_EXTRA_STATE_KEY_SUFFIX}", EXTRA_STATE

    yield from recurse(model, "")


class NameMaps:
    """DCP's ``fqn_param_mapping`` and ``shared_params_mapping`` (``_verify_options``), keyed by
    the tensor's ``id`` where DCP keys by the tensor: every name of each parameter or buffer
    (several for tied ones, in a set built as DCP builds it), and the names shared by several."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.names: dict[int, set[str]] = {}
        self.tensor: dict[str, torch.Tensor] = {}
        self.shared: set[str] = set()
        shared_ids: list[int] = []
        for name, t in valid_model_state(model):
            if t is EXTRA_STATE:
                continue
            names = {fqn(model, name)}
            known = self.names.get(id(t))
            if known is not None:
                known.update(names)
                shared_ids.append(id(t))
            else:
                self.names[id(t)] = names.copy()
            for n in names:
                self.tensor[n] = t
        for key in shared_ids:
            self.shared.update(self.names[key])

    def of(self, param: torch.Tensor) -> set[str]:
        """The names of ``param`` (KeyError for a tensor the model does not hold, as DCP)."""
        return self.names[id(param)]
