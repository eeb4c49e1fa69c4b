"""Random draws inside DataLoader workers, resumed exactly mid-epoch with a ``StatefulDataLoader``.

torchdata's ``StatefulDataLoader`` resumes an epoch by fast-forwarding its sampler: the skipped
samples' ``__getitem__`` never runs again, so each worker's RNG (seeded ``base_seed + worker_id``
when the worker starts) restarts where the epoch began, not where the saving run's worker was. A
dataset that augments or crops at random in ``__getitem__`` then gives the resumed run other
samples than the uninterrupted one, silently. What the loader does restore, in each worker, is the
state of a dataset with ``state_dict``/``load_state_dict``, taken right after the batch it yielded:
:class:`WorkerRNG` wraps a map-style dataset so that state is the worker's RNGs (torch, ``random``,
NumPy). A plain ``DataLoader`` needs none of this: its resume replays the epoch's batches, which
runs ``__getitem__`` again (see :mod:`resilience.state.data_position`).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset


class WorkerRNG(Dataset):
    """``dataset`` (map-style: ``__getitem__`` and ``__len__``) whose worker RNG state is part of a
    ``StatefulDataLoader``'s state, so a mid-epoch resume draws what the saving run drew.

    Use: ``StatefulDataLoader(WorkerRNG(dataset), num_workers=N, ...)``. The state (torch's CPU
    RNG, ``random``'s, NumPy's global one) is saved by the loader per worker; :mod:`resilience`
    stores it as tagged JSON in the rank's data position (``rank_state/rank_<R>.safetensors``),
    like the rest of the loader's state. Items and length are ``dataset``'s.

    Raises:
        TypeError: ``dataset`` is an ``IterableDataset`` (its own ``state_dict`` is the place for
            its randomness), or has no ``__getitem__``.
    """

    def __init__(self, dataset: Any):
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
            raise TypeError(f"WorkerRNG: expected a map-style dataset (__getitem__ and __len__), got {type(dataset).__name__}")
        self.dataset = dataset

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)

    def state_dict(self) -> dict[str, Any]:
        """This process's RNG states: ``{"torch": uint8 tensor, "random": tuple, "numpy": tuple}``."""
        return {"torch": torch.get_rng_state(), "random": random.getstate(), "numpy": np.random.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set this process's RNGs to ``state`` (from :meth:`state_dict`, as the loader hands it back)."""
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
        random.setstate(_tuples(state["random"]))
        np.random.set_state(_tuples(state["numpy"]))


def _tuples(value: Any) -> Any:
    """Lists back to tuples (``random.setstate`` wants tuples; a JSON round trip may give lists)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def randomness_not_restored(loader: Any) -> str | None:
    """Why random draws in ``loader``'s workers would not resume exactly, or ``None``. Two cases,
    both with ``num_workers > 0`` over a map-style dataset without a ``state_dict`` of its own:
    a ``state_dict``-carrying loader (``StatefulDataLoader``: it skips samples without loading
    them), and a plain loader with ``persistent_workers`` (its workers' RNG carries across epochs,
    which a replay from fresh workers does not reproduce). It cannot tell whether the dataset
    draws at random at all, so the caller only warns."""
    dataset = getattr(loader, "dataset", None)
    workers = getattr(loader, "num_workers", 0)
    if not workers or dataset is None or isinstance(dataset, IterableDataset) or hasattr(dataset, "state_dict"):
        return None
    fix = "if it draws at random, wrap it: StatefulDataLoader(resilience.WorkerRNG(dataset), ...)"
    if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"):
        return (
            f"dataloader: a {type(loader).__name__} with num_workers={workers} resumes mid-epoch by skipping samples "
            "without loading them, so random draws inside the dataset's __getitem__ (augmentation, random crops) restart from "
            f"the worker's seed and differ from an uninterrupted run; {fix}"
        )
    if getattr(loader, "persistent_workers", False):
        return (
            f"dataloader: a {type(loader).__name__} with num_workers={workers} and persistent_workers=True carries its workers' "
            "RNG across epochs, which a resume in a later epoch does not reproduce, so random draws inside the dataset's "
            f"__getitem__ (augmentation, random crops) differ from an uninterrupted run; {fix}"
        )
    return None
