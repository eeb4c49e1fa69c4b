"""Untrusted checkpoints: loading never unpickles anything but DCP's own metadata classes."""

import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch

from resilience.checkpoint import Checkpointer, TrainingState
from resilience.checkpoint.storage.dcp_io import UnsafeCheckpointError
from resilience.checkpoint.storage.durable import DIGEST, file_digest
from resilience.config import CheckpointConfig
from resilience.distributed import DistContext
from resilience.state.step_scheduler import StepScheduler

PACKAGE = Path(__file__).resolve().parents[2] / "resilience"


class _Payload:
    """Unpickling this runs os.system: the classic pickle exploit."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _trained_state(seed: int = 0) -> TrainingState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return TrainingState(model=model, optimizer=optimizer)


def _rewrite_with_matching_manifest(directory: Path, rel: str, data: bytes) -> None:
    """Replace a file and fix its manifest entry, as an attacker who controls the files would."""
    (directory / rel).write_bytes(data)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"][rel] = {"size": len(data), DIGEST: file_digest(directory / rel)}
    (directory / "manifest.json").write_text(json.dumps(manifest))


def test_a_crafted_pickle_in_dcp_metadata_is_refused_and_never_executed(tmp_path):
    ck = Checkpointer(
        CheckpointConfig(checkpoint_dir=str(tmp_path / "ck")),
        DistContext(),
        state=_trained_state(),
        scheduler=StepScheduler(num_epochs=1, global_step=1, batches_in_epoch=1),
    )
    saved = ck.save()
    marker = tmp_path / "pwned"
    _rewrite_with_matching_manifest(saved, "optim/.metadata", pickle.dumps(_Payload(marker)))

    assert ck.find_resume_point() == saved, "the manifest matches, so it is chosen; loading must refuse"
    with pytest.raises(UnsafeCheckpointError, match="posix.system|os.system"):
        ck.load(saved, _trained_state(seed=1))
    assert not marker.exists(), "the payload ran"


def test_every_load_in_the_package_avoids_unpickling():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        previous = ""
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\btorch\.load\(", line) and "weights_only=True" not in line:
                offenders.append(f"{path}:{number}: {line.strip()}")
            # DistContext's gather to rank 0 unpickles what its peers sent over the library's own
            # gloo group, as torch's all_gather_object does: never bytes read from a checkpoint
            peers = path.name == "distributed.py" and "peers' bytes" in previous
            if re.search(r"\bpickle\.loads?\(", line) and not peers:
                offenders.append(f"{path}:{number}: {line.strip()}")
            previous = line
    assert not offenders, offenders
