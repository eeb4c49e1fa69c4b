"""The lines a user should see without configuring logging: a resume and each save.

Python shows a library's INFO lines only when the program configures logging; most training
scripts do not, so a resume ("resumed from epoch_0_step_40") and every checkpoint went unseen
(only warnings reach stderr, through ``logging.lastResort``). :func:`announce` logs its line at
INFO as usual and, when no handler exists for it anywhere (the program configured no logging),
rank 0 also prints it on stderr as ``[resilience] <line>``. A program that configures logging
gets the record through its own handlers and levels, and nothing is printed twice.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from resilience.env_names import TORCH


def announce(logger: logging.Logger, message: str, *args: Any, rank: int | None = None) -> None:
    """Log ``message % args`` at INFO on ``logger``; with no logging configured (no handler on
    ``logger`` or above it), also print it on stderr when this is rank 0 (``rank``, else the
    environment's ``RANK``, 0 when unset)."""
    logger.info(message, *args)
    if logger.hasHandlers():
        return
    if rank is None:
        raw = os.environ.get(TORCH["rank"], "0")
        rank = int(raw) if raw.isdigit() else 0
    if rank == 0:
        print(f"[resilience] {message % args if args else message}", file=sys.stderr, flush=True)
