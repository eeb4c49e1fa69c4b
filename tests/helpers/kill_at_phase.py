"""Run the digits example, SIGKILLing this rank at one phase of its Nth save (a real kill -9).

Env: KILL_PHASE (staging | parts | manifest | rename | pointer), KILL_AT_SAVE (1-based),
KILL_RANK (the rank that dies). Phases are those of resilience.checkpoint.writer.
"""

import os
import runpy
import signal
import sys
from pathlib import Path

from resilience.checkpoint import checkpointer, writer

phase, at_save, kill_rank = os.environ["KILL_PHASE"], int(os.environ["KILL_AT_SAVE"]), int(os.environ["KILL_RANK"])
saves = 0
original_save = checkpointer.Checkpointer.save


def counting_save(self, *args, **kwargs):
    global saves
    saves += 1
    return original_save(self, *args, **kwargs)


def hook(name):
    if saves == at_save and name == phase and int(os.environ.get("RANK", "0")) == kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)


checkpointer.Checkpointer.save = counting_save
writer.fault_hook = hook
train = Path(__file__).resolve().parents[2] / "examples" / "digits" / "train.py"
sys.argv = [str(train), *sys.argv[1:]]
runpy.run_path(str(train), run_name="__main__")
