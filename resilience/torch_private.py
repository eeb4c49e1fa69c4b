"""The torch internals ``resilience`` relies on, in one place, each chosen by torch's version.

``pyproject.toml`` admits torch >= 2.4; everything here was checked on 2.4-era paths and on
2.13. Where an internal moved (``torch.distributed._tensor`` became ``torch.distributed.tensor``
in 2.5) the version picks the path; where one may vanish (a ``DataLoader`` iterator's private
sampler iterator), the accessor returns ``None`` and its caller keeps a public fallback.
``tests/state/test_torch_private.py`` checks each against the installed torch, so a torch that
moved one fails there, not silently in a resume.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch

_MAJOR, _MINOR = torch.__version__.split(".")[:2]
TORCH_VERSION: tuple[int, int] = (int(_MAJOR), int(_MINOR))
"""(major, minor) of the torch imported, e.g. ``(2, 13)``."""

_PUBLIC_DTENSOR = TORCH_VERSION >= (2, 5)  # torch.distributed.tensor is public from 2.5 (was ._tensor)


def local_shape_and_offset(t: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape and global offsets (elements, per dim) of the block of ``DTensor`` ``t`` this rank
    holds: torch's ``compute_local_shape_and_global_offset`` (``torch.distributed.tensor._utils``;
    ``torch.distributed._tensor._utils`` before 2.5), imported at its first use (a ``DTensor``
    exists, so its package is loaded already).

    Memoized by the values torch's function reads (torch 2.13): the global shape, the mesh's
    shape, this rank's mesh coordinate and the ``Shard``-like placements (dim, split factor); not
    the mesh object, so no mesh or process group is kept alive. It costs ~40 us a call (~4 us
    memoized), and a load asks it for every tensor of the model and optimizer more than once
    (~1,000 calls, ~40 ms of CPU per load of the bench's 201-tensor FSDP2 state, bench/README.md),
    while a model holds few distinct shapes. Not memoized under torch's ``LocalTensorMode`` (one
    process playing every rank) or a fake mode (tracing: symbolic coordinates), nor for a key that
    cannot be hashed (symbolic shapes)."""
    mesh, placements = t.device_mesh, tuple(t.placements)
    coordinate = mesh.get_coordinate()
    if _tracing_or_local():
        return _compute_local_block(tuple(t.shape), mesh, placements)
    key = (tuple(t.shape), tuple(mesh.shape), None if coordinate is None else tuple(coordinate), tuple(_placement_key(p) for p in placements))
    try:
        found = _LOCAL_BLOCKS.get(key)
    except TypeError:  # a SymInt in the shape or coordinate
        return _compute_local_block(tuple(t.shape), mesh, placements)
    if found is None:
        if len(_LOCAL_BLOCKS) >= _LOCAL_BLOCKS_MAX:
            _LOCAL_BLOCKS.clear()
        found = _LOCAL_BLOCKS[key] = _compute_local_block(tuple(t.shape), mesh, placements)
    return found


_LOCAL_BLOCKS: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}
_LOCAL_BLOCKS_MAX = 4096  # keys; cleared when full (a model holds far fewer distinct ones)


def _placement_key(p: Any) -> tuple[Any, ...]:
    """What torch's function reads of a placement: its class and, for ``Shard``/``_StridedShard``,
    the dim and split factor (``Replicate``/``Partial`` are skipped by it, their data unread)."""
    return (type(p), getattr(p, "dim", None), getattr(p, "split_factor", None))


def _compute_local_block(shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if _PUBLIC_DTENSOR:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    else:  # pragma: no cover - torch < 2.5 only
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset  # type: ignore[import-not-found, no-redef]
    local, offsets = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    return tuple(local), tuple(offsets)


def _tracing_or_local() -> bool:
    """Whether torch's ``LocalTensorMode`` (``torch.distributed._local_tensor``, torch >= 2.9: one
    process computes every simulated rank's block) or a fake tensor mode (tracing) is on: then
    nothing may be memoized."""
    module = sys.modules.get("torch.distributed._local_tensor")
    enabled = getattr(module, "enabled_local_tensor_mode", None)
    if enabled is not None and enabled() is not None:
        return True
    fake = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)  # an active FakeTensorMode
    return fake is not None and torch._C._get_dispatch_mode(fake) is not None


def placement_classes() -> tuple[type, type]:
    """DTensor's ``Replicate`` and ``Shard`` classes (public in ``torch.distributed.tensor`` from 2.5);
    ask only once a ``DTensor`` exists, so the import costs nothing new."""
    if _PUBLIC_DTENSOR:
        from torch.distributed.tensor import Replicate, Shard
    else:  # pragma: no cover - torch < 2.5 only
        from torch.distributed._tensor import Replicate, Shard
    return Replicate, Shard


def dataloader_sampler_iter(iterator: Any) -> Iterator[Any] | None:
    """The iterator over the batch sampler's index lists of a ``torch.utils.data.DataLoader``
    iterator (``_BaseDataLoaderIter._sampler_iter``, torch 1.x-2.13): running it draws the epoch's
    indices, and the sampler's own random draws, without loading any data. ``None`` for any other
    iterator, or a torch without that attribute."""
    if type(iterator).__module__ != "torch.utils.data.dataloader":
        return None
    indices = getattr(iterator, "_sampler_iter", None)
    return indices if isinstance(indices, Iterator) else None
