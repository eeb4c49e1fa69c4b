"""Our collectives on 2 real gloo ranks: a healthy verdict is a flag reduce (no payload moved), the
save's records reach rank 0 only (each rank's own files its block's first rank only), a failure on
one rank raises the same error on every rank."""

import json
import sys
from pathlib import Path

import pytest

from resilience.launch import launch

pytestmark = pytest.mark.multiproc
HELPER = Path(__file__).resolve().parent / "helpers" / "collectives.py"


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    out = tmp_path_factory.mktemp("collectives")
    with launch([sys.executable, str(HELPER), str(out)], 2, env={"OMP_NUM_THREADS": "1"}, failure_grace_s=10.0) as group:
        assert group.wait(timeout=60) == 0
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(90)
def test_a_healthy_verdict_is_one_flag_reduce_and_gathers_no_payload(outcome):
    for rank in outcome:
        assert rank["healthy_verdict"] == {"result": [None, None], "calls": {"all_reduce": 1}}
        assert rank["verdict_without_share"] == {"result": None, "calls": {"all_reduce": 1}}


@pytest.mark.timeout(90)
def test_the_records_reach_rank_0_only_unpadded(outcome):
    rank0, rank1 = (rank["records_to_root"] for rank in outcome)
    assert rank0["result"][0] == ["model/shard-0.safetensors", "rng/rank_0.safetensors"]
    assert len(rank0["result"][1]) == 102 and rank0["result"][1][0] == "model/shard-1.safetensors"
    assert rank1["result"] is None  # nothing of rank 0's reached rank 1
    for call in (rank0, rank1):
        assert call["calls"] == {"all_reduce": 1, "gather": 1}  # no all-gather of records


@pytest.mark.timeout(90)
def test_rank_0s_share_reaches_every_rank(outcome):
    for rank in outcome:
        assert rank["verdict_with_share"]["result"] == ["epoch_0_step_1"]
        assert "all_gather_object" not in rank["verdict_with_share"]["calls"]
        assert rank["payload_everywhere"]["result"] == [0, 10]


@pytest.mark.timeout(90)
def test_one_failing_rank_raises_the_same_error_on_every_rank(outcome):
    for label, detail in (("one_rank_fails_records", "rank 1: disk full"), ("one_rank_fails_verdict", "rank 0: rename failed")):
        raised = {rank[label]["raised"] for rank in outcome}
        assert raised == {f"failed: {detail}"}, raised
        for rank in outcome:
            assert rank[label]["calls"].get("all_gather_object") == 1  # the messages, only on failure


@pytest.mark.timeout(90)
def test_own_records_reach_their_blocks_leader_point_to_point(outcome):
    rank0, rank1 = (rank["to_leaders_of_2"] for rank in outcome)
    assert rank0["result"] == [["rank_state/rank_0"], ["rank_state/rank_1"] * 51]  # unequal sizes, no padding
    assert rank1["result"] is None
    assert rank0["calls"] == {"recv": 2} and rank1["calls"] == {"send": 2}  # a length, then the bytes; no collective
    for r, rank in enumerate(outcome):  # a block of one: every rank leads itself, nothing moves
        assert rank["to_leaders_of_1"] == {"result": [[f"rank_state/rank_{r}"]], "calls": {}}
