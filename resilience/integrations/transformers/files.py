"""The Hugging Face ``Trainer``'s checkpoint, written by its own methods into our staging directory.

The files and methods are those of ``Trainer._save_checkpoint`` (transformers 5.x,
``transformers/trainer.py``), so ``trainer.train(resume_from_checkpoint=DIR)`` and
``AutoModel.from_pretrained(DIR)`` read the published directory as one of the Trainer's own::

    config.json  generation_config.json  model.safetensors   save_model(): the model (rank 0)
    training_args.bin  tokenizer / processor files           save_model(): args, processing_class (rank 0)
    optimizer.pt  scheduler.pt  [scaler.pt]                  _save_optimizer_and_scheduler(), _save_scaler() (rank 0)
    rng_state_<R>.pth (one per rank; rng_state.pth alone)    _save_rng_state(): every rank its own
    trainer_state.json                                       TrainerState.save_to_json() (rank 0)

What ``_save_checkpoint`` does besides is left out or done by us: its directory (``checkpoint-<S>``
in ``output_dir``) is our staging directory, published as ``epoch_<E>_step_<S>/``; its rotation
(``save_total_limit``) is our retention; ``push_to_hub`` of checkpoints is not done.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from resilience.checkpoint.layout import checkpoint_counters, list_checkpoints

_RNG_FILE = re.compile(r"rng_state_(\d+)\.pth")
"""The per-rank RNG file ``Trainer._save_rng_state`` writes with several processes."""


def write_trainer_checkpoint(staging: Path, trainer: Any, *, final_dir: Path) -> list[str]:
    """Write ``trainer``'s checkpoint of its current step into ``staging`` on this rank; returns the
    files this rank wrote (relative paths): the writer's every file but the other ranks' RNG
    files, or another rank's own RNG file. ``final_dir``: the directory it is published as,
    recorded as ``best_model_checkpoint`` when this step is the best (``load_best_model_at_end``)."""
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_callback import ExportableState

    out = os.fspath(staging)
    args, state = trainer.args, trainer.state
    trainer.store_flos()
    trainer.save_model(out, _internal_call=True)
    trainer._save_optimizer_and_scheduler(out)
    trainer._save_scaler(out)
    trainer._save_rng_state(out)
    if args.should_save:
        _point_at_best(state, final_dir)
        # As _save_checkpoint does: the stateful callbacks' and TrainerControl's state go into trainer_state.json.
        for cb in [cb for cb in trainer.callback_handler.callbacks + [trainer.control] if isinstance(cb, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(state.stateful_callbacks.get(name), list):
                state.stateful_callbacks[name].append(cb.state())
            else:
                state.stateful_callbacks[name] = cb.state()
        state.save_to_json(os.path.join(out, TRAINER_STATE_NAME))
    return own_files(staging, rank=args.process_index, writer=args.should_save)


def own_files(staging: Path, *, rank: int, writer: bool) -> list[str]:
    """The files of ``staging`` this rank wrote: for the rank that saves (``args.should_save``),
    every file but another rank's ``rng_state_<R>.pth`` (the others write only theirs, and may be
    writing it now); for another rank, its own RNG file."""
    if not writer:
        mine = f"rng_state_{rank}.pth"
        return [mine] if (staging / mine).is_file() else []
    found = []
    for dirpath, _, names in os.walk(staging):
        for name in names:
            match = _RNG_FILE.fullmatch(name)
            if match is None or int(match.group(1)) == rank or dirpath != os.fspath(staging):
                found.append(os.path.relpath(os.path.join(dirpath, name), staging))
    return sorted(found)


def _point_at_best(state: Any, final_dir: Path) -> None:
    """``state.best_model_checkpoint``: this checkpoint when its step is the best so far, else the
    published checkpoint of the best step if it is still there (``_save_checkpoint``'s rule, with
    our directory names)."""
    best = state.best_global_step
    if not best:
        return
    if best == state.global_step:
        state.best_model_checkpoint = os.fspath(final_dir)
        return
    for path in list_checkpoints(final_dir.parent):
        if checkpoint_counters(path.name)[1] == best:
            state.best_model_checkpoint = os.fspath(path)
            return
