"""Launch ``helpers/sharded_train.py`` (a tiny model laid out plain, FSDP2, TP, or on a 2-D mesh)
on real gloo ranks, and read back what it recorded and what its checkpoints hold; and the
examples'-runner form, ``helpers/mesh_train.py`` (:data:`MESH_SCRIPT`, started by ``runs.run``
with a signal to one rank), whose final weights :func:`mesh_final_weights` reads back."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from resilience.checkpoint.formats.model_io import load_model
from resilience.checkpoint.formats.shard_files import pieces_of
from resilience.checkpoint.layout import LATEST, MODEL_DIR, MODEL_SHARD_INDEX
from resilience.checkpoint.storage.safetensors_file import read_safetensors_header
from resilience.launch import launch

HELPERS = Path(__file__).resolve().parent / "helpers"
HELPER = HELPERS / "sharded_train.py"
MESH_SCRIPT = HELPERS / "mesh_train.py"


def run(
    ckpt: Path, out: Path, layout: str, nproc: int, *overrides: str, dims: str = "6,10,3", timeout: float = 300.0, env: dict[str, str] | None = None
) -> list[int]:
    """Run the helper with ``layout`` on ``nproc`` ranks (model sizes ``dims``: input, hidden,
    output; ``env``: more of its variables, e.g. ``LOADER``) until every rank exits; returns their exit codes."""
    cmd = [sys.executable, str(HELPER), str(ckpt), str(out), layout, *overrides]
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DIMS": dims, **(env or {})}
    if nproc == 1:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deadline = time.monotonic() + timeout
    with launch(cmd, nproc, env=env, failure_grace_s=30.0) as group:
        while group.poll() is None:
            assert time.monotonic() < deadline, f"sharded_train.py {layout} in {ckpt} still running after {timeout} s"
            time.sleep(0.05)
        return [proc.returncode for proc in group.procs]


def record(out: Path, rank: int = 0) -> dict:
    """What rank ``rank`` recorded: ``steps``, ``losses``, ``lrs`` (per step run), ``exit``."""
    return json.loads((out / f"rank{rank}.json").read_text())


def weights(out: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The full weights at the end of the run (gathered from every rank); ``prefix="loaded_"``:
    as the resume loaded them."""
    return load_file(str(out / f"{prefix}weights.safetensors"))


def optimizer_state(out: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The full optimizer state at the end of the run (or as loaded), keyed ``<fqn>/<name>``."""
    return load_file(str(out / f"{prefix}optim.safetensors"))


def assert_loaded(out: Path, saved_out: Path) -> None:
    """The run in ``out`` resumed with the weights and optimizer state the run in ``saved_out`` ended with."""
    assert_equal_tensors(weights(out, "loaded_"), weights(saved_out))
    assert_equal_tensors(optimizer_state(out, "loaded_"), optimizer_state(saved_out))


def assert_equal_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same keys; every tensor equal bitwise, with the same dtype and shape."""
    assert sorted(got) == sorted(expected)
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape, key
        assert torch.equal(got[key], tensor), f"{key} differs"


def shard_index(ckpt: Path) -> dict:
    """``model/shard_index.json`` of the checkpoint ``LATEST`` names."""
    return json.loads((ckpt / LATEST / MODEL_SHARD_INDEX).read_text())


def index_pieces(ckpt: Path, key: str) -> list[dict]:
    """The stored pieces of ``key`` in ``LATEST``'s ``shard_index.json`` (a rule's expanded)."""
    return pieces_of(shard_index(ckpt), key)


def bytes_per_rank(ckpt: Path, world: int) -> list[int]:
    """Tensor bytes in each rank's shard files (``shard-0000K-...``: rank K-1) of ``LATEST``."""
    out = [0] * world
    for path in (ckpt / LATEST / MODEL_DIR).glob("shard-*.safetensors"):
        header = read_safetensors_header(path)
        k = int(path.name.split("-")[1])
        out[k - 1] += sum(info["data_offsets"][1] - info["data_offsets"][0] for key, info in header.items() if key != "__metadata__")
    return out


def stored_copies(ckpt: Path, key: str) -> int:
    """How many elements of ``key`` the shard files of ``LATEST`` hold, over its global size."""
    index = shard_index(ckpt)
    total = 0
    for path in (ckpt / LATEST / MODEL_DIR).glob("shard-*.safetensors"):
        info = read_safetensors_header(path).get(key)
        if info is not None:
            total += math.prod(info["shape"])
    return total / math.prod(index["tensors"][key]["shape"])


def mesh_final_weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of ``LATEST`` of a :data:`MESH_SCRIPT` run, loaded (resharded) into an
    unsharded copy of its model in this process (whatever the world size and model format)."""
    sys.path.insert(0, str(HELPERS))  # the script imports its neighbour ``ranks``
    spec = importlib.util.spec_from_file_location("mesh_train", MESH_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.Net()
    load_model(Path(ckpt_dir) / LATEST, model)
    return model.state_dict()
