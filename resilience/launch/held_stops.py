"""Stop signals held for ranks that are not ready: when a rank is ready, how long a signal waits,
and the record of one delivered after that wait, for ``resilience status``.

A stop signal sent to a rank before it has a handler would kill it, so :class:`RankGroup` holds it
(:meth:`~resilience.launch.rank_group.RankGroup.request_stop`) until the rank is ready: its ready
marker (``resilient_loop()``) or a handler of its own (:func:`catches`). A program that never
builds ``resilient_loop()`` and has no handler (a Hugging Face ``Trainer`` script) is never ready,
so the hold is bounded: after ``--signal-hold-timeout`` (:data:`DEFAULT_HOLD_TIMEOUT_S`) the signal
is delivered anyway. With ``resilience run --checkpoint-dir DIR`` the launcher then writes
``DIR/.held_stop.json`` (:func:`write_record`), which ``resilience status DIR`` shows::

    {"signals": ["SIGUSR1"], "ranks": [0, 1], "held_s": 60.0, "at": 1714564800.0,
     "exit_codes": [-10, -10], "exit_code": 75}

``ranks``: the global ranks that never became ready; ``held_s``: seconds the signal was held;
``at``: the delivery (Unix time); ``exit_codes``: the local ranks' ``Popen.returncode`` values;
``exit_code``: the launcher's code for that start.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from resilience.checkpoint.layout import HELD_STOP_RECORD

DEFAULT_HOLD_TIMEOUT_S = 60.0
"""Seconds a stop signal is held for a rank that is not ready before it is delivered anyway
(``--signal-hold-timeout``): shorter than a usual Slurm lead time (300 s), so the program's own
handler, or the default action, still runs before the job's end."""


def catches(pid: int, sig: int) -> bool | None:
    """Whether process ``pid`` has a handler for ``sig`` now (bit ``sig - 1`` of ``SigCgt`` in
    ``/proc/PID/status``, Linux); ``None`` when that cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def write_record(root: str | os.PathLike[str], event: dict[str, Any], codes: list[int], code: int) -> Path:
    """Write ``root/.held_stop.json`` (see the module docstring) for ``event`` (one entry of
    :attr:`~resilience.launch.rank_group.RankGroup.delivered_after_hold`), replacing any earlier
    record (temp file + ``os.replace``). Returns its path. Raises ``OSError`` when it cannot."""
    path = Path(root) / HELD_STOP_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{HELD_STOP_RECORD}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps({**event, "exit_codes": list(codes), "exit_code": int(code)}) + "\n")
    os.replace(tmp, path)
    return path


def read_record(root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The record under ``root`` (see the module docstring); ``None`` when there is none or it is
    not a record (a file of another shape is ignored, not trusted)."""
    try:
        doc = json.loads((Path(root) / HELD_STOP_RECORD).read_text())
        record = {
            "signals": [str(name) for name in doc["signals"]],
            "ranks": [int(rank) for rank in doc["ranks"]],
            "held_s": float(doc["held_s"]),
            "at": float(doc["at"]),
            "exit_codes": [int(c) for c in doc["exit_codes"]],
            "exit_code": int(doc["exit_code"]),
        }
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record
