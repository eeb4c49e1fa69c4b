"""A rank's RNG states and data position are one file per rank and save (``rank_state/``), and a
checkpoint of the older layout (two files per rank: ``rng/``, ``dataloader/``) still restores
both, exactly. Single process, real files."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, safe_open, save_file
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from resilience.checkpoint import Checkpointer, TrainingState
from resilience.checkpoint.layout import MANIFEST, RANK_MANIFESTS_DIR, RANK_STATE_DIR, dataloader_rank_file, rank_state_file, rng_rank_file
from resilience.checkpoint.storage.durable import record
from resilience.checkpoint.storage.manifest import all_files, validate
from resilience.config import CheckpointConfig
from resilience.distributed import DistContext
from resilience.state.data_position import resume_iterator
from resilience.state.rng import DATA_POSITION_KEY
from resilience.state.step_scheduler import StepScheduler

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torchdata's set_vital deprecation


def _state() -> tuple[TrainingState, Iterator]:
    """A shuffling StatefulDataLoader (its state holds a generator tensor) two batches in, and its iterator."""
    torch.manual_seed(0)
    loader = StatefulDataLoader(TensorDataset(torch.arange(20.0)), batch_size=2, shuffle=True)
    batches = iter(loader)
    next(batches), next(batches)
    return TrainingState(model=torch.nn.Linear(2, 1), dataloader=loader), batches


def _checkpointer(root: Path, state: TrainingState) -> Checkpointer:
    scheduler = StepScheduler(num_epochs=2, epoch=0, batches_in_epoch=2, global_step=2)
    return Checkpointer(CheckpointConfig(checkpoint_dir=str(root)), DistContext(), state=state, scheduler=scheduler)


def to_old_layout(directory: Path) -> None:
    """Rewrite a checkpoint as main wrote it before ``rank_state/``: rank 0's RNG states in
    ``rng/rank_00000.safetensors`` (the same tensors and header), its data position in
    ``dataloader/rank_00000.json``, a format 1 manifest (one list, no rank manifests) listing
    those two instead."""
    new = directory / rank_state_file(0)
    with safe_open(str(new), framework="pt") as fh:
        meta = dict(fh.metadata())
    position = meta.pop(DATA_POSITION_KEY)
    (directory / rng_rank_file(0)).parent.mkdir()
    save_file(load_file(str(new)), str(directory / rng_rank_file(0)), metadata=meta)
    (directory / dataloader_rank_file(0)).parent.mkdir()
    (directory / dataloader_rank_file(0)).write_text(position)
    shutil.rmtree(directory / RANK_STATE_DIR)
    doc = json.loads((directory / MANIFEST).read_text())
    doc["files"] = all_files(directory, doc)
    for rel in [rel for rel in doc["files"] if rel.startswith(RANK_MANIFESTS_DIR + "/")]:
        (directory / rel).unlink()
        del doc["files"][rel]
    doc["format_version"] = 1
    del doc["rank_blocks"]
    del doc["files"][rank_state_file(0)]
    for rel in (rng_rank_file(0), dataloader_rank_file(0)):
        doc["files"][rel] = record(directory, rel).manifest_entry()
    doc["files"] = dict(sorted(doc["files"].items()))
    (directory / MANIFEST).write_text(json.dumps(doc, indent=1, sort_keys=True))
    validate(directory)


@pytest.mark.parametrize("layout", ["rank_state", "old: rng/ and dataloader/"])
def test_rng_and_data_position_come_back_exactly_from_either_layout(tmp_path, layout):
    saved, batches = _state()
    directory = _checkpointer(tmp_path, saved).save("periodic")
    files = set(all_files(directory, json.loads((directory / MANIFEST).read_text())))
    assert rank_state_file(0) in files and not any(rel.startswith(("rng/", "dataloader/")) for rel in files), sorted(files)
    want_draws = (torch.rand(3), random.random(), np.random.rand(2))
    want_batches = [b[0] for b in batches]  # the rest of the epoch, from where it was saved
    if layout != "rank_state":
        to_old_layout(directory)

    fresh, _ = _state()
    ck = _checkpointer(tmp_path, fresh)
    restored = ck.load(ck.find_resume_point(), fresh)
    torch.rand(5), random.random(), np.random.rand(7)  # move every stream on
    Checkpointer.restore_rng(restored)
    draws = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(draws[0], want_draws[0]) and draws[1] == want_draws[1] and np.array_equal(draws[2], want_draws[2])
    assert restored.data_position["batches_in_epoch"] == 2
    got_batches = [b[0] for b in resume_iterator(fresh.dataloader, restored.data_position)]
    assert len(got_batches) == len(want_batches) == 8 and all(torch.equal(a, b) for a, b in zip(got_batches, want_batches))


def test_a_save_without_a_loader_writes_a_rank_state_without_data_position(tmp_path):
    state = TrainingState(model=torch.nn.Linear(2, 1))
    directory = _checkpointer(tmp_path, state).save("periodic")
    with safe_open(str(directory / rank_state_file(0)), framework="pt") as fh:
        assert DATA_POSITION_KEY not in fh.metadata()
    ck = _checkpointer(tmp_path, state)
    assert ck.load(directory, state).data_position is None
