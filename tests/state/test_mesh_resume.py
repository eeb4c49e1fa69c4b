"""A resume onto another device mesh counts samples per data-parallel replica, never per rank.

The ranks of one data-parallel replica (the tensor-parallel ranks of a mesh) train on the same
batches, so they count once in the global batch a checkpoint records, and their data positions
are one replica's. Runs of ``helpers/sharded_train.py`` over 48 samples in global batches of 8
(6 steps): tensor parallel x2 (one replica of batch 8), a 2x2 mesh (2 replicas of batch 4) and
FSDP2 x2 (2 replicas of batch 4), each ``DistributedSampler`` over the replicas. The epoch
resumed under FSDP2 x2 must train every sample exactly once, each rank the very batches an
uninterrupted FSDP2 x2 run trains at those steps, from the state the first run saved (the
losses differ: a tensor-parallel matmul rounds otherwise than a whole one).
"""

from __future__ import annotations

import json

import pytest
from torch.utils.data import DataLoader, DistributedSampler

from resilience import ConfigError, ExitCode
from resilience.checkpoint.layout import COMMON, LATEST, TRAINING_LOG
from resilience.checkpoint.storage.manifest import validate
from resilience.distributed import DistContext
from resilience.state.data_parallel import DataParallel, data_parallel_layout, position_rank
from sharded_runs import assert_loaded, record, run

SAMPLES = list(range(48))
ELASTIC = "checkpoint.world_size_change=elastic"


@pytest.fixture(scope="module")
def fsdp2_reference(tmp_path_factory):
    """An uninterrupted FSDP2 x2 epoch: rank -> the sample ids of each of its 6 steps."""
    base = tmp_path_factory.mktemp("fsdp2_reference")
    assert run(base / "ck", base / "out", "fsdp", 2, env={"LOADER": "sampler", "BATCH": "4"}) == [0, 0]
    return {rank: record(base / "out", rank)["ids"] for rank in (0, 1)}


def _global_batch(directory) -> tuple[int, int]:
    """The global batch a checkpoint records in its manifest and in ``common.json``."""
    return validate(directory)["meta"]["global_batch_size"], json.loads((directory / COMMON).read_text())["global_batch_size"]


def _check_resumed(first, resumed, saving_ranks, reference) -> None:
    """``resumed`` (FSDP2 x2) continued ``first`` (on ``saving_ranks``) at step 4, each of its ranks
    with the batches of the uninterrupted FSDP2 x2 run, and the epoch saw every sample once."""
    trained = {sample for rank in saving_ranks for ids in record(first, rank)["ids"] for sample in ids}
    assert len(trained) == 24, "3 steps of 8 samples, the same on the ranks of one replica"
    for rank in (0, 1):
        assert record(resumed, rank)["steps"] == [4, 5, 6]
        assert record(resumed, rank)["ids"] == reference[rank][3:], f"rank {rank}: the uninterrupted run's batches"
    later = [sample for rank in (0, 1) for ids in record(resumed, rank)["ids"] for sample in ids]
    assert sorted([*trained, *later]) == SAMPLES, "every sample of the epoch trained exactly once"
    assert_loaded(resumed, first)  # the weights and optimizer state the first run ended with, bitwise


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_tensor_parallel_run_resumed_as_fsdp2_trains_every_sample_of_the_epoch_once(tmp_path, fsdp2_reference):
    """TP x2 (one replica: both ranks train the same batch of 8) -> FSDP2 x2, with a
    ``StatefulDataLoader``, whose own state counts the samples of its replica's share: loaded
    as saved into another split it would skip. The right global batch (8) is accepted as configured."""
    ckpt, first, resumed = tmp_path / "ck", tmp_path / "tp", tmp_path / "fsdp2"
    stateful = {"LOADER": "stateful"}
    assert run(ckpt, first, "tp", 2, "step_scheduler.max_steps=3", "step_scheduler.global_batch_size=8", env={**stateful, "BATCH": "8"}) == [0, 0]
    assert record(first, 0)["ids"] == record(first, 1)["ids"], "the tensor-parallel ranks share batches"
    assert _global_batch(ckpt / "epoch_0_step_3") == (8, 8)

    assert run(ckpt, resumed, "fsdp", 2, env={**stateful, "BATCH": "4"}) == [0, 0]
    _check_resumed(first, resumed, (0, 1), fsdp2_reference)
    assert _global_batch(ckpt / LATEST) == (8, 8)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_2x2_mesh_resumed_as_fsdp2_on_two_ranks_trains_every_sample_of_the_epoch_once(tmp_path, fsdp2_reference):
    """2x2 (data x tensor: 2 replicas of batch 4, each on 2 ranks) -> FSDP2 x2 (elastic: 4 -> 2
    ranks); rank 1 now continues replica 1, which saved ranks 2 and 3 held."""
    ckpt, first, resumed = tmp_path / "ck", tmp_path / "mesh", tmp_path / "fsdp2"
    loader = {"LOADER": "sampler", "BATCH": "4"}
    assert run(ckpt, first, "fsdp_tp", 4, "step_scheduler.max_steps=3", env=loader) == [0] * 4
    assert _global_batch(ckpt / "epoch_0_step_3") == (8, 8)
    assert validate(ckpt / "epoch_0_step_3")["meta"]["data_parallel_replicas"] == [0, 0, 1, 1]

    assert run(ckpt, resumed, "fsdp", 2, ELASTIC, env=loader) == [0, 0]
    _check_resumed(first, resumed, (0, 2), fsdp2_reference)
    assert _global_batch(ckpt / LATEST) == (8, 8)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_tensor_parallel_model_whose_loader_cannot_say_which_ranks_share_batches_is_refused_on_every_rank(tmp_path, capfd):
    """A list of batches has no ``DistributedSampler``: under tensor parallelism nothing says
    whether the ranks train on the same batches, so resilient_loop() refuses, saying how to state it."""
    codes = run(tmp_path / "ck", tmp_path / "out", "tp", 2, env={"DATA_PARALLEL": "unstated"})
    err = capfd.readouterr().err
    assert codes == [ExitCode.CONFIG_ERROR] * 2
    assert err.count("data_parallel: rank 0: which ranks train on the same batches cannot be known: parameter 'up.weight'") == 2
    assert "resilient_loop(..., data_parallel=(dp_rank, dp_size))" in err
    assert not (tmp_path / "ck" / TRAINING_LOG).exists(), "nothing trained"


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_stated_layout_that_splits_tensor_parallel_ranks_into_replicas_is_refused_on_every_rank(tmp_path, capfd):
    """TP x2 stated ``data_parallel=(rank, 2)``: the ranks holding the two shards of ``up.weight``
    train on the same batches, so two replicas would count each batch twice (a global batch of 8
    for 4 samples) and a resume skip samples; resilient_loop() refuses, naming the fix."""
    codes = run(tmp_path / "ck", tmp_path / "out", "tp", 2, env={"DATA_PARALLEL": "per_rank"})
    err = capfd.readouterr().err
    assert codes == [ExitCode.CONFIG_ERROR] * 2
    assert err.count("data_parallel: parameter 'up.weight' is a DTensor sharded along mesh dimension 0 over ranks [0, 1]") == 2
    assert "(rank -> replica: {0: 0, 1: 1})" in err and "((0, 1) for tensor parallel alone)" in err
    assert not (tmp_path / "ck" / TRAINING_LOG).exists(), "nothing trained"


def test_a_stated_data_parallel_layout_is_checked_before_training():
    """Bad forms, a disagreement with the loader's sampler, and a replica no rank trains."""
    ctx, loader = DistContext(), DataLoader(list(range(8)), batch_size=2)
    assert data_parallel_layout(loader, None, ctx) == DataParallel((0,))
    for bad in ((1, 1), (0,), "0,1", (0, True), (-1, 2)):
        with pytest.raises(ConfigError, match=r"data_parallel: rank 0: expected \(dp_rank, dp_size\), two ints"):
            data_parallel_layout(loader, None, ctx, bad)
    with pytest.raises(ConfigError, match=r"a data-parallel size of 2 but no rank holds replica\(s\) \[1\]"):
        data_parallel_layout(loader, None, ctx, (0, 2))
    sampled = DataLoader(list(range(8)), batch_size=2, sampler=DistributedSampler(list(range(8)), num_replicas=2, rank=1))
    with pytest.raises(ConfigError, match=r"\(0, 2\) disagrees with the loader's DistributedSampler \(rank=1, num_replicas=2\)"):
        data_parallel_layout(sampled, None, ctx, (0, 2))


def test_a_rank_continues_the_data_position_of_a_saved_rank_of_its_replica_or_replays_the_epoch():
    two = DataParallel((0, 1))
    assert [position_rank([0, 1], 2, two, r) for r in (0, 1)] == [0, 1]  # the same layout: its own
    assert [position_rank([0, 0, 1, 1], 4, two, r) for r in (0, 1)] == [0, 2]  # 2x2 -> FSDP2 x2
    assert [position_rank([1, 0], 2, two, r) for r in (0, 1)] == [1, 0]  # the mesh's order swapped
    assert [position_rank([0, 0], 2, two, r) for r in (0, 1)] == [None, None]  # TP x2 -> FSDP2 x2: replayed
    assert [position_rank([0, 1], 2, DataParallel((0, 0)), r) for r in (0, 1)] == [None, None]  # FSDP2 x2 -> TP x2
    assert [position_rank(None, 2, two, r) for r in (0, 1)] == [0, 1]  # an older checkpoint: every rank its own


def test_a_stateful_loader_replayed_under_another_layout_is_refused_when_its_shuffle_cannot_be_drawn_again():
    """Another replica count replays the epoch from its start; a StatefulDataLoader(shuffle=True) keeps no
    epoch-start RNG and has no set_epoch, so the replay would draw another order and train other samples
    than the ones left, silently. A DistributedSampler (set_epoch) or a sequential order replays exactly."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from resilience.state.batch_size import BatchSizeChangeRefused, continue_with_batch_size

    steps = {"epoch": 0, "batches_in_epoch": 3, "global_step": 3}
    replay = {"batches_in_epoch": 3, "loader": None}
    meta = {"global_batch_size": 8}
    data = list(range(32))
    with pytest.raises(BatchSizeChangeRefused, match="no set_epoch"):
        continue_with_batch_size(steps, replay, meta, 8, loader=StatefulDataLoader(data, batch_size=4, shuffle=True), checkpoint="ck", configured=False)
    for loader in (
        StatefulDataLoader(data, batch_size=4),
        StatefulDataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=0)),
        DataLoader(data, batch_size=4, shuffle=True),  # no own state: its epoch_rng is saved (and carried over)
    ):
        assert continue_with_batch_size(steps, replay, meta, 8, loader=loader, checkpoint="ck", configured=False) == (steps, replay)
    at_start = {"batches_in_epoch": 0, "loader": None}
    assert (
        continue_with_batch_size(
            steps | {"batches_in_epoch": 0}, at_start, meta, 8, loader=StatefulDataLoader(data, batch_size=4, shuffle=True), checkpoint="ck", configured=False
        )[1]
        == at_start
    )
