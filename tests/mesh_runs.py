"""Run ``helpers/mesh_train.py`` (a tiny model sharded with FSDP2, TP or both) through the
examples' runner, and read a run's final weights back as full tensors.

Shared by the sharded end-to-end tests and the fault harness's sharded test.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from resilience.checkpoint.formats.model_io import load_model
from resilience.checkpoint.layout import LATEST

HELPERS = Path(__file__).resolve().parent / "helpers"
SCRIPT = HELPERS / "mesh_train.py"


def _helper():
    sys.path.insert(0, str(HELPERS))  # it imports its neighbour ``ranks``
    spec = importlib.util.spec_from_file_location("mesh_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def final_weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of ``LATEST``, loaded (resharded) into an unsharded copy of the helper's model."""
    model = _helper().Net()
    load_model(Path(ckpt_dir) / LATEST, model)  # DCP or shards, any world size, into this one process
    return model.state_dict()
