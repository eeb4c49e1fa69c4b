"""Sharded models (FSDP2, tensor parallel, 2-D meshes) in the default safetensors format: each rank
writes only its local shards, a replicated block once, torch reads the files, resume is bitwise."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader

from resilience import ExitCode
from resilience.checkpoint.balance import balance
from resilience.checkpoint.formats.pieces import Block, _assign, overlap_slices
from resilience.checkpoint.layout import LATEST, MODEL_DIR, OPTIM_DIR, TRAINING_LOG
from resilience.checkpoint.storage.manifest import validate
from resilience.checkpoint.storage.safetensors_file import read_safetensors_header
from sharded_runs import assert_equal_tensors, bytes_per_rank, index_pieces, optimizer_state, record, run, shard_index, stored_copies, weights

FIRST, ALL = "step_scheduler.max_steps=3", "step_scheduler.max_steps=6"


def _about_one_nth(ckpt, world, tolerance=0.2):
    """Every rank's shard files hold about 1/world of the model's bytes, and together exactly it."""
    per_rank = bytes_per_rank(ckpt, world)
    total = shard_index(ckpt)["metadata"]["total_size"]
    assert sum(per_rank) == total, f"{per_rank}: some block is stored twice or missing (total {total})"
    for share in per_rank:
        assert abs(share / total - 1 / world) <= tolerance / world, f"{per_rank} of {total}: not about 1/{world} each"


def _interrupted_and_resumed(tmp_path, layout, world, *extra):
    """Run 3 steps (saved as the final checkpoint), then resume to 6: the two runs' outputs."""
    ckpt = tmp_path / "ck"
    assert run(ckpt, tmp_path / "first", layout, world, FIRST, *extra) == [0] * world
    validate(ckpt / LATEST)
    return ckpt, tmp_path / "first", tmp_path / "second"


def _assert_bitwise_continuation(first, second, uninterrupted, world):
    """The resumed run continues exactly: per-step losses and LR on every rank, final weights and optimizer state."""
    for rank in range(world):
        a, b, whole = record(first, rank), record(second, rank), record(uninterrupted, rank)
        assert b["steps"] == [4, 5, 6] and whole["steps"] == [1, 2, 3, 4, 5, 6]
        assert a["losses"] + b["losses"] == whole["losses"], f"rank {rank}: the losses differ from the uninterrupted run's"
        assert a["lrs"] + b["lrs"] == whole["lrs"]
    assert_equal_tensors(weights(second), weights(uninterrupted))
    assert_equal_tensors(optimizer_state(second), optimizer_state(uninterrupted))


@pytest.fixture(scope="module")
def fsdp2_uninterrupted(tmp_path_factory):
    """An uninterrupted 6-step FSDP2 run on 2 ranks: the reference of the resume tests."""
    out = tmp_path_factory.mktemp("fsdp2_whole")
    assert run(out / "ck", out / "rec", "fsdp", 2, ALL) == [0, 0]
    return out / "rec"


# -- the plan (no processes) -------------------------------------------------------------------------
def _block(global_shape, offsets, shape):
    return Block(tuple(global_shape), tuple(offsets), tuple(shape), "float32")


def test_a_replicated_model_is_planned_as_balance_over_whole_tensors_and_each_tensor_written_once():
    blocks = {"a": _block([4, 4], [0, 0], [4, 4]), "b": _block([8], [0], [8]), "c": _block([2, 3], [0, 0], [2, 3])}
    plan = _assign([blocks] * 3, 3)
    owners = {key: [piece["rank"] for piece in info["pieces"]] for key, info in plan.tensors.items()}
    assert owners == {key: [rank] for key, rank in balance({"a": 64, "b": 32, "c": 24}, 3).items()}


def test_uneven_and_empty_shards_are_planned_and_a_block_held_by_two_ranks_is_written_by_the_less_loaded():
    # 3 rows over 4 ranks: 1, 1, 1, 0 (rank 3 holds nothing of "w"); "r" is held whole by ranks 2 and 3
    held = [{"w": _block([3, 2], [i, 0], [1 if i < 3 else 0, 2])} for i in range(4)]
    held[2]["r"] = held[3]["r"] = _block([5], [0], [5])
    plan = _assign(held, 4)
    assert [piece["rank"] for piece in plan.tensors["w"]["pieces"]] == [0, 1, 2]
    assert [piece["rank"] for piece in plan.tensors["r"]["pieces"]] == [3], "rank 3 wrote nothing else"


def test_pieces_that_overlap_or_leave_a_gap_are_refused_by_the_plan():
    overlapping = [{"w": _block([4], [0], [3])}, {"w": _block([4], [2], [2])}]
    with pytest.raises(ValueError, match="overlap"):
        _assign(overlapping, 2)
    gap = [{"w": _block([4], [0], [1])}, {"w": _block([4], [2], [2])}]
    with pytest.raises(ValueError, match="cover 3 of its 4"):
        _assign(gap, 2)


def test_overlap_slices_give_the_common_region_in_both_blocks():
    assert overlap_slices([2, 0], [4, 6], [4, 0], [5, 6]) == ((slice(0, 2), slice(0, 6)), (slice(2, 4), slice(0, 6)))
    assert overlap_slices([0], [2], [2], [2]) is None
    assert overlap_slices([], [], [], []) == ((), ())


# -- real ranks ----------------------------------------------------------------------------------------
@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # torch's reader, read here in one process
def test_fsdp2_on_two_ranks_writes_half_the_model_per_rank_torch_reads_it_and_the_resume_is_bitwise(tmp_path, fsdp2_uninterrupted):
    ckpt, first, second = _interrupted_and_resumed(tmp_path, "fsdp", 2)
    _about_one_nth(ckpt, 2)
    optim = ckpt / LATEST / OPTIM_DIR  # the sharded optimizer state: per-rank pieces by rule, not DCP
    skeleton = json.loads((optim / "skeleton.json").read_text())
    assert skeleton["storage"] == "sharded_safetensors" and not (optim / ".metadata").exists()
    assert skeleton["index"]["tensors"]["state.up.weight.exp_avg"]["rule"] == {"mesh": [2], "dims": [0], "replica": 0}
    sizes = [(optim / f"shard-0000{k}-model-00001-of-00001.safetensors").stat().st_size for k in (1, 2)]
    assert abs(sizes[0] - sizes[1]) <= 0.2 * sum(sizes), f"{sizes}: not about half each"
    model_dir = ckpt / LATEST / MODEL_DIR
    index = shard_index(ckpt)
    assert index["version"] == 3 and index["tensors"]["up.weight"]["shape"] == [10, 6]
    assert index["tensors"]["up.weight"]["rule"] == {"mesh": [2], "dims": [0], "replica": 0}, "FSDP2: the rule, not the pieces"
    assert [p["offsets"] for p in index_pieces(ckpt, "up.weight")] == [[0, 0], [5, 0]]
    assert index_pieces(ckpt, "head.weight")[1] == {"file": "shard-00002-model-00001-of-00001.safetensors", "offsets": [2, 0], "shape": [1, 6]}
    for k in (1, 2):
        meta = read_safetensors_header(model_dir / f"shard-0000{k}-model-00001-of-00001.safetensors")["__metadata__"]
        info = json.loads(meta["DCP_SHARDING_INFO"])
        assert info["up.weight"] == {"saved_offsets": [0 if k == 1 else 5, 0], "global_shape": [10, 6]}
    # torch's own reader of per-rank HF safetensors (DCP_SHARDING_INFO) reassembles the saved weights
    saved = weights(first)
    read = {key: torch.empty_like(t) for key, t in saved.items()}
    dcp.load(read, storage_reader=HuggingFaceStorageReader(str(model_dir)), no_dist=True)
    assert_equal_tensors(read, saved)

    assert run(ckpt, second, "fsdp", 2, ALL) == [0, 0]
    _assert_bitwise_continuation(first, second, fsdp2_uninterrupted, 2)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_an_async_fsdp2_save_snapshots_the_local_shards_and_resumes_bitwise(tmp_path, fsdp2_uninterrupted):
    ckpt, first, second = _interrupted_and_resumed(tmp_path, "fsdp", 2, "checkpoint.is_async=true", "step_scheduler.ckpt_every_steps=1")
    manifest = json.loads((ckpt / LATEST / "manifest.json").read_text())
    assert manifest["meta"]["is_async"] is True
    _about_one_nth(ckpt, 2)
    assert run(ckpt, second, "fsdp", 2, ALL, "checkpoint.is_async=true") == [0, 0]
    _assert_bitwise_continuation(first, second, fsdp2_uninterrupted, 2)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_tensor_parallel_on_two_ranks_stores_replicated_tensors_once(tmp_path):
    """The layout only: the bitwise resume of TP (and of the 2x2 mesh below) after a stop signal
    is tests/e2e/test_sharded_e2e.py's, which runs the same meshes."""
    ckpt, _, _ = _interrupted_and_resumed(tmp_path, "tp", 2)
    _about_one_nth(ckpt, 2)
    for key in ("norm.weight", "head.weight", "down.bias"):  # plain tensors, and a Replicate DTensor (RowwiseParallel's bias)
        assert stored_copies(ckpt, key) == 1, f"{key} must be stored once"
        assert len(index_pieces(ckpt, key)) == 1
    assert [p["offsets"] for p in index_pieces(ckpt, "down.weight")] == [[0, 0], [0, 5]]  # row-wise: columns


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_a_2x2_data_parallel_by_tensor_parallel_mesh_writes_a_quarter_per_rank(tmp_path):
    ckpt, _, _ = _interrupted_and_resumed(tmp_path, "fsdp_tp", 4)
    _about_one_nth(ckpt, 4, tolerance=0.35)  # uneven on purpose: 10 rows -> tp 5 -> dp 3, 2
    for key in ("norm.weight", "down.bias"):  # FSDP-sharded over dp, copies along tp: each block stored once
        assert stored_copies(ckpt, key) == 1
    pieces = index_pieces(ckpt, "up.weight")
    assert [(p["offsets"][0], p["shape"][0]) for p in pieces] == [(0, 3), (3, 2), (5, 3), (8, 2)]  # strided FSDP x TP rows


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_partial_dtensor_parameter_is_a_config_error_on_every_rank_before_the_first_step(tmp_path, capfd):
    codes = run(tmp_path / "ck", tmp_path / "rec", "partial", 2)
    err = capfd.readouterr().err
    assert codes == [ExitCode.CONFIG_ERROR] * 2
    assert err.count("checkpoint.model_save_format=safetensors cannot save this model") == 2
    assert "head.bias is a DTensor with placement Partial(sum)" in err
    assert not (tmp_path / "ck" / TRAINING_LOG).exists(), "nothing trained"
    assert not (tmp_path / "ck" / LATEST).exists()
