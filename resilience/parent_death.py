"""A rank started by ``resilience run`` ends with its launcher.

Without this, a launcher killed with SIGKILL (``kill -9``, the OOM killer) left its ranks training
on, reparented to PID 1 and writing checkpoints beside the ranks of the next start (found by a
newcomer). Linux's ``PR_SET_PDEATHSIG`` (prctl(2)) has the kernel send SIGKILL to a rank when the
launcher thread that started it ends; nothing is lost that a kill of the whole job would keep,
as every checkpoint is published atomically. A launcher that died before the call is caught by
the parent pid no longer being the one the launcher exported.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Mapping

from resilience.env_names import LAUNCHER_PID_ENV

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """In a rank whose parent is the launcher named by ``RESILIENCE_LAUNCHER_PID``: ask the kernel
    to SIGKILL this process when the launcher ends. Returns whether it was armed (False outside
    ``resilience run``, under a wrapper process between the launcher and the rank, or off Linux).

    Raises:
        RuntimeError: the launcher is gone already (this rank's parent is another process now, and
            no process has the launcher's pid): training on would be an orphan's.
    """
    environ = os.environ if environ is None else environ
    try:
        launcher = int(environ.get(LAUNCHER_PID_ENV, ""))
    except ValueError:
        return False
    if not sys.platform.startswith("linux"):
        return False
    if os.getppid() != launcher:
        if not _exists(launcher):
            raise RuntimeError(f"the launcher (pid {launcher}, {LAUNCHER_PID_ENV}) has exited; not training without it")
        return False  # a wrapper (a shell, nice) started us: its death is not the launcher's
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() != launcher:  # it ended between the first check and the prctl
        raise RuntimeError(f"the launcher (pid {launcher}, {LAUNCHER_PID_ENV}) has exited; not training without it")
    return True


def _exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")  # Linux only, as is this module's work
