"""Which loaders resume from their own ``state_dict()`` and which are replayed.

A loader with ``state_dict()``/``load_state_dict()`` whose ``state_dict()`` raises (Accelerate's
prepared ``DataLoader``: ``AttributeError`` for its missing ``dl_state_dict``) failed every save;
it is replayed instead, said at ``resilient_loop()`` (``TrainingState``), and one that raises only
at a save falls back there. A lazy ``__iter__`` (a generator function, as Accelerate's loaders)
draws from the global RNG at its first ``next()``: a resumed one must have drawn before the saved
RNG is restored. Positions go through the checkpoint's JSON form, as in a real save and resume.
"""

from __future__ import annotations

import json
import logging

import torch
from torch.utils.data import DataLoader

from resilience.state.data_position import data_position_json, epoch_iterator
from resilience.state.training_state import TrainingState

MISSING = "'DataLoader' object has no attribute 'dl_state_dict'"


class RaisingStateLoader(DataLoader):
    """A shuffling loader whose ``state_dict()`` raises once ``broken`` (from the start by default)."""

    def __init__(self, broken: bool = True):
        super().__init__(list(range(12)), batch_size=2, shuffle=True)
        self.broken = broken

    def state_dict(self):
        if self.broken:
            raise AttributeError(MISSING)
        return {"unused": True}

    def load_state_dict(self, state):
        raise AssertionError("a replayed loader's load_state_dict() is never called")


class LazyLoader:
    """A loader with a state of its own whose ``__iter__`` is a generator that draws from the
    global RNG when it starts (Accelerate's ``DataLoaderShard`` draws the base seed there)."""

    def __init__(self):
        self.done = 0

    def __len__(self):
        return 6

    def __iter__(self):
        torch.randint(1000, ())  # the base loader's seed of the epoch
        for i in range(self.done, 6):
            self.done = i + 1
            yield i

    def state_dict(self):
        return {"done": self.done}

    def load_state_dict(self, state):
        self.done = state["done"]


def _saved_mid_epoch(loader, after: int = 2):
    """(position JSON after ``after`` batches, the RNG state then, the batches after) of a fresh epoch."""
    iterator = epoch_iterator(loader, None)
    for _ in range(after):
        next(iterator)
    position, rng = json.loads(data_position_json(loader, after)), torch.get_rng_state()
    return position, rng, list(iterator)


def test_a_loader_whose_state_dict_raises_is_replayed_and_the_log_says_so(caplog):
    torch.manual_seed(0)
    loader = RaisingStateLoader()
    with caplog.at_level(logging.INFO, logger="resilience"):
        TrainingState(model=torch.nn.Linear(1, 1), dataloader=loader)
    assert f"a RaisingStateLoader is resumed by replaying its epoch, not from its own state: its state_dict() raised AttributeError: {MISSING}" in caplog.text
    position, _, rest = _saved_mid_epoch(loader)
    assert position["loader"] is None and "epoch_rng" in position

    torch.manual_seed(1)  # the resumed process's own RNG: the order must not depend on it
    fresh = RaisingStateLoader()
    TrainingState(model=torch.nn.Linear(1, 1), dataloader=fresh)
    assert [b.tolist() for b in epoch_iterator(fresh, position)] == [b.tolist() for b in rest]


def test_a_state_dict_that_raises_only_at_a_save_falls_back_to_the_replay_there(caplog):
    torch.manual_seed(0)
    loader = RaisingStateLoader(broken=False)
    with caplog.at_level(logging.INFO, logger="resilience"):
        TrainingState(model=torch.nn.Linear(1, 1), dataloader=loader)
        assert "a RaisingStateLoader is resumed from its state_dict()" in caplog.text
        loader.broken = True
        position, _, rest = _saved_mid_epoch(loader)
    assert "its state_dict() raised AttributeError at a save" in caplog.text
    assert position["loader"] is None and "epoch_rng" in position
    torch.manual_seed(1)
    assert [b.tolist() for b in epoch_iterator(RaisingStateLoader(), position)] == [b.tolist() for b in rest]


def test_a_lazy_loader_resumed_from_its_state_draws_before_the_saved_rng_is_restored():
    torch.manual_seed(0)
    position, rng, rest = _saved_mid_epoch(LazyLoader())
    after_save = torch.rand(4)  # what training drew after the save
    torch.manual_seed(1)
    resumed = epoch_iterator(LazyLoader(), position)
    torch.set_rng_state(rng)  # as the loop restores the checkpoint's RNG after creating the iterator
    batches = [next(resumed)]  # the first resumed step: its batch, then what its training draws
    assert torch.equal(torch.rand(4), after_save), "the lazy iterator drew from the restored RNG"
    assert batches + list(resumed) == rest == [2, 3, 4, 5]
