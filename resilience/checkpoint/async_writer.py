"""The background writer of asynchronous saves: one save in flight, failures reach every rank.

The save's collectives (DCP, the file-list gather, the publish verdict) run in this thread on a
gloo group of their own, so they never interleave with the training's collectives or with the
stop agreement. The thread is a daemon: a writer stuck on a dead peer cannot keep the process
from exiting, and every wait on it has a timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class AsyncSaveTimeout(TimeoutError):
    """The save in flight did not finish within the timeout (a stuck filesystem or a dead peer)."""


class AsyncWriter:
    """Runs one callable at a time in a daemon thread and hands its outcome to :meth:`wait`.

    ``submit`` while a job is in flight is an error (callers :meth:`wait` first). The outcome of
    a job is delivered once: :meth:`wait` re-raises its exception, then forgets it.
    """

    def __init__(self, name: str = "resilience-async-save") -> None:
        self._name = name
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self.started_at: float | None = None
        self.description: str | None = None

    @property
    def in_flight(self) -> bool:
        """True from :meth:`submit` until :meth:`wait` has collected the outcome."""
        return self._thread is not None

    def submit(self, fn: Callable[[], Any], description: str) -> None:
        """Start ``fn()`` in the background. Raises ``RuntimeError`` when one is in flight."""
        if self._thread is not None:
            raise RuntimeError(f"an asynchronous save ({self.description}) is still in flight; wait() first")
        self._done.clear()
        self._result, self._error = None, None
        self.description = description
        self.started_at = time.monotonic()

        def run() -> None:
            try:
                self._result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread by wait()
                self._error = exc
            finally:
                self._done.set()

        self._thread = threading.Thread(target=run, name=self._name, daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float | None) -> Any:
        """Block until the job in flight finishes; return its result or raise its exception.

        Returns ``None`` when nothing is in flight. Raises :class:`AsyncSaveTimeout` after
        ``timeout_s`` seconds (``None``: no bound); the job then stays in flight.
        """
        if self._thread is None:
            return None
        if not self._done.wait(timeout_s):
            raise AsyncSaveTimeout(
                f"the asynchronous save {self.description} did not finish within {timeout_s:g} s (a stuck filesystem, or a rank that died during the save)"
            )
        # Join, not just the event: a daemon thread still unwinding when the interpreter exits is
        # killed mid-way, and torch's thread-local C++ state then aborts the process (SIGABRT).
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._result
