"""Optimizer state every rank holds in full (a plain or DDP model) as our own safetensors files.

::

    optim/shard-00001-of-00002.safetensors   rank 0's share of the state tensors
    optim/shard-00002-of-00002.safetensors   rank 1's share
    optim/skeleton.json                      the structure; each tensor's ``"file"``; ``"files"``

As the model's weights are written: the tensors are split over the ranks by size
(:func:`~resilience.checkpoint.balance.balance`, the same answer on every rank without a
collective), so each rank writes ~1/N of the bytes, digested while written
(:func:`~resilience.checkpoint.storage.safetensors_file.write_safetensors`); only ranks that own
tensors write a file, and ``"files"`` lists those (checkpoints written before list every rank's,
empty or not). Loading reads straight into the optimizer's live tensors where they fit, under
any world size: balanced (``checkpoint.load_balanced``, world size > 1), each rank reads 1/N of
the bytes and receives the rest (:mod:`~resilience.checkpoint.formats.balanced_load`); else
every rank reads every file, digesting the files of its share as their bytes pass. DCP's per-item serialisation cost ~3x the CPU of
``torch.save`` per byte saved and left the load at half the disk's read rate (bench/README.md).

Sharded state (any ``DTensor``) stays with DCP, which reshards; so does state the ranks do not
all hold alike (checked with one small all-gather per save).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

from resilience.checkpoint.balance import balance
from resilience.checkpoint.formats.balanced_load import load as stream_load
from resilience.checkpoint.formats.balanced_load import stream_files
from resilience.checkpoint.formats.pieces import block_of, local_tensor
from resilience.checkpoint.layout import OPTIM_DIR, optim_shard_name
from resilience.checkpoint.storage.content_check import ContentCheck
from resilience.checkpoint.storage.durable import FileRecord
from resilience.checkpoint.storage.safetensors_file import read_safetensors, write_safetensors
from resilience.distributed import DistContext
from resilience.sharded_types import any_dtensor, is_dtensor

STORAGE = "safetensors"  # skeleton.json's "storage" for these files (absent: DCP's)


def replicated(tensors: dict[str, torch.Tensor], world_size: int, gather: Callable[[Any], list[Any]] | None, same: Callable[[str], bool] | None = None) -> bool:
    """Whether ``tensors`` (the optimizer's, by key) are held in full and alike by every rank:
    no ``DTensor``, and the same keys, shapes and dtypes on every rank. With ``same``
    (``DistContext.same_everywhere``: one all-reduce of two int64s, O(1) bytes per rank at any N)
    the fingerprints are compared through it; else, when ``world_size > 1``, all-gathered through
    ``gather`` (every rank receives N fingerprints); with neither, False. The same answer on
    every rank."""
    sharded = any_dtensor(tensors.values())
    if world_size == 1 or (gather is None and same is None):
        return not sharded and world_size == 1
    mine = None if sharded else xxhash.xxh3_128_hexdigest(json.dumps([[key, list(t.shape), str(t.dtype)] for key, t in tensors.items()]).encode())
    if same is not None:  # a sharded rank's "sharded" differs from any digest: then False everywhere
        return same(mine or "f" * 32) and not sharded
    assert gather is not None  # world_size > 1 and no same: returned above when gather is None too
    views = gather(mine)
    return views[0] is not None and all(view == views[0] for view in views)


def assign(tensors: dict[str, torch.Tensor], skeleton: dict[str, Any], world_size: int) -> None:
    """Give each tensor of ``skeleton`` (see ``optim_io``) the file of the rank that writes it,
    balanced by bytes (every rank computes the same); record the storage and the file list."""
    owner = balance({key: t.numel() * t.element_size() for key, t in tensors.items()}, world_size) if world_size > 1 else dict.fromkeys(tensors, 0)
    for entries in skeleton["state"].values():
        for spec in entries.values():
            if "tensor" in spec:
                spec["file"] = optim_shard_name(owner[spec["tensor"]] + 1, world_size)
    skeleton["storage"] = STORAGE
    skeleton["files"] = [optim_shard_name(r + 1, world_size) for r in sorted(set(owner.values()))]  # no empty files


def save(staging: Path, tensors: dict[str, torch.Tensor], skeleton: dict[str, Any], rank: int, world_size: int) -> list[FileRecord]:
    """Write this rank's file of an :func:`assign`-ed ``skeleton`` under ``staging/optim/``, when
    it owns tensors; returns its record (digested and fsync'd while written), or nothing.

    Raises:
        OSError: from the writes; TypeError: a dtype safetensors cannot store.
    """
    (staging / OPTIM_DIR).mkdir(exist_ok=True)  # skeleton.json goes there, tensors or not
    name = optim_shard_name(rank + 1, world_size)
    if name not in skeleton["files"]:
        return []
    mine = {spec["tensor"]: spec for entries in skeleton["state"].values() for spec in entries.values() if spec.get("file") == name}
    out = {key: tensors[key].detach().cpu().contiguous() for key in mine}  # copies only off-CPU or strided state
    return [write_safetensors(staging / OPTIM_DIR / name, out, f"{OPTIM_DIR}/{name}")]


def load(
    directory: Path, skeleton: dict[str, Any], targets: dict[str, torch.Tensor], check: ContentCheck | None = None, balanced: DistContext | None = None
) -> None:
    """Fill ``targets`` (key -> the tensor to restore: the optimizer's live one, or a new one)
    from the files of ``skeleton``: read straight into a target that is a contiguous CPU tensor
    of the stored shape and dtype; copied into one of that shape and dtype elsewhere (a GPU, a
    ``DTensor``: its local block); replaced otherwise. Each file of ``check``'s share is
    digested as it is read. ``balanced`` (a collective over it): each rank reads 1/N of the
    files' bytes and receives the rest (:mod:`~resilience.checkpoint.formats.balanced_load`).

    Raises:
        ValueError: a tensor of the skeleton in no file, or a malformed file.
    """
    wanted = {spec["tensor"]: spec for entries in skeleton["state"].values() for spec in entries.values() if "tensor" in spec}
    if balanced is not None:
        specs: dict[str, dict[str, Any]] = {}
        for key, spec in wanted.items():
            specs.setdefault(f"{OPTIM_DIR}/{spec['file']}", {})[key] = (getattr(torch, spec["dtype"]), list(spec["shape"]))
        rels = stream_files("optim", check, [f"{OPTIM_DIR}/{name}" for name in skeleton["files"]])
        got = stream_load(balanced, directory, rels, specs, {k: t for k, t in targets.items() if not is_dtensor(t)}, check)
        with torch.no_grad():
            for key, t in got.items():
                targets[key] = _place(targets[key], t) if key in targets else t
        return
    found: set[str] = set()
    for name in skeleton["files"]:
        rel = f"{OPTIM_DIR}/{name}"
        inplace = {key: t for key, t in targets.items() if wanted.get(key, {}).get("file") == name and not is_dtensor(t)}
        hasher = check.claim(rel) if check is not None else None  # digest the bytes as they pass
        got = read_safetensors(directory / rel, inplace, digest=hasher)
        if check is not None and hasher is not None:
            check.report(rel, hasher)
        with torch.no_grad():
            for key, t in got.items():
                if key in targets:
                    targets[key] = _place(targets[key], t)
        found.update(got)
    missing = sorted(set(wanted) - found)
    if missing:
        raise ValueError(f"{directory / OPTIM_DIR}: {len(missing)} optimizer tensors are in no file ({', '.join(missing[:3])} ...)")


def _place(target: torch.Tensor, loaded: torch.Tensor) -> torch.Tensor:
    """``loaded``'s values in ``target`` when it can hold them (the target returned), else ``loaded``."""
    if loaded is target:
        return target
    if is_dtensor(target) and list(target.shape) == list(loaded.shape):
        block = block_of(target)
        local_tensor(target).copy_(loaded[tuple(slice(o, o + n) for o, n in zip(block.offsets, block.shape))])
        return target
    if not is_dtensor(target) and target.shape == loaded.shape and target.dtype == loaded.dtype:
        target.copy_(loaded)
        return target
    return loaded
