"""resilience.stop.agreement: every rank stops after the same step, within the documented bound.

The 2-rank tests start two real processes running this file as a script (``worker`` mode below)
over a real gloo process group on 127.0.0.1. One run executes every scenario in sequence (one
process-group start instead of one per test) and writes each rank's results as JSON; the tests
then compare the ranks' results.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORLD = 2

# name -> (every_steps, {rank: (step the flag is passed at, reason code)}, steps to run, stop step
# expected on every rank (None = never), agreed code, use an explicit caller-made group).
# Each flag is passed to update() at that one step only: stickiness must carry it further.
CASES = {
    "rank1_t7_k1": (1, {1: (7, 1)}, 30, 8, 1, False),
    "rank0_t7_k1": (1, {0: (7, 1)}, 30, 8, 1, False),
    "rank1_t7_k4": (4, {1: (7, 1)}, 30, 12, 1, True),
    "rank0_t7_k4": (4, {0: (7, 1)}, 30, 12, 1, False),
    "rank0_t5_k4_upper_edge": (4, {0: (5, 1)}, 30, 12, 1, False),  # t + 2k - 1
    "rank1_t8_k4_lower_edge": (4, {1: (8, 1)}, 30, 12, 1, False),  # t + k
    "rank0_t6_k3": (3, {0: (6, 1)}, 30, 9, 1, True),
    "max_same_step": (1, {0: (3, 2), 1: (3, 5)}, 30, 4, 5, False),
    "max_within_cadence": (4, {0: (5, 1), 1: (6, 4)}, 30, 12, 4, False),
    "none_k1": (1, {}, 50, None, 0, False),
    "none_k4": (4, {}, 50, None, 0, True),
}


# --------------------------------------------------------------------------- worker (2 ranks)


def _run_case(rank, every, flags, steps, explicit):
    import torch.distributed as dist

    from resilience.stop.agreement import StopAgreement

    group = dist.new_group(backend="gloo") if explicit else None
    results = []
    with StopAgreement(group, every_steps=every) as agreement:
        for step in range(1, steps + 1):
            t, code = flags.get(rank, (None, 0))
            results.append(agreement.update(step, code if step == t else 0))
        left_in_flight = agreement.in_flight  # expected False once agreed (nothing started after)
    return {"results": results, "in_flight_after_agreement": left_in_flight}


def _drain_scenario(rank):
    from resilience.stop.agreement import StopAgreement

    out = {}
    agreement = StopAgreement(every_steps=4)
    out["bad_flags_between_rounds"] = []
    for flag in (-1, 1.0, "1"):  # the quick path between rounds still checks its input
        try:
            agreement.update(1, flag)
            out["bad_flags_between_rounds"].append("no error")
        except (TypeError, ValueError) as exc:
            out["bad_flags_between_rounds"].append(type(exc).__name__)
    for step in range(1, 7):  # the all-reduce started at step 4 is still unread after step 6
        agreement.update(step, 0)
    out["in_flight_before"] = agreement.in_flight
    out["drain_zero"] = [agreement.drain(), agreement.drain()]
    out["in_flight_after"] = agreement.in_flight
    # update() continues after a drain that returned 0: rank 1 flags at 13 -> start 16, read 20.
    later = [agreement.update(step, 1 if (rank == 1 and step == 13) else 0) for step in range(7, 21)]
    out["after_drain"] = later
    out["close"] = agreement.close()
    try:
        agreement.update(21, 0)
        out["update_after_close"] = "no error"
    except RuntimeError as exc:
        out["update_after_close"] = str(exc)

    agreement = StopAgreement(every_steps=4)
    for step in range(1, 7):  # rank 1's flag rides the all-reduce started at step 4
        agreement.update(step, 3 if (rank == 1 and step == 4) else 0)
    out["drain_flag"] = [agreement.drain(), agreement.drain(), agreement.in_flight]
    out["close_flag"] = agreement.close()
    return out


def _agree_now_scenario(rank):
    from resilience.stop.agreement import StopAgreement

    with StopAgreement() as agreement:
        return [agreement.agree_now(3 if rank == 1 else 0), agreement.agree_now(True if rank == 0 else 2), agreement.agree_now(False)]


def _cadence_mismatch_scenario(rank):
    from resilience.stop.agreement import StopAgreement

    try:
        StopAgreement(every_steps=2 + rank)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _adaptive_scenario(rank):
    from resilience.stop.agreement import StopAgreement

    # Rank 0 proposes k=5 at step 3 (read at step 4 by both); rank 1 flags at step 11: carried by
    # the round started at 15 (the first multiple of 5 after 11), read at 20.
    cadence, results, due = [], [], []
    with StopAgreement(every_steps=1, adaptive=True) as agreement:
        for step in range(1, 26):
            propose = 5 if (rank == 0 and step == 3) else 0
            due.append(agreement.starts_round(step))
            results.append(agreement.update(step, 1 if (rank == 1 and step == 11) else 0, propose_every_steps=propose))
            cadence.append(agreement.every_steps)
    return {"cadence": cadence, "results": results, "starts_round": due, "starts_round_after_close": agreement.starts_round(30)}


def _measure(rank):
    import torch
    import torch.distributed as dist

    from resilience.stop.agreement import StopAgreement

    def per_call_ms(agreement, steps, busy_s=0.0):
        spent = []
        for step in range(1, steps + 1):
            if busy_s:  # stands in for a training step's compute
                end = time.perf_counter() + busy_s
                while time.perf_counter() < end:
                    pass
            t0 = time.perf_counter()
            result = agreement.update(step, 0)
            spent.append(time.perf_counter() - t0)
            assert result == 0
        return {
            "mean_ms": 1e3 * sum(spent) / steps,
            "median_ms": 1e3 * statistics.median(spent),
            "p99_ms": 1e3 * sorted(spent)[int(0.99 * steps) - 1],
            "steps": steps,
        }

    out = {}
    with StopAgreement(every_steps=1) as agreement:
        out["update_k1_tight"] = per_call_ms(agreement, 1000)
    with StopAgreement(every_steps=10) as agreement:
        out["update_k10_tight"] = per_call_ms(agreement, 1000)
    with StopAgreement(every_steps=1) as agreement:
        out["update_k1_5ms_step"] = per_call_ms(agreement, 200, busy_s=0.005)
    group = dist.new_group(backend="gloo")
    flag = torch.zeros(1, dtype=torch.int64)
    spent = []
    for _ in range(1000):
        t0 = time.perf_counter()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        spent.append(time.perf_counter() - t0)
    out["blocking_allreduce"] = {"mean_ms": 1e3 * sum(spent) / 1000, "median_ms": 1e3 * statistics.median(spent)}
    return out


def worker(rank: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=20))
    report = {"cases": {}}
    for name, (every, flags, steps, _, _, explicit) in CASES.items():
        report["cases"][name] = _run_case(rank, every, {int(r): v for r, v in flags.items()}, steps, explicit)
    report["drain"] = _drain_scenario(rank)
    report["agree_now"] = _agree_now_scenario(rank)
    report["cadence_mismatch"] = _cadence_mismatch_scenario(rank)
    report["adaptive"] = _adaptive_scenario(rank)
    report["measure"] = _measure(rank)
    dist.destroy_process_group()
    Path(out_path).write_text(json.dumps(report))


# --------------------------------------------------------------------------- launcher + tests


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run all scenarios on 2 real gloo ranks; return each rank's JSON report, indexed by rank."""
    tmp = tmp_path_factory.mktemp("agreement")
    from gloo_ranks import run_worker_ranks  # here: the worker mode imports only what it runs

    return run_worker_ranks(__file__, WORLD, tmp, timeout=50)


def _stop_step(results):
    return next((step for step, code in enumerate(results, start=1) if code), None)


@pytest.mark.multiproc
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_stops_at_the_same_step_within_bound(ranks, name):
    every, flags, steps, expected_step, expected_code, _ = CASES[name]
    per_rank = [ranks[r]["cases"][name]["results"] for r in range(WORLD)]
    assert all(len(res) == steps for res in per_rank)
    stops = [_stop_step(res) for res in per_rank]
    assert stops[0] == stops[1] == expected_step, per_rank
    if expected_step is None:
        assert all(code == 0 for res in per_rank for code in res)
        return
    for res in per_rank:
        assert res[expected_step - 1 :] == [expected_code] * (steps - expected_step + 1)  # final once agreed
        assert not any(res[: expected_step - 1])
    first_flag = min(t for t, _ in flags.values())
    assert first_flag + every <= expected_step <= first_flag + 2 * every - 1  # the documented bound
    assert expected_step == math.ceil(first_flag / every) * every + every  # the documented exact step
    assert not any(ranks[r]["cases"][name]["in_flight_after_agreement"] for r in range(WORLD))


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_drain_returns_inflight_result_and_leaves_nothing_pending(ranks):
    for r in range(WORLD):
        d = ranks[r]["drain"]
        assert d["in_flight_before"] is True
        assert d["bad_flags_between_rounds"] == ["ValueError", "TypeError", "TypeError"]
        assert d["drain_zero"] == [0, 0]  # idempotent
        assert d["in_flight_after"] is False
        assert d["after_drain"] == [0] * 13 + [1]  # steps 7..19 continue, step 20 stops
        assert d["close"] == 1
        assert "closed" in d["update_after_close"]
        assert d["drain_flag"] == [3, 3, False]  # a flag still in flight is not lost at the end
        assert d["close_flag"] == 3


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_agree_now_is_max_over_ranks(ranks):
    assert ranks[0]["agree_now"] == ranks[1]["agree_now"] == [3, 2, 0]


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_cadence_mismatch_raises_on_every_rank(ranks):
    for r in range(WORLD):
        assert "equal on all ranks" in ranks[r]["cadence_mismatch"]
        assert "from 2 to 3" in ranks[r]["cadence_mismatch"]


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_adaptive_cadence_switches_on_every_rank_at_the_same_step(ranks):
    for r in range(WORLD):
        a = ranks[r]["adaptive"]
        assert a["cadence"] == [1, 1, 1] + [5] * 22  # rank 0's proposal, read by both at step 4
        assert _stop_step(a["results"]) == 20
        # a round at steps 1-4 (k=1), then every 5th step up to the agreed stop, none after it or after close()
        assert [step for step, due in enumerate(a["starts_round"], start=1) if due] == [1, 2, 3, 4, 5, 10, 15, 20]
        assert a["starts_round_after_close"] is False
    assert ranks[0]["adaptive"] == ranks[1]["adaptive"]


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_update_cost_measurement(ranks):
    """Printed, not asserted (timings vary); asserts only that the runs completed with no stop."""
    for r in range(WORLD):
        m = ranks[r]["measure"]
        assert m["update_k1_tight"]["steps"] == 1000 and m["update_k1_5ms_step"]["steps"] == 200
        line = ", ".join(f"{k}: mean {v['mean_ms']:.3f} ms median {v['median_ms']:.3f} ms" for k, v in m.items())
        print(f"\n[agreement cost, rank {r}] {line}")


def test_local_mode_without_process_group():
    import torch.distributed as dist

    from resilience.stop.agreement import StopAgreement

    assert not dist.is_initialized()
    with StopAgreement(every_steps=4) as agreement:
        assert not agreement.distributed and agreement.group is None
        assert [agreement.update(step, 0) for step in range(1, 6)] == [0] * 5
        assert agreement.update(6, 2) == 2  # no peers: the flag applies at once, at any step
        assert agreement.update(7, 0) == 2  # final once agreed
        assert agreement.update(8, 5) == 2
        assert agreement.agree_now(3) == 3 and agreement.agree_now(False) == 0
        assert not agreement.in_flight
        assert agreement.drain() == 2 and agreement.drain() == 2
    with pytest.raises(RuntimeError, match="closed"):
        agreement.update(9, 0)
    with StopAgreement() as agreement:
        assert agreement.update(1, True) == 1  # bool True is reason 1


@pytest.mark.parametrize("every, error", [(0, ValueError), (-1, ValueError), (True, TypeError), (1.5, TypeError)])
def test_bad_every_steps_is_rejected(every, error):
    from resilience.stop.agreement import StopAgreement

    with pytest.raises(error, match="every_steps"):
        StopAgreement(every_steps=every)


@pytest.mark.parametrize("flag, error", [(-1, ValueError), (1.0, TypeError), ("1", TypeError)])
def test_bad_local_stop_is_rejected(flag, error):
    from resilience.stop.agreement import StopAgreement

    with pytest.raises(error, match="local_stop"):
        StopAgreement().update(1, flag)


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "worker":
    worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
