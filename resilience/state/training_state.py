"""``TrainingState``: the objects of a training run that a checkpoint captures and restores."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import sys
import types
import warnings
from typing import Any

import torch

from resilience.checkpoint.layout import SAFETENSORS_SUFFIX
from resilience.state import tagged_json
from resilience.state.data_position import check_loader_state, loader_length
from resilience.state.worker_rng import randomness_not_restored

# An extra state's name becomes a file name (extra/<name>.json): no separators, no leading dot.
_EXTRA_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_EXTRA_NAME_MAX = 255 - len(SAFETENSORS_SUFFIX)  # NAME_MAX of Linux filesystems, less extra/<name>.safetensors's suffix


@dataclasses.dataclass
class TrainingState:
    """The objects a checkpoint captures. Any may be ``None`` except ``model``.

    ``extra`` maps a name to any object with ``state_dict()``/``load_state_dict()`` whose state
    holds tensors, NumPy arrays, numbers, strings and containers of these (saved by rank 0 as
    ``extra/<name>.json`` plus ``extra/<name>.safetensors`` for its tensors).

    Raises (at construction, so a bad object fails before any training rather than at the first
    save, where a preemption's save would be lost):
        TypeError: ``model`` is not a ``torch.nn.Module``; a ``tokenizer`` without ``save_pretrained()``; an ``optimizer`` whose ``step()`` needs a
            closure (LBFGS: it could not be resumed); ``optimizer``, ``lr_scheduler`` or an
            ``extra`` value lacks ``state_dict()``/``load_state_dict()``; the ``lr_scheduler``'s or
            an ``extra`` state holds a value that cannot be checkpointed (the message names
            where, e.g. ``extra.ema.shadow[2]``; see :mod:`resilience.state.tagged_json`).
        ValueError: a ``dataloader`` of length 0; an ``extra`` name that cannot be a file name (accepted: letters, digits,
            ``_``, ``.``, ``-``, not starting with ``.`` or ``-``, at most 243 characters).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None
    dataloader: Any = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    tokenizer: Any = None
    """A Hugging Face tokenizer (anything with ``save_pretrained``): its files go next to the model."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(self.model).__name__}")
        if loader_length(self.dataloader) == 0:
            raise ValueError("dataloader: it has no batches (len() is 0): an empty dataset, or batch_size larger than it with drop_last=True")
        if (why := randomness_not_restored(self.dataloader)) is not None:
            warnings.warn(why, UserWarning, stacklevel=_callers_level())
        if self.dataloader is not None:
            check_loader_state(self.dataloader)  # its own state_dict() if that works, else a replay (logged)
        if _check_stateful("optimizer", self.optimizer):
            _check_step_without_closure(self.optimizer)
        if _check_stateful("lr_scheduler", self.lr_scheduler):
            tagged_json.encode(self.lr_scheduler.state_dict(), lambda tensor: None, "lr_scheduler.state_dict()")  # raises naming the value
        if self.tokenizer is not None and not callable(getattr(self.tokenizer, "save_pretrained", None)):
            raise TypeError(
                f"tokenizer: a {type(self.tokenizer).__name__} has no save_pretrained() to save it with the model; "
                "accepted: a Hugging Face tokenizer (transformers' PreTrainedTokenizer(Fast), e.g. PreTrainedTokenizerFast(tokenizer_object=...))"
            )
        for name, obj in self.extra.items():
            if not isinstance(name, str) or not _EXTRA_NAME.fullmatch(name) or len(name) > _EXTRA_NAME_MAX:
                raise ValueError(
                    f"extra_state: the name {name!r} cannot be a file name (extra/<name>.json); use letters, digits, "
                    f"'_', '.' and '-', not starting with '.' or '-', at most {_EXTRA_NAME_MAX} characters"
                )
            _check_stateful(f"extra_state[{name!r}]", obj)
            tagged_json.encode(obj.state_dict(), lambda tensor: None, f"extra.{name}")  # raises naming the value


def _check_stateful(what: str, obj: Any) -> bool:
    """True for an object with callable ``state_dict``/``load_state_dict``, False for None."""
    if obj is None:
        return False
    for method in ("state_dict", "load_state_dict"):
        if not callable(getattr(obj, method, None)):
            raise TypeError(f"{what}: a {type(obj).__name__} has no {method}() to checkpoint it with")
    return True


def _check_step_without_closure(optimizer: Any) -> None:
    """torch.distributed.checkpoint's ``get_optimizer_state_dict``/``set_optimizer_state_dict``,
    which capture and restore the optimizer, first give a fresh optimizer its state by calling
    ``step()`` with zero gradients and no closure; an optimizer whose ``step`` needs one (LBFGS)
    would save but fail at the resume."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # a builtin or wrapped step: nothing to tell
        return
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise TypeError(
            f"optimizer: {type(optimizer).__name__}.step() needs a closure, and torch.distributed.checkpoint's state-dict "
            "helpers that restore an optimizer call step() without one, so it could be saved but never resumed; "
            "use an optimizer whose closure is optional"
        )


def _callers_level() -> int:
    """``warnings.warn``'s ``stacklevel``, called from ``__post_init__``, that names the first line
    outside this package (and outside the dataclass's generated ``__init__``): the user's
    ``resilient_loop()`` or ``TrainingState(...)`` call, not ours."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame: types.FrameType | None
    frame, level = sys._getframe(2), 2  # level 1: __post_init__; 2: the generated __init__
    while frame is not None and (frame.f_code.co_filename == "<string>" or os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep)):
        frame, level = frame.f_back, level + 1
    return level
