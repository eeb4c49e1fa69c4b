"""Resharded loads of safetensors checkpoints: another world size, another mesh, sharded into
replicated and back. Each resumed run records the weights and optimizer state it loaded; they
must equal, bitwise, those the saving run ended with (its final checkpoint)."""

import pytest

from resilience.checkpoint.layout import LATEST, RANK_MANIFESTS_DIR
from resilience.checkpoint.storage.manifest import validate
from resilience.env_names import RANK_MANIFEST_BLOCK_ENV
from sharded_runs import assert_loaded, bytes_per_rank, index_pieces, record, run, shard_index, stored_copies

ELASTIC = "checkpoint.world_size_change=elastic"
EVEN = "8,12,4"  # sizes every tensor of which splits evenly over 4 ranks

pytestmark = pytest.mark.multiproc


def _steps(n):
    return f"step_scheduler.max_steps={n}"


@pytest.mark.timeout(900)
def test_fsdp2_four_ranks_write_a_quarter_each_and_load_on_two_ranks_then_into_a_plain_single_process_model(tmp_path):
    ckpt = tmp_path / "ck"
    four, two, one = tmp_path / "four", tmp_path / "two", tmp_path / "one"
    # rank manifests of 2 ranks each: ranks 0 and 2 write one; at 4 -> 2, rank 0 checks saved ranks 0 and 2 (both files)
    assert run(ckpt, four, "fsdp", 4, _steps(3), dims=EVEN, env={RANK_MANIFEST_BLOCK_ENV: "2"}) == [0] * 4
    total = shard_index(ckpt)["metadata"]["total_size"]
    assert bytes_per_rank(ckpt, 4) == [total // 4] * 4, "each rank wrote exactly its quarter"
    assert sorted(p.name for p in (ckpt / LATEST / RANK_MANIFESTS_DIR).iterdir()) == ["ranks_00000-00001.json", "ranks_00002-00003.json"]

    assert run(ckpt, two, "fsdp", 2, _steps(5), ELASTIC, dims=EVEN) == [0, 0]  # 4 -> 2
    assert_loaded(two, four)
    assert record(two)["steps"] == [4, 5]
    validate(ckpt / LATEST)
    assert shard_index(ckpt)["world_size"] == 2

    assert run(ckpt, one, "plain", 1, _steps(6), ELASTIC, dims=EVEN) == [0]  # 2 -> 1: FSDP2 into a plain model
    assert_loaded(one, two)


@pytest.mark.timeout(900)
def test_replicated_loads_into_fsdp2_fsdp2_into_tensor_parallel_and_that_into_a_plain_model(tmp_path):
    ckpt = tmp_path / "ck"
    ddp, fsdp, tp, plain = tmp_path / "ddp", tmp_path / "fsdp", tmp_path / "tp", tmp_path / "plain"
    assert run(ckpt, ddp, "plain", 2, _steps(3)) == [0, 0]  # replicated (DDP): whole tensors, each stored once
    assert all(len(index_pieces(ckpt, key)) == 1 for key in shard_index(ckpt)["tensors"])

    assert run(ckpt, fsdp, "fsdp", 2, _steps(5)) == [0, 0]  # replicated -> sharded
    assert_loaded(fsdp, ddp)
    assert run(ckpt, tp, "tp", 2, _steps(7)) == [0, 0]  # FSDP2 -> TP
    assert_loaded(tp, fsdp)
    assert run(ckpt, plain, "plain", 1, _steps(8), ELASTIC) == [0]  # TP -> one plain process (sharded -> replicated)
    assert_loaded(plain, tp)


@pytest.mark.timeout(900)
def test_an_hsdp_checkpoint_stores_its_replicated_mesh_dimension_once_and_loads_into_tensor_parallel_on_two_ranks(tmp_path):
    ckpt = tmp_path / "ck"
    hsdp, tp = tmp_path / "hsdp", tmp_path / "tp"
    assert run(ckpt, hsdp, "hsdp", 4, _steps(3), dims=EVEN) == [0] * 4  # placements (Replicate, Shard(0))
    total = shard_index(ckpt)["metadata"]["total_size"]
    per_rank = bytes_per_rank(ckpt, 4)
    assert sum(per_rank) == total and all(abs(b / total - 0.25) <= 0.07 for b in per_rank), per_rank
    assert all(stored_copies(ckpt, key) == 1 for key in shard_index(ckpt)["tensors"])
    assert run(ckpt, tp, "tp", 2, _steps(4), ELASTIC, dims=EVEN) == [0, 0]  # 4 -> 2, (Replicate, Shard) -> TP
    assert_loaded(tp, hsdp)
