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

A loader's own state is used when its ``state_dict()`` works: :func:`check_loader_state` calls it
once at ``resilient_loop()`` and a loader whose call raises (Accelerate's prepared ``DataLoader``:
``AttributeError`` for its missing ``dl_state_dict``) is replayed instead, as is one whose call
raises at a save. The loader's generators at the epoch's start (``epoch_generators``) are saved
with its own state too and set before that is loaded: Accelerate's ``use_stateful_dataloader``
state leaves its sampler's generator out. A lazy ``__iter__`` (a generator function, as Accelerate's prepared loaders)
creates the loader's iterator, drawing from the global RNG, only at its first ``next()``; a resumed
iterator that has drawn no batch yet is started before the saved RNG is restored (:func:`_started`).
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeGuard

import torch

from resilience.state import tagged_json
from resilience.torch_private import dataloader_sampler_iter

log = logging.getLogger("resilience")

# loader -> what its current epoch's iterator was created from: {"rng": torch RNG state,
# "generators": {path: state} of the loader's own generators, "reset": persistent workers reset}
_EPOCH_START: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
# the objects of a DataLoader whose generators a shuffle draws from (one generator may sit in several)
_SAMPLER_PATHS = ("", "sampler", "batch_sampler", "batch_sampler.sampler")
# loaders with state_dict()/load_state_dict() whose state_dict() raised: replayed instead
_REPLAYED: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _encode(obj: Any) -> Any:
    """JSON-able form of a loader state (:mod:`resilience.state.tagged_json`): tensors (e.g. a
    shuffling sampler's generator state) inline, as ``{"__tensor__": {"dtype", "shape", "data"}}``."""
    return tagged_json.encode(obj, tagged_json.tensor_to_json, "dataloader.state_dict()")


def _decode(obj: Any) -> Any:
    return tagged_json.decode(obj, tagged_json.tensor_from_json)


class StatefulLoader(Iterable[Any], Protocol):
    """A loader that saves and loads its own position (torchdata's ``StatefulDataLoader``)."""

    def state_dict(self) -> dict[str, Any]:
        """The loader's position now."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue at a position :meth:`state_dict` returned."""
        ...


def is_stateful(loader: Any) -> TypeGuard[StatefulLoader]:
    """True when ``loader`` has ``state_dict`` and ``load_state_dict`` and its ``state_dict()`` has
    not raised (see :func:`check_loader_state`)."""
    has_methods = callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
    return has_methods and _lookup(_REPLAYED, loader) is None


def check_loader_state(loader: Any) -> str:
    """How ``loader`` is resumed, decided and logged (on the ``resilience`` logger) once, at
    ``resilient_loop()``: ``"state_dict"`` when it has ``state_dict()``/``load_state_dict()`` and
    ``state_dict()`` returns, else ``"replay"`` (the epoch's iterator re-created from the saved RNG
    states, the consumed batches skipped; see the module doc). A ``state_dict()`` that raises
    (any exception) is a warning naming it, never an error. torchdata's ``StatefulDataLoader`` is
    not called: before its first epoch, ``state_dict()`` would start the epoch's iterator and its
    workers, before the loop shields them from stop signals."""
    name = type(loader).__name__  # type(): Accelerate's loaders report their base class as __class__
    if not is_stateful(loader):
        log.info("dataloader: a %s is resumed by replaying its epoch (it has no state_dict()/load_state_dict())", name)
        return "replay"
    if not any(cls.__module__.startswith("torchdata.stateful_dataloader") for cls in type(loader).__mro__):
        try:
            loader.state_dict()
        except Exception as exc:  # noqa: BLE001 - any failure of the user's loader: replay it instead
            _replay_instead(loader, f"its state_dict() raised {type(exc).__name__}: {exc}")
            return "replay"
    log.info("dataloader: a %s is resumed from its state_dict()", name)
    return "state_dict"


def _replay_instead(loader: Any, why: str) -> None:
    log.warning("dataloader: a %s is resumed by replaying its epoch, not from its own state: %s", type(loader).__name__, why)
    try:
        _REPLAYED[loader] = why
    except TypeError:  # not weak-referenceable: each save tries its state_dict() again and falls back again
        pass


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

    A loader whose ``state_dict()`` raises here is replayed from then on (logged once), from
    the RNG states its epoch's iterator was created from.

    Raises:
        TypeError: the loader's state holds something JSON cannot represent.
        RuntimeError: ``state_dict()`` raised in an epoch that was resumed from the loader's own
            state, whose start cannot be replayed.
    """
    try:
        own = _own_state(loader)
        state: dict[str, Any] = {"batches_in_epoch": batches_in_epoch, "loader": None if own is None else _encode(own)}
        start = _epoch_start(loader) or {}
        if start.get("generators"):  # for a loader's own state too (see resume_iterator)
            state["epoch_generators"] = {path: _encode(g) for path, g in start["generators"].items()}
        if start.get("rng") is not None:  # for a loader's own state too (see resume_iterator)
            state["epoch_rng"] = _encode(start["rng"])
            if own is None and start["reset"]:
                state["epoch_reset_workers"] = True
        length = loader_length(loader)
        if length is not None and batches_in_epoch >= length:  # see epoch_iterator
            state["end_generators"] = {path: _encode(g.get_state()) for path, g in _generators(loader).items()}
        return json.dumps(state)
    except TypeError as exc:
        raise TypeError(f"dataloader.state_dict() must be JSON-serialisable to be checkpointed: {exc}") from exc


def _own_state(loader: Any) -> Any:
    """``loader.state_dict()``, or None for a loader that is replayed (see the module doc)."""
    if not is_stateful(loader):
        return None
    try:
        return loader.state_dict()
    except Exception as exc:  # noqa: BLE001 - any failure of the user's loader: replay it instead
        if (_epoch_start(loader) or {}).get("rng") is None:
            raise RuntimeError(
                f"dataloader: a {type(loader).__name__}'s state_dict() raised {type(exc).__name__}: {exc}, in an epoch resumed "
                "from its own state, which cannot be replayed instead; fix its state_dict() or let it raise from the start"
            ) from exc
        _replay_instead(loader, f"its state_dict() raised {type(exc).__name__} at a save: {exc}")
        return None


def save_data_position(path: Path, loader: Any, batches_in_epoch: int) -> None:
    """Write the loader position as JSON (see :func:`data_position_json`)."""
    path.write_text(data_position_json(loader, batches_in_epoch))


def read_data_position(path: Path) -> dict[str, Any]:
    """The JSON written by :func:`save_data_position` (a checkpoint's ``dataloader/`` file before
    the rank state file held it)."""
    return parse_data_position(path.read_text())


def parse_data_position(text: str) -> dict[str, Any]:
    """The position :func:`data_position_json` gave as ``text``."""
    return json.loads(text)


def resume_iterator(loader: Iterable, position: dict[str, Any] | None) -> Iterator:
    """An iterator over the rest of the current epoch.

    ``position`` is ``None`` for a fresh epoch. For a stateful loader its epoch's generators are
    set and its state is loaded before ``iter()``; otherwise the first ``batches_in_epoch`` batches
    are drawn and dropped. A lazy iterator is started (see :func:`_started`).
    """
    if position is None:
        return _iter(loader)
    if is_stateful(loader) and position.get("loader") is not None:
        # The epoch's generators and global RNG first: a loader's own state may leave out what its
        # order was drawn from (Accelerate's use_stateful_dataloader: torchdata cannot save the
        # iterator of a batch sampler it did not make, so it draws the epoch's order again, from the
        # sampler's generator over several ranks, from the global RNG in one process, and skips the
        # consumed batches). A checkpoint without ``epoch_rng`` (older ones) leaves it unknown.
        generators = _set_generators(loader, position)
        rng = _decode(position["epoch_rng"]) if position.get("epoch_rng") is not None else None
        if rng is not None:
            torch.set_rng_state(rng)  # the caller restores the saved RNG after this
        _remember(loader, {"rng": rng, "generators": generators, "reset": False})
        loader.load_state_dict(_decode(position["loader"]))
        return _started(iter(loader))
    iterator = _replay_iter(loader, position)
    for _ in range(int(position["batches_in_epoch"])):
        next(iterator)
    return _started(iterator)


def _started(iterator: Iterator) -> Iterator:
    """``iterator``, started when it is a generator that has not run yet: a lazy ``__iter__``
    (Accelerate's prepared loaders) creates its loader's iterator, drawing from the global RNG,
    only at the first ``next()``, which the saving run had called before its save. Its first batch
    is taken now, before the caller restores the saved RNG, and given back first."""
    if not inspect.isgenerator(iterator) or inspect.getgeneratorstate(iterator) != inspect.GEN_CREATED:
        return iterator
    try:
        first = next(iterator)
    except StopIteration:
        return iter(())
    return itertools.chain([first], iterator)


def epoch_iterator(loader: Iterable, position: dict[str, Any] | None) -> Iterator:
    """This epoch's batches from ``position`` on (see :func:`resume_iterator`).

    At a position at the epoch's end no batch is left, but the loader's iterator is still
    created: the run that saved created it too, and creating it draws from the global RNG. A lazy
    one (a generator, as Accelerate's prepared loaders) is started and closed: the saving run's had
    run, creating its inner loader's iterator (else torchdata's loader under
    ``use_stateful_dataloader`` hands the next epoch the iterator it made at construction, one
    global RNG draw short: other dropout). The loader's generators are then set to their states at
    the save (``end_generators``): the saving run's iterator had drawn the epoch's order from them,
    and Accelerate's, a batch ahead, had exhausted its sampler (a ``RandomSampler`` draws once more
    at its end); left at the epoch's start, the next epoch repeats this one's order. A plain
    ``DataLoader`` is exhausted only after the save (a ``RandomSampler`` given ``generator=g``
    draws from it once more then), so torch's own iterator is replayed from the epoch's start
    instead and its sampler run to its end: the epoch's indices only, no data loaded.
    """
    if position is not None:
        length = loader_length(loader)
        if length is not None and position["batches_in_epoch"] >= length:
            iterator = _replay_iter(loader, position)
            indices = dataloader_sampler_iter(iterator)
            if indices is not None:
                # torch's own iterator: draw the epoch's indices (no data is loaded), as the
                # uninterrupted run's did by its end, the sampler's last draw included; else the path below
                for _ in indices:
                    pass
                return iter(())
            if inspect.isgenerator(iterator) and inspect.getgeneratorstate(iterator) == inspect.GEN_CREATED:
                next(iterator, None)
                iterator.close()
            _set_generators(loader, position, "end_generators")
            return iter(())
    return resume_iterator(loader, position)


def _replay_iter(loader: Iterable, position: dict[str, Any]) -> Iterator:
    """``iter(loader)`` drawing what the saving run's ``iter()`` of this epoch drew (see the module doc)."""
    if position.get("epoch_reset_workers") and getattr(loader, "_iterator", None) is None:
        iter(loader)  # start the persistent workers, as an earlier epoch had; the iter() below resets them
    if position.get("epoch_rng") is not None:
        torch.set_rng_state(_decode(position["epoch_rng"]))
    _set_generators(loader, position)
    return _iter(loader)


def _set_generators(loader: Any, position: dict[str, Any], key: str = "epoch_generators") -> dict[str, torch.Tensor]:
    """Set the loader's generators to their states saved under ``key`` (at the epoch's start, or at
    the save for ``end_generators``); returns those set."""
    generators, states = _generators(loader), {}
    for path, state in (position.get(key) or {}).items():
        if path in generators:
            states[path] = _decode(state)
            generators[path].set_state(states[path])
    return states


def _iter(loader: Iterable) -> Iterator:
    """``iter(loader)``, remembering what it started from (see the module doc; for a loader with
    its own state too, replayed should its ``state_dict()`` raise at a save)."""
    start = {
        "rng": torch.get_rng_state(),
        "generators": {path: g.get_state() for path, g in _generators(loader).items()},
        "reset": bool(getattr(loader, "persistent_workers", False)) and getattr(loader, "_iterator", None) is not None,
    }
    _remember(loader, start)
    return iter(loader)


def _remember(loader: Any, start: dict[str, Any]) -> None:
    try:
        _EPOCH_START[loader] = start
    except TypeError:  # not weak-referenceable (a list of batches): nothing to shuffle
        pass


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
    return _lookup(_EPOCH_START, loader)


def _lookup(table: weakref.WeakKeyDictionary, loader: Any) -> Any:
    try:
        return table.get(loader)
    except TypeError:  # not weak-referenceable
        return None


def loader_length(loader: Any) -> int | None:
    """Batches per epoch of ``loader``; ``None`` when it has no length (an iterable dataset)."""
    try:
        return len(loader)
    except TypeError:
        return None
