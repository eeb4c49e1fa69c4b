"""The Hugging Face Trainer example (examples/hf_trainer/train.py) with test hooks.

Usage: hf_trainer_train.py EVENTS_DIR [example arguments: a YAML file, dotted overrides...]

Env:
  PAUSE_AT_STEP  N: at the end of optimizer step N (before the integration's agreement round:
                 this callback is added first) every rank creates ``EVENTS_DIR/paused_<rank>`` and
                 waits until ``EVENTS_DIR/release`` exists, so a test can signal while every rank is there
  KILL_PHASE     a save phase of resilience.checkpoint.writer (staging | parts | manifest | rename | pointer):
                 rank KILL_RANK (default 0) kills itself with SIGKILL there, in save KILL_AT_SAVE (default 1)
"""

import os
import signal
import sys
from pathlib import Path

from transformers import TrainerCallback

import ranks  # this folder's shared rank helpers
from resilience.checkpoint import writer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "hf_trainer"))
import train as example  # noqa: E402 - the example's own folder, put on the path just above

events, argv = sys.argv[1], sys.argv[2:]
pause_at = int(os.environ.get("PAUSE_AT_STEP", "0"))
kill_phase, kill_rank, kill_at = os.environ.get("KILL_PHASE"), int(os.environ.get("KILL_RANK", "0")), int(os.environ.get("KILL_AT_SAVE", "1"))
saves = 0


class Pause(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == pause_at:
            ranks.pause_for_release(events, args.process_index)


def kill_hook(name):
    global saves
    saves += name == "parts"  # every rank runs the parts phase once per part, and a save has one part here
    if name == kill_phase and saves == kill_at and int(os.environ.get("RANK", "0")) == kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)


if kill_phase:
    writer.fault_hook = kill_hook
sys.exit(example.main(argv, callbacks=[Pause()] if pause_at else []))
