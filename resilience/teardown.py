"""Process-exit teardown of what DDP and torch.distributed leave alive, in the order that is safe.

With torch 2.13 and gloo, a ``DistributedDataParallel`` module or the default process group still
alive while the interpreter finalises can abort the rank with SIGABRT instead of its exit code
(seen intermittently in this project's tests and examples; the C++ reducer and the group's threads
are then torn down in an arbitrary order). The safe order is: free DDP's reducer, then destroy the
process group. A user script cannot be asked to ``del`` every reference to its DDP model, and the
loop cannot do it for them, so :func:`release_at_exit` registers one ``atexit`` hook that, after
the script's own code has finished and before module globals are torn down:

1. drops the C++ reducer (and the logger holding it) and the process group reference of each
   DDP module handed to ``resilient_loop()`` that is still alive: the reducer is freed now, with
   the group still alive; the module object stays, it just cannot train any more;
2. runs a garbage collection (what a script's ``del model; gc.collect()`` did; after a
   preemption the loop has frozen the heap, so this is cheap then);
3. destroys the default process group if it is still initialised (a script that destroyed it
   itself is left alone), so its last reference goes now, not during finalisation.

Nothing runs when the process ends through ``os._exit`` or a signal: nothing is torn down then.
"""

from __future__ import annotations

import atexit
import gc
import weakref
from typing import Any

import torch.distributed as dist

# DDP's attributes holding the C++ Reducer (the logger holds it too) and the group (torch 1.x-2.13);
# nothing else refers to the reducer, so dropping them frees it at once (no cycle to collect).
_DDP_NATIVE = ("reducer", "logger", "process_group")
_models: weakref.WeakSet[Any] = weakref.WeakSet()
_registered = False


def release_at_exit(model: Any) -> None:
    """Have :func:`teardown` free ``model``'s DDP reducer and destroy the default process group at
    interpreter exit. ``model`` is held weakly; a non-DDP model only gets the group destroyed.
    Registers the ``atexit`` hook once per process; a no-op without torch.distributed."""
    global _registered
    if not dist.is_available():
        return
    if isinstance(model, _ddp_type()):
        _models.add(model)
    if not _registered:
        atexit.register(teardown)
        _registered = True


def _ddp_type() -> type:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def teardown() -> None:
    """Free the reducers of the registered DDP modules, collect, then destroy the default process
    group if it is still initialised. Idempotent; never raises (it runs at interpreter exit).
    Without a DDP model and an initialised group it does nothing (no exit-time collection)."""
    if not _models and not (dist.is_available() and dist.is_initialized()):
        return
    for model in list(_models):
        for name in _DDP_NATIVE:
            if name in model.__dict__:
                try:
                    delattr(model, name)
                except AttributeError:
                    pass
    _models.clear()
    gc.collect()
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except (RuntimeError, ValueError):
        pass  # torch has torn it down already
