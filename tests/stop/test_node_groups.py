"""The stop agreement on node groups (4 real gloo ranks on "2 nodes" of 2): the same stop step on
every rank as the flat ring gives, a flag on one rank stops all, and a dead rank fails the round
within the groups' timeout instead of hanging.

One run of 4 processes (this file in ``worker`` mode, ``GROUP_RANK`` = rank // 2 as torchrun and
``resilience run`` set it) executes every scenario and writes each rank's results as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from resilience.stop.node_groups import UNKNOWN, node_key, node_plan, ring_hops

REPO = Path(__file__).resolve().parents[2]
WORLD, PER_NODE = 4, 2
# name -> (every_steps, {rank: (step the flag is passed at, code)}, steps, expected stop step, code)
CASES = {
    "rank3_t7_k1": (1, {3: (7, 1)}, 20, 8, 1),
    "rank1_t7_k4": (4, {1: (7, 1)}, 20, 12, 1),  # a non-leader, on the leader's node
    "rank2_t5_k4": (4, {2: (5, 1)}, 20, 12, 1),  # the other node's leader, the upper edge t + 2k - 1
    "max_two_nodes": (1, {0: (3, 2), 3: (3, 5)}, 20, 4, 5),
    "none_k2": (2, {}, 20, None, 0),
}


# --------------------------------------------------------------------------- worker (4 ranks)


def _cases(rank, nodes):
    from resilience.stop.agreement import StopAgreement

    out = {}
    for name, (every, flags, steps, _, _) in CASES.items():
        with StopAgreement(every_steps=every, nodes=nodes, timeout_s=20) as agreement:
            groups = agreement.node_groups
            t, code = flags.get(rank, (None, 0))
            results = [agreement.update(step, code if step == t else 0) for step in range(1, steps + 1)]
            now = [agreement.agree_now(3 if rank == 3 else 0), agreement.agree_now(0)]
        layout = None if groups is None else [groups.nodes, groups.per_node, groups.leader]
        out[name] = {"results": results, "layout": layout, "agree_now": now}
    return out


def _dead_rank(rank):
    """Rank 3 exits without a word after step 3; the others' next read fails, it does not hang."""
    from resilience.stop.agreement import StopAgreement

    agreement = StopAgreement(every_steps=1, timeout_s=5)
    t0 = time.monotonic()
    try:
        for step in range(1, 200):
            if rank == 3 and step == 4:
                os._exit(0)
            agreement.update(step, 0)
            time.sleep(0.01)
    except RuntimeError as exc:
        return {"error": type(exc).__name__, "after_s": time.monotonic() - t0}
    return {"error": None}


def _round_times():
    """``adaptive`` times its rounds at construction, on node groups or flat; a fixed cadence does not."""
    from resilience.stop.agreement import StopAgreement

    out = {}
    for name, kw in {"adaptive_auto": {"adaptive": True}, "adaptive_flat": {"adaptive": True, "nodes": "flat"}, "fixed": {}}.items():
        with StopAgreement(timeout_s=20, **kw) as agreement:
            out[name] = agreement.round_s
            out[f"{name}_results"] = [agreement.update(step, 0, propose_every_steps=2) for step in range(1, 7)] + [agreement.every_steps]
    return out


def worker(rank: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=20))
    report = {"auto": _cases(rank, "auto"), "flat": _cases(rank, "flat"), "round_s": _round_times()}
    Path(out_path).write_text(json.dumps(report))  # before the dead-rank scenario: rank 3 leaves in it
    report["dead"] = _dead_rank(rank)
    Path(out_path).write_text(json.dumps(report))
    os._exit(0)  # the groups hold a dead peer: no teardown that could wait on it


# --------------------------------------------------------------------------- launcher + tests


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run every scenario on 4 real gloo ranks, 2 per "node"; each rank's JSON report by rank."""
    tmp = tmp_path_factory.mktemp("node_groups")
    from gloo_ranks import run_worker_ranks  # here: the worker mode imports only what it runs

    return run_worker_ranks(__file__, WORLD, tmp, timeout=80, rank_env=lambda r: {"GROUP_RANK": str(r // PER_NODE), "LOCAL_WORLD_SIZE": str(PER_NODE)})


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CASES))
def test_node_groups_stop_every_rank_at_the_flat_rings_step(ranks, name):
    _, _, steps, expected, code = CASES[name]
    for r in range(WORLD):
        auto, flat = ranks[r]["auto"][name], ranks[r]["flat"][name]
        assert auto["layout"] == [2, 2, PER_NODE * (r // PER_NODE)]  # 2 nodes of 2; leaders 0 and 2
        assert flat["layout"] is None
        assert auto["results"] == flat["results"], (r, auto["results"], flat["results"])
        stop = next((s for s, c in enumerate(auto["results"], start=1) if c), None)
        assert stop == expected
        if expected is not None:
            assert auto["results"][expected - 1 :] == [code] * (steps - expected + 1)
        assert auto["agree_now"] == flat["agree_now"] == [3, 0]


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_an_adaptive_agreement_measures_its_round_for_the_cadence_floor(ranks):
    for r in range(WORLD):
        times = ranks[r]["round_s"]
        assert 0 < times["adaptive_auto"] < 5 and 0 < times["adaptive_flat"] < 5, times
        assert times["fixed"] == 0.0
        assert times["adaptive_auto_results"] == times["adaptive_flat_results"] == [0] * 6 + [2]  # proposals still apply


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_dead_rank_fails_the_round_on_the_others_instead_of_hanging(ranks):
    for r in range(3):
        dead = ranks[r]["dead"]
        assert dead["error"] == "RuntimeError", dead
        assert dead["after_s"] < 15, dead  # the groups' 5 s timeout, or the closed connection at once


def test_node_layout_from_the_environment_and_when_flat_is_kept():
    assert node_key({"GROUP_RANK": "3", "SLURM_NODEID": "9"}) == 3  # torchrun's first
    assert node_key({"SLURM_NODEID": "9"}) == 9
    assert node_key({}) == node_key({"GROUP_RANK": "x"}) == UNKNOWN
    assert node_plan([0, 1, 0, 1]) == [[0, 2], [1, 3]]  # Slurm's cyclic distribution: by key, not by block
    assert node_plan([0, 0, 0, 0]) is None  # one node
    assert node_plan([0, 1, 2, 3]) is None  # one rank per node
    assert node_plan([0, UNKNOWN, 1, 1]) is None  # a rank that does not know: flat everywhere
    assert ring_hops(8192) == 16382 and ring_hops(8192, 8) == 3 * 7 + 2 * 1023
    assert ring_hops(4, 8) == ring_hops(4) == 6


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
