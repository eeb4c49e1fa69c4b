"""The order a train loader's shuffle draws, and the samplers that cannot resume.

Under DDP Lightning replaces a loader's sampler: torch's ``RandomSampler`` by a
``DistributedSampler`` (its order a function of seed and epoch), any other sampler by a
``DistributedSamplerWrapper`` over it, which draws the epoch's whole order from the wrapped sampler
at every ``iter()`` (``_DatasetSamplerWrapper.reset``). torchdata's ``StatefulDataLoader(shuffle=True)``
has torchdata's own ``RandomSampler``, so it gets the wrapper, and the loader's ``state_dict()``
holds only how many samples were taken, not the order. Creating an iterator draws the order once
or twice (a new multi-worker iterator draws again in its ``_reset``: the last draw is the epoch's
order), and loading a state draws it two or three more times. So :class:`SamplerDraws` records the
generators under each wrapper before its last draw, saved with a checkpoint, and while a resumed
iterator is created every draw starts from them again: each gives the saved epoch's order, and the
generators end where the saving run's did.

A torch random sampler (``RandomSampler``, ``SubsetRandomSampler``, ``WeightedRandomSampler``) that
Lightning keeps (one process, or inside a batch sampler) has no state: a resume would draw
another order, from the global RNG when it has no generator. :func:`unresumable_sampler` names it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import RandomSampler, Sampler, SubsetRandomSampler, WeightedRandomSampler

_DEPTH = 6  # loader -> batch_sampler -> sampler -> DistributedSamplerWrapper.dataset -> _sampler -> ...
_WRAPPER = "_DatasetSamplerWrapper"  # lightning.fabric.utilities.distributed: the wrapped sampler's epoch order
_TORCH_RANDOM = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


def _walk(loader: Any) -> Iterator[tuple[str, Any]]:
    """(attribute path, object) of the loader's samplers and generators, each object once; datasets
    are not entered (their generators are the dataset's state, not the epoch's order)."""
    seen: set[int] = set()

    def walk(obj: Any, path: str, depth: int) -> Iterator[tuple[str, Any]]:
        for name, value in list(getattr(obj, "__dict__", {}).items()):
            where = f"{path}.{name}" if path else name
            is_sampler = isinstance(value, Sampler) or type(value).__name__ == _WRAPPER
            if id(value) in seen or not (is_sampler or isinstance(value, torch.Generator)):
                continue
            seen.add(id(value))
            yield where, value
            if is_sampler and depth < _DEPTH:
                yield from walk(value, where, depth + 1)

    yield from walk(loader, "", 0)


def sampler_generators(loader: Any) -> dict[str, torch.Generator]:
    """The ``torch.Generator`` objects of the loader and its samplers, by attribute path (e.g.
    ``batch_sampler.sampler.dataset._sampler.generator``: torchdata's ``RandomSampler`` under
    Lightning's ``DistributedSamplerWrapper``)."""
    return {path: obj for path, obj in _walk(loader) if isinstance(obj, torch.Generator)}


def generator_states(loader: Any) -> dict[str, torch.Tensor]:
    """The states of :func:`sampler_generators`, now."""
    return {path: g.get_state() for path, g in sampler_generators(loader).items()}


def set_generators(loader: Any, states: dict[str, torch.Tensor]) -> None:
    """Set the generators under ``loader`` (or a sampler) to ``states`` (:func:`generator_states`'s; paths it lacks are skipped)."""
    generators = sampler_generators(loader)
    for path, state in states.items():
        if path in generators:
            generators[path].set_state(state)


class SamplerDraws:
    """Records and replays the draws of a loader's ``DistributedSamplerWrapper`` objects (see the
    module docstring) while it is open: each wrapper's ``reset`` is wrapped on the instance.

    Args:
        loader: a train loader as Lightning iterates it (its DDP sampler in place).
    """

    def __init__(self, loader: Any):
        self._wrappers = [(path, obj) for path, obj in _walk(loader) if type(obj).__name__ == _WRAPPER]
        self.before_last: dict[str, dict[str, torch.Tensor]] = {}
        """Per wrapper path: the states of the generators under it before its last draw (:func:`generator_states`)."""
        self._replay: dict[str, dict[str, torch.Tensor]] | None = None
        for path, wrapper in self._wrappers:
            wrapper.reset = self._recorded(path, wrapper)

    def _recorded(self, path: str, wrapper: Any) -> Any:
        def reset() -> None:
            if self._replay is not None and path in self._replay:
                set_generators(wrapper, self._replay[path])
            self.before_last[path] = generator_states(wrapper)
            type(wrapper).reset(wrapper)

        return reset

    @contextlib.contextmanager
    def replaying(self, saved: dict[str, dict[str, torch.Tensor]]) -> Iterator[None]:
        """While the block runs, every draw starts from ``saved`` (a :attr:`before_last` of the saving run)."""
        self._replay = saved
        try:
            yield
        finally:
            self._replay = None

    def close(self) -> None:
        """The wrappers' own ``reset`` again (idempotent)."""
        for _, wrapper in self._wrappers:
            wrapper.__dict__.pop("reset", None)
        self._wrappers = []


def unresumable_sampler(loader: Any) -> str | None:
    """The path and type of a torch random sampler in ``loader`` whose order a resume cannot draw
    again (see the module docstring), or ``None``: one outside a ``DistributedSamplerWrapper``, or
    one inside it without a generator of its own."""
    wrappers = [path for path, obj in _walk(loader) if type(obj).__name__ == _WRAPPER]
    for path, obj in _walk(loader):
        if type(obj) in _TORCH_RANDOM:
            wrapped = any(path.startswith(w + ".") for w in wrappers)
            if not wrapped or getattr(obj, "generator", None) is None:
                return f"{path} ({type(obj).__name__}{'' if obj.generator is not None else ', no generator: it draws from the global RNG'})"
    return None
