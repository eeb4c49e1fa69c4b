"""A rank's last word to ``resilience run``: the exception that ended its training loop, and when.

Ranks fail together: one runs out of memory, the others fail in their next collective because it
left, and they may well exit first (its own exit can take seconds, CUDA's teardown). Exit codes
cannot tell which failed first, so the ``with`` block of ``resilient_loop()`` writes, as soon as an
exception leaves it and before the loop closes its process group, one small file beside the
rank's progress record (``<RESILIENCE_PROGRESS_FILE>.failed``)::

    {"t": 81234.5, "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}

``t`` is ``time.monotonic()``: one clock for every process of a Linux machine. A peer's error
follows from this rank leaving the collectives, which it does only after writing its note, so
the earliest note names the rank that failed first (the launcher reads them, :func:`read_failure`).
Without ``resilience run`` (no ``RESILIENCE_PROGRESS_FILE``) nothing is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping

from resilience.env_names import PROGRESS_FILE_ENV
from resilience.progress import progress_file

SUFFIX = ".failed"
MAX_ERROR_CHARS = 200
"""The error's text is cut to this many characters (its first line)."""


@dataclasses.dataclass(frozen=True)
class FailureNote:
    """What a rank wrote when an exception ended its loop: ``t`` (``time.monotonic()``) and ``error``
    (``"Type: first line of the message"``)."""

    t: float
    error: str


def describe_exception(exc: BaseException) -> str:
    """``"OutOfMemoryError: CUDA out of memory."``: the type's name and the message's first line,
    at most :data:`MAX_ERROR_CHARS` characters."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def note_failure(exc: BaseException, env: Mapping[str, str] | None = None) -> None:
    """Write this rank's note for ``exc`` now (see the module docstring); a no-op without
    ``RESILIENCE_PROGRESS_FILE``. Never raises: a failed write only leaves the launcher to guess."""
    env = os.environ if env is None else env
    path = env.get(PROGRESS_FILE_ENV)
    if not path:
        return
    data = json.dumps({"t": time.monotonic(), "error": describe_exception(exc)}).encode()
    try:
        fd = os.open(path + SUFFIX, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    except OSError:
        pass


def read_failure(ready_dir: str | os.PathLike[str], rank: int) -> FailureNote | None:
    """Rank ``rank``'s note in the launcher's handshake directory ``ready_dir``; ``None`` when it
    wrote none (it was killed, or it exited without an exception) or the file cannot be parsed."""
    try:
        with open(progress_file(ready_dir, rank) + SUFFIX, "rb") as fh:
            doc = json.loads(fh.read(4096))
        return FailureNote(float(doc["t"]), str(doc["error"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
