"""The one JSON codec of saved state: what ``json`` cannot say exactly becomes a one-key tagged object.

=====================================  ===========================================================
``{"__tensor__": ref}``                a tensor; ``ref`` is what the caller's ``tensor`` function
                                       returned (a key into a safetensors file, or the inline form
                                       of :func:`tensor_to_json`)
``{"__tuple__": [...]}``               a tuple
``{"__items__": [[key, value], ...]}`` a dict with a key that is not a string (or whose one key is
                                       a tag)
``{"__float__": "nan"}``               a non-finite float (strict JSON has no NaN/Inf)
``{"__complex__": [re, im]}``          a complex number
``{"__counter__": [[key, n], ...]}``   a ``collections.Counter`` (``MultiStepLR``'s milestones: its
                                       int keys and its type both matter after a resume)
``{"__ndarray__": ref}``               a NumPy array, stored as the tensor ``torch.from_numpy`` makes
                                       of it (``ref`` as for a tensor) and given back as an array
``{"__numpy__": [dtype, value]}``      a NumPy scalar (``np.float32(0.5)``): its dtype (``"<f4"``) and
                                       its value, given back with that dtype (exactly: every NumPy
                                       number converts to a Python one and back without loss)
=====================================  ===========================================================

Anything else (``None``, booleans, numbers, strings, lists, string-keyed dicts) is itself, and
nothing is pickled. Used by registered extra state (``extra/<name>.json``, tensors in a
safetensors file beside it), the data position (in ``rank_state/rank_<R>.safetensors``'s header) and the LR
scheduler (``lr_scheduler.json``), tensors inline in the last two.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

TENSOR = "__tensor__"
TUPLE = "__tuple__"
ITEMS = "__items__"
FLOAT = "__float__"
NDARRAY = "__ndarray__"
NUMPY = "__numpy__"
COMPLEX = "__complex__"
COUNTER = "__counter__"
_TAGS = (TENSOR, TUPLE, ITEMS, FLOAT, NDARRAY, NUMPY, COMPLEX, COUNTER)


def encode(obj: Any, tensor: Callable[[torch.Tensor], Any], where: str) -> Any:
    """``obj`` as JSON-able data; each tensor becomes ``{"__tensor__": tensor(t)}``.

    Raises:
        TypeError: a value that is not a tensor, NumPy array, number, string, bool, None or
            container of these (the message names where it is: ``where`` and the path below it,
            e.g. ``extra.ema.shadow[2]``).
    """
    if isinstance(obj, torch.Tensor):
        return {TENSOR: tensor(obj)}
    np = sys.modules.get("numpy")  # a NumPy value exists only where NumPy was imported
    # Before float: np.float64 is a float subclass and would come back as a plain float.
    if np is not None and isinstance(obj, np.ndarray):
        try:  # ascontiguousarray makes a 0-d array 1-d: the shape is put back
            as_tensor = torch.from_numpy(np.ascontiguousarray(obj).reshape(obj.shape))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{where}: a NumPy array of dtype {obj.dtype} cannot be checkpointed ({exc})") from None
        return {NDARRAY: tensor(as_tensor)}
    if np is not None and isinstance(obj, np.generic):
        item = obj.item()
        if isinstance(item, np.generic):  # longdouble: no Python type holds it exactly
            raise TypeError(f"{where}: a NumPy {obj.dtype} scalar cannot be checkpointed exactly; convert it to float64 or a tensor")
        return {NUMPY: [obj.dtype.str, encode(item, tensor, where)]}
    if isinstance(obj, float) and not math.isfinite(obj):
        return {FLOAT: repr(obj)}
    if isinstance(obj, complex):
        return {COMPLEX: [encode(obj.real, tensor, where), encode(obj.imag, tensor, where)]}
    if isinstance(obj, Counter):
        return {COUNTER: [[encode(k, tensor, where), encode(v, tensor, f"{where}[{k!r}]")] for k, v in obj.items()]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {TUPLE: [encode(v, tensor, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, tensor, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not (len(obj) == 1 and next(iter(obj)) in _TAGS):
            return {k: encode(v, tensor, f"{where}.{k}") for k, v in obj.items()}
        return {ITEMS: [[encode(k, tensor, where), encode(v, tensor, f"{where}[{k!r}]")] for k, v in obj.items()]}
    raise TypeError(
        f"{where}: {type(obj).__name__} cannot be checkpointed; a state_dict() may hold tensors, NumPy arrays, "
        "numbers (NumPy's too), strings, booleans, None, and lists/tuples/dicts/Counters of these"
    )


def decode(obj: Any, tensor: Callable[[Any], torch.Tensor]) -> Any:
    """The value :func:`encode` encoded; ``tensor(ref)`` gives back each tensor."""
    if isinstance(obj, list):
        return [decode(v, tensor) for v in obj]
    if isinstance(obj, dict):
        if len(obj) == 1:
            ((tag, value),) = obj.items()
            if tag == TENSOR:
                return tensor(value)
            if tag == TUPLE:
                return tuple(decode(v, tensor) for v in value)
            if tag == ITEMS:
                return {decode(k, tensor): decode(v, tensor) for k, v in value}
            if tag == FLOAT:
                return float(value)
            if tag == COMPLEX:
                return complex(*(decode(v, tensor) for v in value))
            if tag == COUNTER:
                return Counter({decode(k, tensor): decode(v, tensor) for k, v in value})
            if tag == NDARRAY:
                return tensor(value).numpy()
            if tag == NUMPY:
                import numpy as np  # only a state that held NumPy values gets here

                dtype, item = value
                return np.dtype(dtype).type(decode(item, tensor))  # dtype.str: "<f4", "<U3"
        return {k: decode(v, tensor) for k, v in obj.items()}
    return obj


def tensor_to_json(t: torch.Tensor) -> dict[str, Any]:
    """A small tensor inline: ``{"dtype", "shape", "data"}`` (data as a flat list)."""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": t.flatten().tolist()}


def tensor_from_json(spec: dict[str, Any]) -> torch.Tensor:
    """The tensor :func:`tensor_to_json` wrote."""
    return torch.tensor(spec["data"], dtype=getattr(torch, spec["dtype"])).reshape(spec["shape"])
