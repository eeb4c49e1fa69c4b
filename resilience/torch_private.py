"""The torch internals ``resilience`` relies on, in one place, each chosen by torch's version.

``pyproject.toml`` admits torch >= 2.4; everything here was checked on 2.4-era paths and on
2.13. Where an internal moved (``torch.distributed._tensor`` became ``torch.distributed.tensor``
in 2.5) the version picks the path; where one may vanish (a ``DataLoader`` iterator's private
sampler iterator), the accessor returns ``None`` and its caller keeps a public fallback.
``tests/state/test_torch_private.py`` checks each against the installed torch, so a torch that
moved one fails there, not silently in a resume.
"""

from __future__ import annotations

import functools
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

    Memoized by global shape, mesh, placements and this rank's mesh coordinate, the only inputs
    torch's function reads: it costs ~40 us a call in torch 2.13 (2.5 us memoized), and a load
    asks it for every tensor of the model and optimizer more than once (~1,000 calls, ~40 ms of
    CPU per load of the bench's 201-tensor FSDP2 state, bench/README.md), while a model holds few
    distinct shapes.
    Not memoized under torch's ``LocalTensorMode`` (one process playing every rank)."""
    mesh, placements = t.device_mesh, tuple(t.placements)
    if _local_tensor_mode():
        return _compute_local_block(tuple(t.shape), mesh, placements)
    coordinate = mesh.get_coordinate()
    return _cached_local_block(tuple(t.shape), mesh, placements, None if coordinate is None else tuple(coordinate))


@functools.lru_cache(maxsize=4096)
def _cached_local_block(
    shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...], coordinate: tuple[int, ...] | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """:func:`_compute_local_block`, once per key (``coordinate``: in the key only, so an equal mesh
    on another rank of the same process, after a new process group, is another entry)."""
    return _compute_local_block(shape, mesh, placements)


def _compute_local_block(shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if _PUBLIC_DTENSOR:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    else:  # pragma: no cover - torch < 2.5 only
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset  # type: ignore[import-not-found, no-redef]
    local, offsets = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    return tuple(local), tuple(offsets)


def _local_tensor_mode() -> bool:
    """Whether torch's ``LocalTensorMode`` (``torch.distributed._local_tensor``, torch >= 2.9) is
    on: then one process computes every simulated rank's block, and nothing may be memoized."""
    module = sys.modules.get("torch.distributed._local_tensor")
    enabled = getattr(module, "enabled_local_tensor_mode", None)
    return enabled is not None and enabled() is not None


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
