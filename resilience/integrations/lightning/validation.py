"""Validation during ``fit`` with the training RNG isolated, so a resume finds the randomness an
uninterrupted run has.

A validation draws from the global RNG (creating its loader's iterator draws a seed, a model may
sample) between two training steps. A run resumed from a step's checkpoint does not run the
validation due at that step: Lightning skips it (``increment_progress_to_evaluation_end``), and
even that skip creates the validation iterator, drawing a seed. So both the validation loop and
that skip run with the RNG states saved before and set again after (as Lightning's sanity check
does with ``isolate_rng``): training draws the same numbers whether or not a validation ran.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from resilience.state.rng import capture_rng_state, restore_rng_state

_ISOLATED = ("run", "increment_progress_to_evaluation_end")  # Lightning 2.x _EvaluationLoop: a validation, and its skip on resume


@contextlib.contextmanager
def validation_rng_isolated(trainer: Any) -> Iterator[None]:
    """While the block runs, ``trainer``'s validation during ``fit`` leaves the RNG states (Python,
    NumPy, torch CPU and CUDA) as it found them; the validation loop is as before after it."""
    loop = trainer.fit_loop.epoch_loop.val_loop
    for name in _ISOLATED:
        setattr(loop, name, _isolated(getattr(loop, name)))
    try:
        yield
    finally:
        for name in _ISOLATED:
            delattr(loop, name)  # the class's own again


def _isolated(method: Callable[[], Any]) -> Callable[[], Any]:
    @functools.wraps(method)
    def isolated() -> Any:
        saved = capture_rng_state()
        try:
            return method()
        finally:
            restore_rng_state(saved)

    return isolated
