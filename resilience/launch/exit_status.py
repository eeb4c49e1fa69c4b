"""How the ranks' ``Popen.returncode`` values become the launcher's one exit code."""

from __future__ import annotations

import signal
from collections.abc import Sequence

from resilience.exit_codes import ExitCode


def combine_exit_codes(codes: Sequence[int]) -> int:
    """Reduce the ranks' ``Popen.returncode`` values to the launcher's exit code.

    ``codes`` holds one ``int`` per rank, as ``subprocess.Popen.returncode`` reports it:
    ``>= 0`` is an exit status, ``-N`` means "killed by signal N".

    ======================================  ============  ======================================
    ranks' codes                            result        why
    ======================================  ============  ======================================
    all equal ``c >= 0`` (``[75, 75]``)     ``c``         the ranks agree: ``0`` done, ``75``
                                                          preempted, ``76``/``77`` stop, ...
    all ``-N``, same ``N`` (``[-15, -15]``)  ``128 + N``   the shell convention for "killed by
                                                          signal N" (``143`` for SIGTERM), what
                                                          the batch script would see running one
                                                          rank itself; never ``75``, so a
                                                          failure and never requeued
    anything else (``[0, 1]``, ``[75, 0]``,  ``1``         the ranks disagree: ``FAILED``. A
    ``[75, -9]``, ``[1, -15]``)                           partial preemption (some ranks ``75``)
                                                          is a failure, not a resumable stop.
    ======================================  ============  ======================================

    Raises ``ValueError`` for an empty ``codes`` (a group has at least one rank).
    """
    codes = list(codes)
    if not codes:
        raise ValueError("combine_exit_codes: codes must hold one exit code per rank, got []")
    first = codes[0]
    if all(code == first for code in codes):
        return 128 - first if first < 0 else first
    return int(ExitCode.FAILED)


def describe_code(code: int) -> str:
    """``-9`` -> ``"signal SIGKILL"``, ``3`` -> ``"code 3"`` (Popen's returncode convention)."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
