"""A Llama-2-7B-shaped training state for one simulated rank: 291 fp32 weights and their Adam state.

``ddp``: every rank holds every tensor (a replicated model, as DDP's module holds it; the
checkpoint sees the module's own parameters). ``fsdp2``: every parameter is a ``DTensor`` with
FSDP2's placement, ``Shard(0)`` over a 1-D mesh of N ranks, the local block being the one torch
computes for this rank (uneven and empty shards included), built with ``DTensor.from_local``
under torch's fake process group (``fully_shard`` itself sets up the same placements but took
47 s of set-up at 8,192 ranks, none of it checkpointing). Adam's ``exp_avg``/``exp_avg_sq`` are
laid out like their parameter; ``step`` is a 0-d tensor on every rank, as Adam keeps it.

Tensors are ``torch.empty`` (CPU: never touched, so no memory is used for the 27 GB of weights
and 54 GB of moments) or on the ``meta`` device (the resume side of ``fsdp2``, whose loader copies
into the live shards).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 4096, 11008, 32000, 32
MODES = ("ddp", "fsdp2")


def tensor_shapes() -> dict[str, tuple[int, ...]]:
    """The 291 parameter names and shapes of Llama-2-7B (Hugging Face names), in state-dict order."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        prefix = f"model.layers.{i}."
        for name in "qkvo":
            shapes[f"{prefix}self_attn.{name}_proj.weight"] = (HIDDEN, HIDDEN)
        shapes[f"{prefix}mlp.gate_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[f"{prefix}mlp.up_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[f"{prefix}mlp.down_proj.weight"] = (HIDDEN, INTERMEDIATE)
        shapes[f"{prefix}input_layernorm.weight"] = (HIDDEN,)
        shapes[f"{prefix}post_attention_layernorm.weight"] = (HIDDEN,)
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def state_bytes() -> dict[str, int]:
    """Bytes of the full (unsharded) state: ``weights`` (fp32) and ``optimizer`` (two fp32 moments)."""
    weights = sum(math.prod(shape) for shape in tensor_shapes().values()) * 4
    return {"weights": weights, "optimizer": 2 * weights}


class _Node(nn.Module):
    """A bare module: the tree of names the parameters hang from (no forward)."""


def _module(tensors: dict[str, torch.Tensor]) -> nn.Module:
    root = _Node()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, _Node())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(tensor))
    return root


_STARTS: list[int] = []


def start_rank(mode: str, rank: int, world_size: int) -> Any:
    """Make this process rank ``rank`` of ``world_size`` for torch (``fsdp2``: the fake process
    group and a 1-D CPU mesh, returned; ``ddp``: nothing, ``None``). Undo with :func:`stop_rank`."""
    if mode != "fsdp2":
        return None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    # A dimension name per start: torch caches sharding results by mesh equality, and a later mesh
    # equal to an earlier one would be answered with the earlier one (and its rank) in this process.
    _STARTS.append(rank)
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=(f"shard{len(_STARTS)}",))


def stop_rank() -> None:
    """Tear down what :func:`start_rank` set up (a no-op for ``ddp``)."""
    if dist.is_initialized():
        dist.destroy_process_group()


@functools.cache
def local_block(shape: tuple[int, ...], rank: int, world_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local shape, global offsets)`` of rank ``rank``'s ``Shard(0)`` block of a tensor of
    ``shape`` over ``world_size`` ranks, from torch's own function (what DTensor and DCP use;
    ~0.1 ms a call, so cached: the state has five distinct shapes)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    return _compute_local_shape_and_global_offset(shape, (world_size,), [rank], [Shard(0)])


def build_state(mode: str, rank: int, world_size: int, mesh: Any, device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its Adam optimizer (one step's state) as rank ``rank`` of ``world_size`` holds them."""

    def make(shape: tuple[int, ...]) -> torch.Tensor:
        if mode == "ddp":
            return torch.empty(shape, device=device)
        from torch.distributed.tensor import DTensor, Shard

        local, _ = local_block(shape, rank, world_size)
        stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
        return DTensor.from_local(torch.empty(local, device=device), mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)

    model = _module({name: make(shape) for name, shape in tensor_shapes().items()})
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        optimizer.state[p] = {"step": torch.tensor(200.0), "exp_avg": torch.empty_like(p), "exp_avg_sq": torch.empty_like(p)}
    return model, optimizer
