"""The Lightning example (examples/lightning/train.py) with test hooks.

Usage: lightning_train.py EVENTS_DIR [example arguments: a YAML file, dotted overrides...]

Every training batch appends ``[global step after it, batch index, loss (float hex)]`` to
``EVENTS_DIR/losses_<rank>.jsonl``; at the first batch each rank prints which object handles
SIGUSR1 and SIGTERM (``handlers <rank>: <USR1's> <TERM's>``: the integration's recorder, not Lightning's).

Env:
  PAUSE_AT_STEP  N: at the end of optimizer step N (before the integration's agreement round: this
                 callback comes first) every rank creates ``EVENTS_DIR/paused_<rank>`` and waits
                 until ``EVENTS_DIR/release`` exists, so a test can signal while every rank is there
"""

import json
import os
import signal
import sys
from pathlib import Path

from lightning.pytorch import Callback

import ranks  # this folder's shared rank helpers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "lightning"))
import train as example  # noqa: E402 - the example's own folder, put on the path just above

events, argv = sys.argv[1], sys.argv[2:]
pause_at = int(os.environ.get("PAUSE_AT_STEP", "0"))


def _owner(handler) -> str:
    """The class that installed ``handler``: a function's outer qualified name, else its type's."""
    return getattr(handler, "__qualname__", type(handler).__qualname__).split(".")[0]


class Record(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rank = trainer.global_rank
        if not hasattr(self, "shown"):
            self.shown = print(f"handlers {rank}: {_owner(signal.getsignal(signal.SIGUSR1))} {_owner(signal.getsignal(signal.SIGTERM))}", flush=True)
        with open(Path(events, f"losses_{rank}.jsonl"), "a") as fh:
            fh.write(json.dumps([trainer.global_step, batch_idx, outputs["loss"].item().hex()]) + "\n")
        if pause_at and trainer.global_step == pause_at and not hasattr(self, "paused"):
            self.paused = ranks.pause_for_release(events, rank)


sys.exit(example.main(argv, callbacks=[Record()]))
