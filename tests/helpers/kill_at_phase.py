"""Run the digits example with hooks in the save path (a real kill -9, or a slow writer).

Env: KILL_PHASE (staging | parts | manifest | rename | pointer), KILL_AT_SAVE (1-based),
KILL_RANK (the rank that dies, rank 0 here: saves are counted at their "staging" phase, which
only rank 0 runs, so the count follows the save being written even when it runs in the
background); SLOW_PHASE + SLOW_S: sleep that long at that phase of every
save (a slow disk; with checkpoint.is_async the sleep happens in the background writer).
Phases are those of resilience.checkpoint.writer.
"""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

from resilience.checkpoint import writer

phase = os.environ.get("KILL_PHASE")
at_save, kill_rank = int(os.environ.get("KILL_AT_SAVE", "0")), int(os.environ.get("KILL_RANK", "0"))
slow_phase, slow_s = os.environ.get("SLOW_PHASE"), float(os.environ.get("SLOW_S", "0"))
saves = 0


def hook(name):
    global saves
    if name == "staging":
        saves += 1
    if name == slow_phase:
        time.sleep(slow_s)
    if saves == at_save and name == phase and int(os.environ.get("RANK", "0")) == kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)


writer.fault_hook = hook
train = Path(__file__).resolve().parents[2] / "examples" / "digits" / "train.py"
sys.argv = [str(train), *sys.argv[1:]]
runpy.run_path(str(train), run_name="__main__")
