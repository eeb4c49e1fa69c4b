"""The data position of one data-parallel rank.

A loader with ``state_dict()``/``load_state_dict()`` (torchdata's ``StatefulDataLoader``) saves
its own state as JSON. Any other iterable is resumed by replaying the epoch's sampler and
skipping the batches already consumed, which is exact for map-style datasets and costs one pass
over those batches. For the replay to draw the same order, the torch RNG state from just before
the epoch's iterator was created is saved too (``epoch_rng``) and set again before the replayed
``iter()``: a shuffling sampler without ``set_epoch`` (``DataLoader(shuffle=True)``) draws its
seed from the global RNG there, which by a later epoch training has moved on. So are the states
of the loader's own generators (``epoch_generators``: ``DataLoader(generator=g)``, a sampler's
``generator``, any ``torch.Generator`` attribute of a custom sampler), which a shuffling sampler
given one draws from instead and which move on every epoch too. A ``DataLoader`` with ``persistent_workers`` creates its iterator (drawing the
workers' base seed, then the order) only in its first epoch and resets it after, drawing only
the order (``epoch_reset_workers``): a replay of such a later epoch first starts the workers,
then sets the saved states and resets, so it draws what the original reset drew. Randomness
inside persistent workers (their own RNG, carried across epochs) is not replayed. A
``StatefulDataLoader`` skips the consumed samples without loading them, so random draws in its
workers need :class:`~resilience.state.worker_rng.WorkerRNG`.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from resilience.state import tagged_json

# loader -> what its current epoch's iterator was created from: {"rng": torch RNG state,
# "generators": {path: state} of the loader's own generators, "reset": persistent workers reset}
_EPOCH_START: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
# the objects of a DataLoader whose generators a shuffle draws from (one generator may sit in several)
_SAMPLER_PATHS = ("", "sampler", "batch_sampler", "batch_sampler.sampler")


def _encode(obj: Any) -> Any:
    """JSON-able form of a loader state (:mod:`resilience.state.tagged_json`): tensors (e.g. a
    shuffling sampler's generator state) inline, as ``{"__tensor__": {"dtype", "shape", "data"}}``."""
    return tagged_json.encode(obj, tagged_json.tensor_to_json, "dataloader.state_dict()")


def _decode(obj: Any) -> Any:
    return tagged_json.decode(obj, tagged_json.tensor_from_json)


def is_stateful(loader: Any) -> bool:
    """True when ``loader`` has ``state_dict`` and ``load_state_dict``."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def set_epoch(loader: Any, epoch: int) -> None:
    """Call ``set_epoch`` on the loader's sampler (``DistributedSampler``) and batch sampler if they have it,
    so each epoch's shuffle is a function of (seed, epoch) and can be replayed on resume."""
    setter = epoch_setter(loader)
    if setter is not None:
        setter.set_epoch(epoch)


def epoch_setter(loader: Any) -> Any:
    """The loader's sampler, batch sampler or the loader itself, the first with ``set_epoch``; else None."""
    for obj in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None), loader):
        if obj is not None and callable(getattr(obj, "set_epoch", None)):
            return obj
    return None


def data_position_json(loader: Any, batches_in_epoch: int) -> str:
    """The loader position as JSON text, captured now (a snapshot). Tensors in the loader's state
    (a shuffling sampler's generator) are encoded, never pickled.

    Raises:
        TypeError: the loader's state holds something JSON cannot represent.
    """
    try:
        state: dict[str, Any] = {"batches_in_epoch": batches_in_epoch, "loader": _encode(loader.state_dict()) if is_stateful(loader) else None}
        start = _epoch_start(loader) if not is_stateful(loader) else None
        if start is not None:
            state["epoch_rng"] = _encode(start["rng"])
            if start["generators"]:
                state["epoch_generators"] = {path: _encode(g) for path, g in start["generators"].items()}
            if start["reset"]:
                state["epoch_reset_workers"] = True
        return json.dumps(state)
    except TypeError as exc:
        raise TypeError(f"dataloader.state_dict() must be JSON-serialisable to be checkpointed: {exc}") from exc


def save_data_position(path: Path, loader: Any, batches_in_epoch: int) -> None:
    """Write the loader position as JSON (see :func:`data_position_json`)."""
    path.write_text(data_position_json(loader, batches_in_epoch))


def read_data_position(path: Path) -> dict[str, Any]:
    """The JSON written by :func:`save_data_position`."""
    return json.loads(path.read_text())


def resume_iterator(loader: Iterable, position: dict[str, Any] | None) -> Iterator:
    """An iterator over the rest of the current epoch.

    ``position`` is ``None`` for a fresh epoch. For a stateful loader its state is loaded before
    ``iter()``; otherwise the first ``batches_in_epoch`` batches are drawn and dropped.
    """
    if position is None:
        return _iter(loader)
    if is_stateful(loader) and position.get("loader") is not None:
        loader.load_state_dict(_decode(position["loader"]))
        return iter(loader)
    iterator = _replay_iter(loader, position)
    for _ in range(int(position["batches_in_epoch"])):
        next(iterator)
    return iterator


def epoch_iterator(loader: Iterable, position: dict[str, Any] | None) -> Iterator:
    """This epoch's batches from ``position`` on (see :func:`resume_iterator`).

    At a position at the epoch's end no batch is left, but the loader's iterator is still
    created: the run that saved created it too, and creating it draws from the global RNG.
    """
    if position is not None:
        length = loader_length(loader)
        if length is not None and position["batches_in_epoch"] >= length:
            _replay_iter(loader, position)
            return iter(())
    return resume_iterator(loader, position)


def _replay_iter(loader: Iterable, position: dict[str, Any]) -> Iterator:
    """``iter(loader)`` drawing what the saving run's ``iter()`` of this epoch drew (see the module doc)."""
    if position.get("epoch_reset_workers") and getattr(loader, "_iterator", None) is None:
        iter(loader)  # start the persistent workers, as an earlier epoch had; the iter() below resets them
    if position.get("epoch_rng") is not None:
        torch.set_rng_state(_decode(position["epoch_rng"]))
    generators = _generators(loader)
    for path, state in (position.get("epoch_generators") or {}).items():
        if path in generators:
            generators[path].set_state(_decode(state))
    return _iter(loader)


def _iter(loader: Iterable) -> Iterator:
    """``iter(loader)``, remembering what it started from (see the module doc)."""
    if not is_stateful(loader):
        start = {
            "rng": torch.get_rng_state(),
            "generators": {path: g.get_state() for path, g in _generators(loader).items()},
            "reset": bool(getattr(loader, "persistent_workers", False)) and getattr(loader, "_iterator", None) is not None,
        }
        try:
            _EPOCH_START[loader] = start
        except TypeError:  # not weak-referenceable (a list of batches): nothing to shuffle
            pass
    return iter(loader)


def _generators(loader: Any) -> dict[str, torch.Generator]:
    """The loader's own generators by attribute path, each object once: every ``torch.Generator``
    attribute of the loader, its sampler, batch sampler and the batch sampler's sampler
    (``generator``, ``sampler.generator``, or a custom sampler's ``sampler.g``)."""
    found: dict[str, torch.Generator] = {}
    for path in _SAMPLER_PATHS:
        obj = loader
        for name in filter(None, path.split(".")):
            obj = getattr(obj, name, None)
        for attr, value in list(getattr(obj, "__dict__", {}).items()):
            if isinstance(value, torch.Generator) and all(value is not g for g in found.values()):
                found[f"{path}.{attr}" if path else attr] = value
    return found


def _epoch_start(loader: Any) -> dict[str, Any] | None:
    try:
        return _EPOCH_START.get(loader)
    except TypeError:
        return None


def loader_length(loader: Any) -> int | None:
    """Batches per epoch of ``loader``; ``None`` when it has no length (an iterable dataset)."""
    try:
        return len(loader)
    except TypeError:
        return None
