"""DataLoader workers that survive a preemption signal sent to the whole process group.

Slurm signals every process of a job step (``scancel --signal=TERM``, the end of a step, a
preemption after ``GraceTime``), so a rank's DataLoader workers get the preemption signal with
their rank. Left alone they die of it: torch's worker loop (torch 2.13,
``torch/utils/data/_utils/worker.py``, ``_worker_loop``) first calls
``signal_handling._set_worker_signal_handlers()``, a C-level SIGTERM handler that kills the
worker unless the sender is its parent, and workers started with ``spawn``/``forkserver`` do not
inherit the rank's recorder for any signal. The rank then fails in torch's SIGCHLD handler
("DataLoader worker (pid N) is killed by signal: Terminated") or blocks on a dead worker, and
nothing is saved.

:func:`shield_dataloader_workers` composes the loader's ``worker_init_fn`` (torch calls it in each
worker *after* installing its own handlers, before the first batch) with :func:`shield_worker`,
which blocks the preemption signals in the worker and takes them in a thread of its own:

* from anyone but the parent (Slurm, a ``kill`` of the process group): ignored, so the worker
  keeps serving batches while the rank finishes its step and saves;
* ``SIGTERM`` from the parent: the worker exits 0, torch's own rule, which ``multiprocessing``
  relies on at the rank's exit to stop daemonic (persistent) workers.

Workers still end with their rank: torch's watchdog in the worker loop notices a dead parent
within 5 s, and the rank's iterator shuts them down (``done_event``) as usual. Data order and a
``StatefulDataLoader``'s ``state_dict()`` are unchanged: ``worker_init_fn`` is not part of either,
and the composed function draws no random numbers.

Workers that already exist are not shielded: a ``persistent_workers`` loader iterated before
:func:`~resilience.loop.resilient_loop` keeps its unshielded workers (a warning says so).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("resilience")


def shield_worker(signals: Iterable[int]) -> None:
    """In a DataLoader worker: make ``signals`` harmless to it (see the module docstring).

    Linux: blocks ``signals`` in this thread (threads started later inherit the mask) and starts a
    daemon thread that takes them with ``sigwaitinfo``, exiting the process (``os._exit(0)``) on a
    SIGTERM from the parent and ignoring everything else. Without ``sigwaitinfo`` (macOS) each
    signal is set to ``SIG_IGN`` instead; a worker then no longer exits on its parent's SIGTERM and
    relies on torch's shutdown and watchdog.
    """
    sigs = tuple(signal.Signals(s) for s in signals)
    if not sigs:
        return
    if not hasattr(signal, "sigwaitinfo"):
        for sig in sigs:
            signal.signal(sig, signal.SIG_IGN)
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    threading.Thread(target=_take_signals, args=(sigs, os.getppid()), name="resilience-worker-signals", daemon=True).start()


def _take_signals(sigs: tuple[signal.Signals, ...], parent: int) -> None:
    while True:
        info = signal.sigwaitinfo(sigs)
        if info.si_signo == signal.SIGTERM and info.si_pid == parent:
            os._exit(0)  # what torch's own handler does for its parent (multiprocessing's terminate())


class ShieldedWorkerInit:
    """A ``worker_init_fn``: :func:`shield_worker`, then the user's own ``worker_init_fn``.

    A top-level class, so a loader using ``spawn``/``forkserver`` workers can pickle it as long as
    the user's function pickles.

    Attributes:
        signals: the signal numbers shielded.
        user_fn: the ``worker_init_fn`` the loader had before (``None`` if none).
    """

    def __init__(self, signals: Iterable[int], user_fn: Callable[[int], Any] | None) -> None:
        self.signals = tuple(int(s) for s in signals)
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        """In DataLoader worker ``worker_id``: shield it from the signals, then run the user's init."""
        shield_worker(self.signals)
        if self.user_fn is not None:
            self.user_fn(worker_id)

    def __repr__(self) -> str:
        return f"ShieldedWorkerInit(signals={self.signals}, user_fn={self.user_fn!r})"


def shield_dataloader_workers(loader: Any, signals: Iterable[int]) -> bool:
    """Set ``loader.worker_init_fn`` to a :class:`ShieldedWorkerInit` of ``signals`` and the
    loader's current ``worker_init_fn``, for a loader with worker processes.

    Applies to any loader with ``num_workers > 0`` and a ``worker_init_fn`` attribute (torch's
    ``DataLoader``, torchdata's ``StatefulDataLoader``); anything else (a list of batches, a loader
    without workers, no preemption signals) is left untouched. Idempotent: a loader already
    shielded has its signals replaced, not a second layer added. Logs a warning when the loader's
    persistent workers already exist (they keep running unshielded).

    Returns True when the loader was shielded.
    """
    sigs = tuple(int(s) for s in signals)
    num_workers = getattr(loader, "num_workers", 0)
    if not sigs or isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers <= 0:
        return False
    if not hasattr(loader, "worker_init_fn"):
        return False
    user_fn = loader.worker_init_fn
    if isinstance(user_fn, ShieldedWorkerInit):
        user_fn = user_fn.user_fn
    loader.worker_init_fn = ShieldedWorkerInit(sigs, user_fn)
    # torch's DataLoader and StatefulDataLoader keep persistent workers in `_iterator`, created by
    # the first iter(); workers forked before this point did not run the composed function.
    if getattr(loader, "persistent_workers", False) and getattr(loader, "_iterator", None) is not None:
        names = ", ".join(signal.Signals(s).name for s in sigs)
        log.warning(
            "dataloader: its persistent workers were started before resilient_loop(), so they are not "
            "shielded from %s: a signal to the whole process group (Slurm's) kills them and the ranks "
            "fail without saving. Create the loader's first iterator inside the loop.",
            names,
        )
    return True
