"""What one simulated rank's run costs: CPU seconds, filesystem metadata calls, bytes read, bytes
received in collectives, and the CPU of named library functions.

* **CPU**: ``time.process_time()`` (every thread of the process: the save's parts run on a
  worker thread) less the main thread's CPU spent in the simulation's own work
  (:meth:`Probe.excluded`: making the other ranks' gathered data and files).
* **Metadata calls**: ``os.stat``/``lstat``/``open``/``fsync``/``rename``/``replace``/``unlink``/
  ``rmdir``/``scandir``/``listdir``/``mkdir``/``symlink``/``readlink``/``truncate``/``ftruncate``/
  ``chmod`` and ``io.open`` are wrapped for the whole run (pathlib, ``os.walk`` and ``shutil`` go
  through them) and counted while :attr:`Probe.counting` is set, outside excluded sections.
  Calls made inside C or Rust code (the ``safetensors`` library writing an RNG file) are not seen.
* **Bytes read**: files opened for reading through ``io.open`` count their size (they are read
  whole: JSON, the DCP ``.metadata`` pickle); the byte-level replacements of :mod:`bench.scale.sparse`
  count what the library's readers would read.
* **Bytes received**: :func:`received` applies torch's object collectives (every payload pickled
  and padded to the largest) to the pickled sizes of the simulated payloads.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import functools
import io
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from resilience.checkpoint.layout import DATALOADER_DIR, RANK_STATE_DIR, RNG_DIR

META_CALLS = ("stat", "lstat", "open", "fsync", "rename", "replace", "unlink", "rmdir", "scandir", "listdir", "mkdir", "symlink", "readlink", "truncate")
META_CALLS += ("ftruncate", "chmod")
INDEX_NAMES = ("manifest.json", "shard_index.json", "skeleton.json")


class Capped(BaseException):
    """A capped function ran past its limit (a BaseException: the library's ``except Exception`` must not catch it)."""


class Probe:
    """The counters of the simulated rank being run (one at a time; see :data:`PROBE`)."""

    def __init__(self) -> None:
        self.counting = False
        self.reset()

    def reset(self) -> None:
        """Zero every counter (a new simulated rank, or a new phase of it)."""
        self.excluded_s = 0.0
        self.functions: collections.Counter[str] = collections.Counter()
        self.meta_ops: collections.Counter[str] = collections.Counter()
        self.read: collections.Counter[str] = collections.Counter()
        self.received: collections.Counter[str] = collections.Counter()
        self.lower_bounds: dict[str, float] = {}
        self._local = threading.local()

    def thread_excluded_s(self) -> float:
        """This thread's CPU spent in :meth:`excluded` so far."""
        return getattr(self._local, "total", 0.0)

    def in_excluded(self) -> bool:
        """Whether this thread is inside :meth:`excluded`."""
        return getattr(self._local, "depth", 0) > 0

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """The simulation's own work (this thread's CPU is taken off the rank's, nothing is counted)."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        start = time.thread_time()
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                spent = time.thread_time() - start
                self.excluded_s += spent
                self._local.total = self.thread_excluded_s() + spent

    @contextlib.contextmanager
    def measure(self) -> Iterator[dict[str, Any]]:
        """Around one phase of one simulated rank: yields a dict that gets ``cpu_s`` (its CPU less the
        excluded work), ``wall_s``, and the phase's ``meta_ops`` and ``read`` (by name, by category);
        metadata calls and reads are counted only meanwhile."""
        out: dict[str, Any] = {}
        cpu0, wall0, excluded0 = time.process_time(), time.perf_counter(), self.excluded_s
        ops0, read0 = collections.Counter(self.meta_ops), collections.Counter(self.read)
        self.counting = True
        try:
            yield out
        finally:
            self.counting = False
            out["cpu_s"] = max(time.process_time() - cpu0 - (self.excluded_s - excluded0), 0.0)
            out["wall_s"] = time.perf_counter() - wall0
            out["meta_ops"] = dict(self.meta_ops - ops0)
            out["read"] = dict(self.read - read0)

    def count(self, name: str) -> None:
        """Count one metadata call ``name`` (while counting, outside excluded work)."""
        if self.counting and not self.in_excluded():
            self.meta_ops[name] += 1

    def add_read(self, category: str, nbytes: int) -> None:
        """``nbytes`` read from storage by the rank, of ``category`` (``index``, ``dcp_metadata``,
        ``replicated``: bytes every rank reads; ``own``, ``headers``: this rank's alone)."""
        if self.counting and not self.in_excluded():
            self.read[category] += int(nbytes)


PROBE = Probe()
_ORIGINAL: dict[str, Any] = {}


def install_counters() -> None:
    """Wrap the ``os`` metadata calls and ``io.open`` for the life of the process (idempotent)."""
    if _ORIGINAL:
        return
    for name in META_CALLS:
        _ORIGINAL[name] = getattr(os, name)
        setattr(os, name, _counted(name, _ORIGINAL[name]))
    _ORIGINAL["io.open"] = io.open
    io.open = builtins.open = _open


def _counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        PROBE.count(name)
        return fn(*args, **kwargs)

    return wrapper


def _open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
    PROBE.count("open")
    if PROBE.counting and "r" in mode and "+" not in mode and isinstance(file, (str, os.PathLike)):
        path = os.fspath(file)
        if not path.endswith((".safetensors", ".distcp")):  # data files: counted by the readers in sparse.py
            try:
                size = _ORIGINAL["stat"](path).st_size
            except OSError:
                size = 0
            PROBE.add_read(_category(path), size)
    return _ORIGINAL["io.open"](file, mode, *args, **kwargs)


def _category(path: str) -> str:
    """``index`` (manifest, shard index, skeleton), ``dcp_metadata`` (DCP's ``.metadata``), ``own``
    (a per-rank file), else ``replicated`` (a small file every rank reads: counters, configuration)."""
    if os.path.basename(path) in INDEX_NAMES:
        return "index"
    if os.path.basename(path) == ".metadata":
        return "dcp_metadata"
    return "own" if any(f"{os.sep}{d}{os.sep}" in path for d in (RANK_STATE_DIR, RNG_DIR, DATALOADER_DIR)) else "replicated"


def pickled_size(obj: Any) -> int:
    """Bytes of ``obj`` as torch's object collectives pickle it."""
    return len(pickle.dumps(obj))


def received(kind: str, sizes: list[int], rank: int, root: int = 0) -> int:
    """Bytes ``rank`` receives from its peers in one torch object collective of payloads of
    ``sizes`` bytes (index: rank): ``all_gather``/``gather`` pad every payload to the largest and
    exchange the sizes first (8 bytes each); ``scatter`` and ``broadcast`` send the root's."""
    n, largest = len(sizes), max(sizes)
    if kind == "all_gather":
        return (n - 1) * (8 + largest)
    if kind == "gather":
        return (n - 1) * (8 + largest) if rank == root else (n - 1) * 8
    if kind == "scatter":
        return 0 if rank == root else 16 + largest
    if kind == "broadcast":
        return 0 if rank == root else 8 + sizes[root]
    raise ValueError(f"unknown collective {kind!r}")


def spy(module: Any, name: str, label: str, *, keep: dict[str, Any] | None = None, cap_s: float | None = None, fallback: Callable | None = None) -> Callable:
    """Replace ``module.name`` by a wrapper adding its thread CPU to ``PROBE.functions[label]``
    (inclusive); ``keep[label]`` gets ``(args, kwargs, result)`` of its last call. With ``cap_s``
    (main thread only) a call running longer is stopped, its time recorded in
    ``PROBE.lower_bounds[label]`` and ``fallback(*args, **kwargs)`` returned instead (an exact
    equivalent, so the run goes on). Returns the original."""
    original = getattr(module, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, excluded0 = time.thread_time(), PROBE.thread_excluded_s()
        capped = cap_s is not None and threading.current_thread() is threading.main_thread() and not PROBE.in_excluded()
        try:
            if capped:
                result = _run_capped(original, cap_s, args, kwargs)
                if result is _CAPPED:
                    PROBE.lower_bounds[label] = PROBE.lower_bounds.get(label, 0.0) + time.thread_time() - start
                    with PROBE.excluded():
                        result = fallback(*args, **kwargs)
            else:
                result = original(*args, **kwargs)
        finally:
            if not PROBE.in_excluded():
                PROBE.functions[label] += time.thread_time() - start - (PROBE.thread_excluded_s() - excluded0)
        if keep is not None and not PROBE.in_excluded():
            keep[label] = (args, kwargs, result)
        return result

    setattr(module, name, wrapper)
    return original


_CAPPED = object()


def _run_capped(fn: Callable, cap_s: float, args: tuple, kwargs: dict) -> Any:
    def alarm(signum: int, frame: Any) -> None:
        raise Capped()

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, cap_s)
    try:
        return fn(*args, **kwargs)
    except Capped:
        return _CAPPED
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
