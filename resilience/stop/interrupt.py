"""Ctrl-C during a save: the first SIGINT waits for the save to publish, a second one acts at once.

A SIGINT that is not a ``preemption_signal`` keeps Python's default action, a ``KeyboardInterrupt``
wherever the main thread is. Inside a save that abandons a checkpoint nearly written, on every rank
a terminal's Ctrl-C reaches, and loses the steps since ``LATEST``. :class:`HeldInterrupt` scopes a
save: its handler records the first SIGINT and returns (no I/O, no exit), and on leaving the scope
the recorded SIGINT is delivered to the handler it replaced (so the ``KeyboardInterrupt``, exit 130,
comes right after the publish). A second SIGINT inside the scope goes to that handler at once: the
way to abort a save that hangs.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


class HeldInterrupt:
    """Context manager that holds the first SIGINT until the ``with`` block ends, then delivers it.

    * It acts only where Python's default SIGINT handler (:func:`signal.default_int_handler`,
      which raises ``KeyboardInterrupt``) is installed, and only in the main thread; with another
      disposition (``SIG_IGN``, ``SIG_DFL``, a handler of the program's own, a ``preemption_signal``
      recorder) and in other threads it installs nothing. Nested inside another active hold it
      installs nothing either: the outer one holds.
    * First SIGINT in the block: recorded; the block goes on. Second: ``KeyboardInterrupt`` at once.
    * On exit the default handler is back; a recorded SIGINT is then delivered to it, however the
      block ended: ``KeyboardInterrupt`` is raised from the ``with`` statement (chained to the
      block's own exception, if it raised one).
    """

    def __init__(self) -> None:
        self._installed = False
        self._frame: FrameType | None = None
        self._held = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._held:  # the second: raised now, and the first with it (__exit__ raises no other)
            self._held, self._frame = False, None
            signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt
        self._held, self._frame = True, frame

    def __enter__(self) -> HeldInterrupt:
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._installed:
            return
        self._installed = False
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if self._held:
            self._held, frame, self._frame = False, self._frame, None
            signal.default_int_handler(signal.SIGINT, frame)
