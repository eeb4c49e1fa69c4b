"""Is this a ``DTensor``, a ``ShardedTensor``, an FSDP module? Answered without importing them.

``import torch.distributed.tensor`` costs ~0.4 s on a 2-core machine (``sympy`` and DTensor's
operator tables), ~0.8 s with two ranks starting at once, on every restart, for models that hold
no ``DTensor`` at all. An instance of a class cannot exist before the module defining it has been
imported (a submodule imports its package first: ``torch.distributed.tensor._api`` is only ever
loaded after ``torch.distributed.tensor``), so when ``sys.modules`` lacks the module, the answer
is "no" with certainty; when it has it, the answer is ``isinstance`` against its class, as
before. Nothing here imports a module that was not imported already.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:  # for the annotations only: importing it costs what this module avoids
    from torch.distributed.tensor import DTensor

DTENSOR_MODULE = "torch.distributed.tensor"  # torch.distributed._tensor (torch < 2.5 and the alias) imports it
SHARDED_TENSOR_MODULE = "torch.distributed._shard.sharded_tensor"
FSDP_MODULE = "torch.distributed.fsdp"  # FSDP1's FullyShardedDataParallel and FSDP2's FSDPModule
DYNAMO_EVAL_FRAME = "torch._dynamo.eval_frame"  # torch.compile's OptimizedModule


def loaded_class(module: str, name: str) -> type | None:
    """``module.name`` when ``module`` has been imported (and defines it by now), else ``None``."""
    mod = sys.modules.get(module)
    cls = getattr(mod, name, None) if mod is not None else None
    return cls if isinstance(cls, type) else None


def dtensor_class() -> type | None:
    """torch's ``DTensor`` class, or ``None`` when no ``DTensor`` can exist yet in this process."""
    return loaded_class(DTENSOR_MODULE, "DTensor") or loaded_class("torch.distributed._tensor", "DTensor")


def is_dtensor(obj: Any) -> TypeGuard[DTensor]:
    """``isinstance(obj, DTensor)``, without importing ``DTensor``."""
    cls = dtensor_class()
    return cls is not None and isinstance(obj, cls)


def any_dtensor(values: Iterable[Any]) -> bool:
    """Whether any of ``values`` is a ``DTensor`` (False at once when none can exist)."""
    cls = dtensor_class()
    return cls is not None and any(isinstance(v, cls) for v in values)


def is_sharded_tensor(obj: Any) -> bool:
    """``isinstance(obj, ShardedTensor)`` (FSDP1's and ``torch.distributed._shard``'s), without importing it."""
    cls = loaded_class(SHARDED_TENSOR_MODULE, "ShardedTensor")
    return cls is not None and isinstance(obj, cls)


def fsdp_module_classes() -> tuple[type, ...]:
    """The FSDP wrapper classes that exist in this process: FSDP1's ``FullyShardedDataParallel``
    and FSDP2's ``FSDPModule`` (empty when ``torch.distributed.fsdp`` was never imported)."""
    return tuple(cls for name in ("FullyShardedDataParallel", "FSDPModule") if (cls := loaded_class(FSDP_MODULE, name)) is not None)


def compiled_module_class() -> type | None:
    """``torch._dynamo.eval_frame.OptimizedModule`` (what ``torch.compile`` wraps a module in), or
    ``None`` when ``torch.compile`` never ran in this process."""
    return loaded_class(DYNAMO_EVAL_FRAME, "OptimizedModule")
