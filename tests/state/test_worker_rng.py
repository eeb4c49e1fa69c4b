"""Random draws inside DataLoader workers across a mid-epoch resume of a ``StatefulDataLoader``:
with :class:`resilience.WorkerRNG` the resumed batches equal the uninterrupted run's; without it
they differ (torchdata fast-forwards the sampler, the workers' RNG restarts from its seed), and
``resilient_loop()`` warns. The position goes through the checkpoint's JSON form
(``data_position_json`` / ``resume_iterator``), as in a real save and resume; 2 real workers."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from resilience import WorkerRNG, resilient_loop
from resilience.state.data_position import data_position_json, resume_iterator
from resilience.state.training_state import TrainingState

pytestmark = pytest.mark.filterwarnings("ignore:.*set_vital.*")


class RandomCrops(torch.utils.data.Dataset):
    """Sample i: i plus one draw from each of torch, random and NumPy (an augmentation)."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.tensor([i, torch.randint(1000, ()).item(), random.randrange(1000), int(np.random.randint(1000))])


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(3))


def _loader(dataset):
    return StatefulDataLoader(dataset, batch_size=2, num_workers=2, shuffle=True, generator=torch.Generator().manual_seed(3))


def _resumed_batches(wrap: bool, after: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the uninterrupted epoch's batches after ``after``, those of a fresh loader resumed there)."""
    make = (lambda: WorkerRNG(RandomCrops())) if wrap else RandomCrops
    torch.manual_seed(0)
    loader = _loader(make())
    iterator = iter(loader)
    for _ in range(after):
        next(iterator)
    position = json.loads(data_position_json(loader, after))
    rest = list(iterator)
    torch.manual_seed(1)  # the resumed process's own RNG: nothing may depend on it
    resumed = list(resume_iterator(_loader(make()), position))
    return rest, resumed


def test_worker_rng_makes_random_draws_in_workers_resume_exactly_mid_epoch():
    rest, resumed = _resumed_batches(wrap=True, after=5)
    assert len(rest) == len(resumed) == 7
    assert all(torch.equal(a, b) for a, b in zip(rest, resumed)), (rest[0], resumed[0])


def test_without_it_the_draws_differ_and_resilient_loop_warns():
    rest, resumed = _resumed_batches(wrap=False, after=5)
    assert [b[:, 0].tolist() for b in rest] == [b[:, 0].tolist() for b in resumed], "the same samples"
    assert not all(torch.equal(a, b) for a, b in zip(rest, resumed)), "torchdata restored the workers' RNG: WorkerRNG is no longer needed"
    with pytest.warns(UserWarning, match=r"num_workers=2 .*\(resilience\.WorkerRNG\(dataset\)"):
        TrainingState(model=torch.nn.Linear(1, 1), dataloader=_loader(RandomCrops()))


def test_a_plain_loader_with_persistent_workers_warns_too_and_one_without_does_not(recwarn):
    with pytest.warns(UserWarning, match=r"persistent_workers=True carries its workers' RNG across epochs") as caught:
        TrainingState(model=torch.nn.Linear(1, 1), dataloader=torch.utils.data.DataLoader(RandomCrops(), num_workers=2, persistent_workers=True))
    assert caught[0].filename == __file__  # the caller's line, not the library's
    with pytest.warns(UserWarning, match="persistent_workers=True carries") as caught:
        resilient_loop(
            {"checkpoint": {"enabled": False}},
            model=torch.nn.Linear(1, 1),
            dataloader=torch.utils.data.DataLoader(RandomCrops(), num_workers=2, persistent_workers=True),
        )
    assert [w.filename for w in caught if "carries" in str(w.message)] == [__file__]  # the resilient_loop() call
    TrainingState(model=torch.nn.Linear(1, 1), dataloader=torch.utils.data.DataLoader(RandomCrops(), num_workers=2))
    assert not [w for w in recwarn if "WorkerRNG" in str(w.message)]


def test_a_wrapped_or_worker_free_loader_gets_no_warning(recwarn):
    TrainingState(model=torch.nn.Linear(1, 1), dataloader=_loader(WorkerRNG(RandomCrops())))
    TrainingState(model=torch.nn.Linear(1, 1), dataloader=StatefulDataLoader(RandomCrops(), batch_size=2))
    assert not [w for w in recwarn if "WorkerRNG" in str(w.message)]
    with pytest.raises(TypeError, match="map-style"):
        WorkerRNG(Stream())
