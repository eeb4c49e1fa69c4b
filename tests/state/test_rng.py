"""A rank's RNG states through a real rank state file: the draws after a restore equal the draws
after the capture, for NumPy's default global generator (MT19937) and for one the user swapped in
with ``np.random.set_bit_generator`` (whose state is a dict, not MT19937's tuple)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from resilience.state.rng import capture_rng_state, load_rng_state, write_rng_state


def _draws():
    return (random.random(), float(np.random.random()), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())


@pytest.fixture
def global_numpy_generator():
    before = np.random.get_bit_generator()
    yield
    np.random.set_bit_generator(before)


@pytest.mark.parametrize("kind", ["MT19937", "PCG64", "Philox", "SFC64"])
def test_draws_after_restore_equal_draws_after_capture(tmp_path, kind, global_numpy_generator):
    if kind != "MT19937":
        np.random.set_bit_generator(getattr(np.random, kind)(7))
    np.random.standard_normal()  # a cached Gauss value is part of the state
    write_rng_state(tmp_path / "rank_0.safetensors", capture_rng_state())
    expected = _draws()
    np.random.set_bit_generator(np.random.MT19937(99))  # another kind and seed: the restore must undo both
    random.seed(5)
    torch.manual_seed(5)
    load_rng_state(tmp_path / "rank_0.safetensors")
    assert np.random.get_state(legacy=False)["bit_generator"] == kind
    assert _draws() == expected
