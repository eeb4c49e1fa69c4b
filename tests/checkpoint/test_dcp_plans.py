"""The DCP adapter (resilience.checkpoint.storage.dcp_io): plan caching on, keyed per state, across
checkpoint directories, exact after a layout change; ``.metadata`` unpickled once per load."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.planner import SavePlanner

from resilience.checkpoint.storage import dcp_io

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP in one process, no process group


def _roundtrip(tmp_path, name, tensors):
    dcp_io.save_tensors(tensors, tmp_path / name / "optim", rank=0, group=None)
    loaded = {key: torch.zeros_like(t) for key, t in tensors.items()}
    before = dcp_io.SafeFileSystemReader.parses
    dcp_io.load_tensors(loaded, tmp_path / name / "optim", group=None)
    assert dcp_io.SafeFileSystemReader.parses == before + 1, ".metadata must be unpickled once per load (our check and DCP's load share it)"
    assert all(torch.equal(loaded[key], t) for key, t in tensors.items()), name


def test_plans_are_cached_under_our_key_across_directories_and_a_changed_layout_saves_exact(tmp_path):
    a = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)}
    _roundtrip(tmp_path, "step_1", a)
    assert "resilience.optim" in SavePlanner._cached_global_plan, "DCP's plan caching is on, under our key"
    _roundtrip(tmp_path, "step_2", {key: t + 1 for key, t in a.items()})  # same layout: the cached plan, other values
    _roundtrip(tmp_path, "step_3", {"w": torch.arange(20.0).reshape(5, 4), "c": torch.zeros(2)})  # changed layout: planned again
