"""The train loaders of a Lightning ``fit``: checked before the first step, their state saved per
rank, and the epoch's iterator started again exactly where a checkpoint left it.

Lightning (2.x) saves ``state_dict()`` of stateful train loaders in the ``.ckpt`` (rank 0's only)
and loads it in ``FitLoop.setup_data()``, where it also creates the epoch's iterator; that is not
exact, for four reasons this module fixes:

* every rank gets rank 0's loader state (a stateful sampler or dataset of another rank would
  resume rank 0's position): each rank saves its own (:func:`position_json`) and loads it;
* ``setup_data()`` creates the iterator before ``on_advance_start()`` calls ``set_epoch``, so a
  ``DistributedSampler`` (which Lightning's DDP puts into every train loader) fast-forwards
  through epoch 0's order in any later epoch (Lightning #21938);
* a state saved at an epoch's last batch resumes an exhausted iterator, so the next epoch has no
  batch at all (Lightning keeps that iterator because it is resuming);
* under DDP, ``StatefulDataLoader(shuffle=True)``'s order comes from a generator its state does
  not hold (:mod:`~.samplers`): a resume would draw another one.

:func:`restart_train_iterator` therefore sets the sampler's epoch, loads this rank's state,
replays the saved order's draws and creates the fetcher's iterator again, in ``on_train_start`` (after ``setup_data()``, before the
first batch). Loader forms (:func:`check_train_loaders`): a loader with ``state_dict()`` /
``load_state_dict()`` whose ``state_dict()`` works and holds only what
:mod:`~resilience.state.tagged_json` can write (torchdata's ``StatefulDataLoader``, a drop-in for
``torch.utils.data.DataLoader``), with a length: without one Lightning fetches a batch ahead, and
the saved state would be one batch past the step.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from resilience.config import ConfigError
from resilience.integrations.lightning.samplers import SamplerDraws, unresumable_sampler
from resilience.state import tagged_json
from resilience.state.data_position import loader_length
from resilience.state.worker_rng import randomness_not_restored
from resilience.state.worker_signals import shield_dataloader_workers

log = logging.getLogger("resilience")


ACCEPTED = (
    "use torchdata.stateful_dataloader.StatefulDataLoader (a drop-in for torch.utils.data.DataLoader), or a loader whose "
    "state_dict()/load_state_dict() resume it mid-epoch"
)


def train_loaders(trainer: Any) -> list[Any]:
    """The train loaders of the running ``fit`` as Lightning iterates them (its DDP sampler in place), in
    the order of its ``CombinedLoader``; empty before ``setup_data()`` or without training."""
    combined = trainer.fit_loop._combined_loader  # Lightning 2.x: the processed loaders live here
    return list(combined.flattened) if combined is not None else []


def _encode(state: Any) -> Any:
    return tagged_json.encode(state, tagged_json.tensor_to_json, "train_dataloader.state_dict()")


def _decode(state: Any) -> Any:
    return tagged_json.decode(state, tagged_json.tensor_from_json)


def check_train_loaders(trainer: Any) -> None:
    """Refuse a train loader that cannot resume mid-epoch exactly, before the first step; warn when
    random draws inside its workers would not resume (:func:`~resilience.state.worker_rng.randomness_not_restored`).

    Raises:
        ConfigError: naming the loader and the accepted forms: no ``state_dict()``/``load_state_dict()``,
            no length, a ``state_dict()`` that raises or holds something that cannot be saved.
    """
    for index, loader in enumerate(train_loaders(trainer)):
        name = f"train dataloader {index} ({type(loader).__name__})"
        if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))):
            raise ConfigError(f"{name} has no state_dict()/load_state_dict(): a stop mid-epoch could not resume at its batch; {ACCEPTED}")
        if loader_length(loader) is None:
            raise ConfigError(
                f"{name} has no len(): Lightning then fetches one batch ahead, and a saved state would be one batch past the saved step; "
                "give its dataset a __len__ (an IterableDataset too)"
            )
        sampler = unresumable_sampler(loader)
        if sampler is not None:
            raise ConfigError(
                f"{name} shuffles with {sampler}, which has no state: a resume would draw another order; use "
                "StatefulDataLoader(shuffle=True) (torchdata's stateful RandomSampler), or a sampler with state_dict()/load_state_dict()"
            )
        try:
            _encode(loader.state_dict())
        except TypeError as exc:
            raise ConfigError(f"{name}.state_dict() cannot be saved: {exc}; {ACCEPTED}") from exc
        except Exception as exc:  # noqa: BLE001 - any failure of the user's loader, found now and not at the first save
            raise ConfigError(f"{name}.state_dict() raised {type(exc).__name__}: {exc}; {ACCEPTED}") from exc
        problem = randomness_not_restored(loader)
        if problem and trainer.global_rank == 0:
            log.warning(problem)


def position_json(trainer: Any, *, epoch: int, epoch_complete: bool, draws: list[SamplerDraws]) -> str:
    """This rank's train loader states as JSON text, captured now (after optimizer step ``trainer.global_step``):
    the 0-based ``epoch`` they are in, whether that epoch's last batch was consumed, each loader's
    ``state_dict()`` and the generators its samplers drew the epoch's order from (``draws``: one per loader)."""
    states = [_encode(loader.state_dict()) for loader in train_loaders(trainer)]
    orders = [_encode(d.before_last) for d in draws]
    return json.dumps({"epoch": epoch, "epoch_complete": bool(epoch_complete), "loaders": states, "draws": orders})


def restart_train_iterator(trainer: Any, position: dict[str, Any] | None, signals: Any, draws: list[SamplerDraws], restore_rng: Callable[[], None]) -> None:
    """Create the train iterator of the epoch ``fit`` is about to run again: each loader's workers
    shielded from ``signals`` (they are started again), its sampler's epoch set, and, resuming
    (``position``: :func:`position_json`'s, of this rank), its state loaded, its samplers drawing the
    saved order (``draws``: a :class:`~.samplers.SamplerDraws` per loader, open). At a position at an
    epoch's end that epoch's iterator is created and dropped, so the generators move past it as they
    did, and the next epoch starts fresh. ``restore_rng()`` sets the saved RNG states where the
    saving run had them: before a new epoch's iterator is created (it draws a seed), after a
    resumed one (created at the epoch's start). Call in ``on_train_start``.

    Raises:
        ValueError: ``position`` holds another number of loaders than the fit has.
    """
    from lightning.fabric.utilities.data import _set_sampler_epoch as set_epoch  # what Lightning calls each epoch: samplers inside batch samplers too

    loaders = train_loaders(trainer)
    saved = position if position is not None and position.get("loaders") is not None else None  # resuming with loader states
    if saved is not None and len(saved["loaders"]) != len(loaders):
        raise ValueError(f"the checkpoint holds the state of {len(saved['loaders'])} train loaders, this fit has {len(loaders)}")
    epoch = trainer.fit_loop.epoch_progress.current.processed  # what on_advance_start() sets next
    orders = _decode(saved["draws"]) if saved is not None else [{} for _ in loaders]
    resumed_mid_epoch = saved is not None and not saved["epoch_complete"]
    for index, loader in enumerate(loaders):
        shield_dataloader_workers(loader, signals)
        _drop_iterator(loader)
        if saved is not None:
            set_epoch(loader, saved["epoch"])
            loader.load_state_dict(_decode(saved["loaders"][index]))
            if saved["epoch_complete"]:
                with draws[index].replaying(orders[index]):
                    iter(loader)  # the saved epoch's exhausted iterator: its samplers' generators move past that epoch
                _drop_iterator(loader)
        set_epoch(loader, epoch)
    if not resumed_mid_epoch:
        restore_rng()
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None:
        fetcher.reset()
        with contextlib.ExitStack() as stack:
            for index in range(len(loaders) if resumed_mid_epoch else 0):
                stack.enter_context(draws[index].replaying(orders[index]))
            iter(fetcher)  # a new CombinedLoader iterator over the loaders' new iterators
    if resumed_mid_epoch:
        restore_rng()


def _drop_iterator(loader: Any) -> None:
    """Shut down the workers of the loader's current iterator (persistent ones too), so the next
    ``iter()`` starts new, shielded ones from the state loaded (if any)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and callable(getattr(iterator, "_shutdown_workers", None)):
        iterator._shutdown_workers()
    if hasattr(loader, "_iterator"):
        loader._iterator = None
