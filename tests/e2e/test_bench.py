"""The benchmark suite (``python -m bench``) runs end to end at a tiny size and reports every figure.

Timings are never asserted: only that each figure was measured, printed and written as JSON
with its raw times and sizes.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # bench/ is a top-level package of the repository, not installed

from bench.common import parse_size  # noqa: E402
from bench.goodput import LogTail, summarise  # noqa: E402
from bench.report import CI_KEYS, KEYS, LOADED_PREFIX  # noqa: E402
from bench.stats import controlled_overhead, cost_fraction, mean_interval, median_interval, paired_overhead  # noqa: E402


def test_size_option_accepts_bytes_and_binary_suffixes_and_names_itself_on_bad_input():
    assert parse_size("4096000") == 4096000
    assert parse_size("64M") == 64 << 20
    assert parse_size("1G") == 1 << 30
    assert parse_size("1.5GiB") == 3 << 29
    for bad in ("", "1X", "-1G", "G", "1K"):  # 1K: below the 64K floor
        with pytest.raises(ValueError, match="--size"):
            parse_size(bad)


def test_median_interval_is_between_order_statistics_with_their_true_coverage():
    five = median_interval([5.0, 1.0, None, 4.0, 2.0, 3.0])
    assert five["median"] == 3.0 and five["n"] == 5
    assert (five["ci_low"], five["ci_high"]) == (1.0, 5.0)  # below 6 rounds: the range ...
    assert five["confidence"] == pytest.approx(1 - 2 / 32)  # ... which covers the median with 93.75 %
    nine = median_interval(list(range(1, 10)))
    assert (nine["ci_low"], nine["ci_high"]) == (2, 8) and nine["confidence"] >= 0.95  # x(2), x(8) of 9
    one = median_interval([0.7])
    assert one["median"] == 0.7 and one["ci_low"] is None and one["ci_high"] is None
    assert median_interval([])["median"] is None


def _within_rows(figure: dict) -> bool:
    """The figure and its interval are ratios of sums of the same rows, so each lies between the
    smallest and the largest row's own overhead (with 3 rows the percentile interval need not hold
    the value: the quick run once had it 1e-16 above the interval's top)."""
    rows = figure["rounds"]
    low, high = min(rows), max(rows)
    tol = 1e-12
    return low - tol <= figure["ci_low"] <= figure["ci_high"] <= high + tol and low - tol <= figure["value"] <= high + tol


def test_paired_overhead_is_the_ratio_of_sums_with_a_reproducible_interval_around_it():
    base = [1.0, 1.2, 0.9, 1.1, 1.0, 1.3]
    treated = [b * f for b, f in zip(base, [1.01, 1.03, 0.99, 1.02, 1.00, 1.01])]
    got = paired_overhead(treated, base)
    assert got["value"] == pytest.approx(sum(treated) / sum(base) - 1)
    assert got["ci_low"] <= got["value"] <= got["ci_high"] and got["ci_high"] < 0.03 and got["ci_low"] > -0.01
    assert paired_overhead(treated, base) == got  # seeded: the same data, the same interval
    assert paired_overhead([1.0], [1.0])["ci_high"] is None
    with pytest.raises(ValueError, match="paired_overhead"):
        paired_overhead([1.0, 2.0], [1.0])


def test_a_burst_spanning_rows_widens_the_block_bootstrap_interval_and_the_no_op_arm_is_the_control():
    # 64 rows; the machine slows the treated arm for 8 consecutive rows (a burst), else +1 %.
    base = [1.0] * 64
    treated = [1.10 if 20 <= i < 28 else 1.01 for i in range(64)]
    pairs = paired_overhead(treated, base, block=1)
    blocks = paired_overhead(treated, base)  # default block length ceil(64 ** (1/3)) = 4
    assert blocks["block"] == 4 and pairs["block"] == 1 and blocks["value"] == pairs["value"]
    assert blocks["ci_high"] - blocks["ci_low"] > pairs["ci_high"] - pairs["ci_low"]
    # The harness alone costs +2 % (the no-op arm); the call itself +0.5 % more.
    rows = [{"none": 1.0, "noop": 1.02 + 0.001 * (i % 3), "x": (1.02 + 0.001 * (i % 3)) * 1.005} for i in range(30)]
    got = controlled_overhead(rows, "x")
    assert got["control"] == "noop" and got["value"] == pytest.approx(0.005)
    assert got["raw"]["value"] == pytest.approx(sum(r["x"] for r in rows) / 30 - 1)
    assert got["aa"]["value"] == pytest.approx(sum(r["noop"] for r in rows) / 30 - 1)
    # every row's own overhead is +0.5 %: the interval collapses onto it
    assert got["ci_low"] == pytest.approx(0.005) and got["ci_high"] == pytest.approx(0.005) and got["aa"]["ci_low"] > 0.015
    # results written before the control arm existed: the bare step stays the control
    old = controlled_overhead([{"none": 1.0, "x": 1.01}, {"none": 1.0, "x": 1.03}], "x")
    assert old["control"] == "none" and old["aa"] is None and old["value"] == pytest.approx(0.02)


def test_a_direct_cost_is_its_mean_over_the_median_step_with_the_wide_interval():
    # 40 chunks of boundaries costing 10 us, a burst of 4 chunks at 50 us; steps of 5 ms (median)
    costs = [50e-6 if 10 <= i < 14 else 10e-6 for i in range(40)]
    steps = [5e-3] * 199 + [9e-3]
    mean = mean_interval(costs)
    assert mean["mean"] == pytest.approx(14e-6) and mean["block"] == 4 and mean["ci_low"] < 14e-6 < mean["ci_high"]
    assert mean_interval(costs) == mean  # seeded
    got = cost_fraction(costs, steps, extra=1e-4)
    assert got["value"] == pytest.approx(14e-6 / 5e-3 + 1e-4)
    assert got["ci_low"] == pytest.approx(mean["ci_low"] / 5e-3 + 1e-4) and got["ci_high"] == pytest.approx(mean["ci_high"] / 5e-3 + 1e-4)
    assert cost_fraction([1e-6], [5e-3])["ci_high"] is None  # one chunk: no interval
    # the timing's own cost (a no-op timed alike: 4 us) is subtracted, its interval carried into the figure's
    based = cost_fraction(costs, steps, baseline=[4e-6] * 39 + [8e-6])
    base = mean_interval([4e-6] * 39 + [8e-6])
    assert based["value"] == pytest.approx((14e-6 - 4.1e-6) / 5e-3)
    assert based["step_s"]["ci_low"] == based["step_s"]["ci_high"] == 5e-3  # the middle steps are all 5 ms
    assert based["ci_low"] == pytest.approx((mean["ci_low"] - base["ci_high"]) / 5e-3)
    assert based["ci_high"] == pytest.approx((mean["ci_high"] - base["ci_low"]) / 5e-3)


def test_log_tail_counts_only_rows_past_the_resume_point_after_the_log_is_rewritten(tmp_path):
    log = tmp_path / "training.jsonl"
    log.write_text("".join(json.dumps({"global_step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)))
    tail = LogTail(log, floor=3)  # the next start resumes from step 3
    tail.poll()
    assert tail.rows == []  # rows already there are the previous start's
    rewritten = tmp_path / "training.tmp"  # the resume truncates the log to its resume point (new inode)
    rewritten.write_text("".join(json.dumps({"global_step": s}) + "\n" for s in (1, 2, 3)))
    rewritten.replace(log)
    with open(log, "a") as fh:
        fh.write(json.dumps({"global_step": 4}) + "\n" + '{"global_st')  # a row half written
    tail.poll()
    assert [step for step, _ in tail.rows] == [4]
    with open(log, "a") as fh:
        fh.write('ep": 5}\n')
    tail.poll()
    assert [step for step, _ in tail.rows] == [4, 5]


def _start(launched: float, steps: list[int], step_s: float, first_at: float, signalled: float | None, exited: float, resume: int) -> dict:
    return {
        "launched": launched,
        "signalled": signalled,
        "exited": exited,
        "code": 75 if signalled is not None else 0,
        "resume_step": resume,
        "rows": [(s, first_at + i * step_s) for i, s in enumerate(steps)],
        "stop_checkpoint_step": steps[-1],
    }


def test_goodput_counts_steps_logged_past_the_resume_point_as_redone_and_their_time_as_lost():
    # start 1: steps 1-10 from t=2 (0.1 s each), signal at 2.95 (step 10 runs on), exit at 3.5;
    # start 2 resumed from step 8 (its first row is step 9): steps 9 and 10 are trained twice.
    first = _start(0.0, list(range(1, 11)), 0.1, 2.0, 2.95, 3.5, 0)
    second = _start(3.5, list(range(9, 21)), 0.1, 6.0, None, 7.5, 8)
    got = summarise([first, second], period_s=3.0)
    (p,) = got["preemptions"]
    assert p["steps_redone"] == 2 and p["resumed_from_step"] == 8 and p["last_logged_step"] == 10
    assert p["signal_to_exit_s"] == pytest.approx(0.55) and p["restart_to_first_step_s"] == pytest.approx(2.5)
    # lost: from the signal (2.95) to the next start's first new step (11, at 6.2), less that step:
    # the way back to the first row (3.05 s) plus redoing step 10 (0.1 s)
    assert p["preemption_cost_s"] == pytest.approx(3.25 - 0.1)
    assert got["steps"] == 20 and got["useful_s"] == pytest.approx(2.0) and got["goodput_fraction"] == pytest.approx(2.0 / 7.5)


def test_goodput_step_time_holds_when_rows_are_seen_in_bursts_of_one_poll():
    # 1/30 s steps seen by a 0.1 s poll: three rows per poll, so two gaps in three are 0 (their
    # median too); the span of the start over its steps is the step time
    steps = list(range(3, 25))
    start = _start(0.0, steps, 1 / 30, 1.0, None, 2.5, 2)
    start["rows"] = [(s, 1.0 + 0.1 * (s // 3)) for s in steps]
    got = summarise([start], period_s=3.0)
    assert got["step_s"] == pytest.approx(1 / 30) and got["useful_s"] == pytest.approx(len(steps) / 30)


@pytest.mark.multiproc
@pytest.mark.timeout(480)
def test_quick_bench_prints_the_table_and_writes_every_figure_with_raw_times(tmp_path):
    out = tmp_path / "latest.json"
    work = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--size", "4M", "--repeat", "1", "--dir", str(work), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=470,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"

    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert table[0].startswith("| figure | ours | anchor (same run) | ratio [95 % interval, coverage] | target |")
    labels = ("sync save", "load for resume", "load vs safetensors", "load vs DCP", "async save", "stop agreement, ours k=auto (default), 3 interleaved rows")
    labels += (
        "stop agreement, ours k=1",
        "stop latency, k=1",
        "signal to exit",
        "peak extra RSS",
        "goodput, digits preempted every 3 s",
        "cost per preemption",
        "sync save, FSDP2 2 ranks (safetensors)",
        "sharded save vs DCP save",
        "watchdog: progress reports, 3 interleaved rows",
        "stop agreement, ours k=auto (default), timed directly: 200 calls x 1 per step",
        "watchdog: progress reports, timed directly: 200 calls x 1 per step",
        "  calibration: k=1 (a round every step), timed directly",
        "restart -> first step, ours (digits, 2 ranks",
        "watchdog detection, a rank hung in a step",
        "watchdog detection, a rank SIGKILLed",
        "watchdog detection, a rank SIGSTOPped",
    )
    for label in labels:
        assert any(row.startswith(f"| {label}") for row in table), f"no table row for {label!r}:\n" + "\n".join(table)

    doc = json.loads(out.read_text())
    assert set(KEYS) | set(CI_KEYS) <= set(doc)
    assert not any(key.startswith(LOADED_PREFIX) for key in doc)  # no --load: one pass
    for key in KEYS:
        entry = doc[key]
        assert {"value", "target", "pass", "rounds", "ci_low", "ci_high"} <= set(entry), (key, entry)
        if key.startswith("async_") and entry["value"] is None:
            assert entry["status"].startswith("not available yet"), (key, entry)
            assert entry["memcpy_s"] > 0 and entry["dcp_async_blocked_s"] > 0 and entry["state_bytes"] > 0
        else:
            # a finite number; never its size (an overhead within the noise may come out negative)
            assert isinstance(entry["value"], float) and math.isfinite(entry["value"]), (key, entry)
            assert "error" not in entry, (key, entry)
    # raw times (s) and sizes (bytes) beside the ratios
    assert doc["save_vs_disk"]["ours_s"] > 0 and doc["save_vs_disk"]["disk_s"] > 0
    assert doc["save_vs_disk"]["state_bytes"] == doc["meta"]["state_bytes"] > 3 * (4 << 20) * 0.9
    assert doc["load_vs_disk"]["bytes_read"]["disk"] == doc["meta"]["state_bytes"]
    assert doc["save_vs_torch_save"]["target"] == ">= 1.1x torch.save"  # the retired 1.5x is gone
    assert len(doc["save_vs_disk"]["rounds"]) == 1 and doc["save_vs_disk"]["rounds"][0] == doc["save_vs_disk"]["value"]
    agreement = doc["agreement_overhead_fraction"]
    assert agreement["ab"]["n"] == 3 and len(agreement["rounds"]) == 3  # one overhead per row of blocks
    assert agreement["ab"]["control"] == "noop" and set(agreement["ab"]["step_s"]) == {"none", "noop", "ours_auto"}
    assert math.isfinite(agreement["ab"]["aa"]["value"]) and math.isfinite(agreement["ab"]["raw"]["value"])
    assert _within_rows(agreement)
    assert (doc[CI_KEYS[0]], doc[CI_KEYS[1]]) == (agreement["ci_low"], agreement["ci_high"])
    assert agreement["pass"] == (agreement["ci_high"] <= 0.01 and agreement["stop_latency_s"]["auto"] <= 1.0)
    assert doc["agreement_overhead_fraction"]["step_s"]["none"] > 0
    assert doc["agreement_overhead_fraction"]["stop_latency_steps"]["k1"] >= 1
    # the boundary calls timed directly: 200 per rank and measurement, over the median step of the same run
    for key in ("agreement_direct_overhead_fraction", "watchdog_direct_overhead_fraction"):
        direct = doc[key]
        assert direct["calls"] == 200 and direct["calls_per_step"] == 1 and len(direct["ranks"]) == 2, (key, direct)
        assert direct["call_s"] > 0 and direct["step_s"]["median"] > 0 and direct["ci_low"] <= direct["value"] <= direct["ci_high"], (key, direct)
        assert (doc[f"{key}_ci_low"], doc[f"{key}_ci_high"]) == (direct["ci_low"], direct["ci_high"])
        assert direct["pass"] == (direct["ci_high"] <= 0.01)
    agreement_direct = doc["agreement_direct_overhead_fraction"]
    assert all(r["threads"] >= 1 for r in agreement_direct["ranks"])  # gloo's threads were found
    assert agreement_direct["thread_cpu_s"] > 0 and agreement_direct["k1_calibration"]["direct"] is not None  # the rounds' CPU is charged
    assert doc["watchdog_direct_overhead_fraction"]["launcher_cpu_per_s"] > 0  # the launcher's reads are charged
    # restart -> first step, phase by phase; ours against 0.5 s + the load's own time of the same trial
    restart = doc["restart_ours_s"]
    assert restart["ours_phases"] == ["import_resilience", "config", "build_loop", "resume"] and len(restart["rounds"]) == 1
    phases = doc["details"]["restart"]["trials"][0]["phases_s"]  # per rank
    assert restart["value"] == pytest.approx(max(sum(p[k] for k in restart["ours_phases"]) for p in phases))
    assert all(restart["phases_s"][k] > 0 for k in ("interpreter", "torch", "import_resilience", "build_loop", "resume", "first_step"))
    assert 0.5 < restart["budget_s"] == doc["restart_budget_s"] < 1.5 and restart["load_own_s"] > 0
    assert restart["restart_to_first_step_s"] > restart["value"]
    assert "torch.distributed.checkpoint" not in restart["heavy_modules"]["resilience"]  # DCP is not imported with the library
    watchdog = doc["watchdog_overhead_fraction"]
    assert watchdog["ab"]["n"] == 3 and _within_rows(watchdog)
    assert watchdog["ab"]["stalls_seen"] == 0  # the launcher-side reads ran beside the pairs and saw no stall
    detection = doc["watchdog_detection_vs_limit"]
    assert detection["progress_timeout_s"] == 1.5 and set(detection["detect_s"]) == {"hang", "kill", "stop"}
    for kind in ("hang", "stop"):  # a stall is seen only once the rank has been silent for the timeout
        assert detection["silence_s"][kind] >= 1.5 and detection["recover_s"][kind] >= detection["detect_s"][kind] > 0
    assert doc["signal_to_exit_vs_budget"]["all_exited_preempted"] is True
    assert doc["save_peak_extra_rss_fraction"]["state_bytes"] == doc["meta"]["state_bytes"]
    # goodput: one preemption every 3 s through the launcher, resumed, finished; nothing trained twice
    case = doc["details"]["goodput"]["cases"][0]
    assert case["exit_codes"][-1] == 0 and 75 in case["exit_codes"] and case["all_steps_logged_once"] is True
    assert 0 < doc["goodput_fraction"]["value"] < 1
    assert doc["preemption_cost_s"]["steps_redone"] == [0] * len(doc["preemption_cost_s"]["rounds"]) and doc["preemption_cost_s"]["rounds"]
    assert doc["preemption_cost_s"]["budget_s"] > 2.0 and doc["preemption_cost_s"]["restart_to_first_step_s"] > 0
    # the sharded save: 2 ranks in the default format, each holding about half of a state of the same size, all three methods timed
    sharded = doc["sharded_save_vs_disk"]
    assert sharded["world_size"] == 2 and len(sharded["state_bytes_per_rank"]) == 2 and sharded["model_save_format"] == "safetensors"
    assert abs(sharded["state_bytes_per_rank"][0] - sharded["state_bytes_per_rank"][1]) < 0.1 * sharded["state_bytes"]
    assert sharded["state_bytes"] > 3 * (4 << 20) * 0.9
    assert sharded["ours_s"] > 0 and sharded["disk_s"] > 0 and doc["sharded_save_vs_dcp"]["dcp_s"] > 0
    assert sharded["bytes_written"]["ours"] >= sharded["state_bytes"]
    assert len(sharded["rounds"]) == 1 and sharded["ci_confidence"] is None  # one round: no interval yet
    # the scratch files are gone
    assert not any(work.iterdir()) if work.exists() else True


@pytest.mark.timeout(300)
def test_load_only_pass_beside_a_busy_process_adds_loaded_keys_and_keeps_the_quiet_ones(tmp_path):
    out = tmp_path / "latest.json"
    out.write_text(json.dumps({"save_vs_disk": {"value": 0.93}, "meta": {"quick": True}, "details": {}, "loaded.stale": 1}))
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--load-only", "--only", "rss", "--dir", str(tmp_path / "work"), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=290,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    assert "beside one CPU-busy process" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["save_vs_disk"] == {"value": 0.93} and doc["meta"]["quick"] is True  # the quiet pass is kept
    assert "loaded.stale" not in doc  # the previous loaded pass is replaced
    assert {LOADED_PREFIX + key for key in (*KEYS, *CI_KEYS)} <= set(doc)
    rss = doc[LOADED_PREFIX + "save_peak_extra_rss_fraction"]
    assert isinstance(rss["value"], float) and len(rss["rounds"]) == 1
    assert doc[LOADED_PREFIX + "save_vs_disk"]["error"] == "skipped"
    neighbour = doc["meta"]["loaded"]["neighbour"]
    assert neighbour["cpu_s"] > 0 and neighbour["wall_s"] > 0  # the busy process really ran


def test_the_sharded_save_and_loads_run_an_odd_number_of_rounds_above_the_rest_except_in_a_quick_run():
    from bench.sharded_save import sharded_rounds

    assert sharded_rounds(1) == 1  # --quick: one round of everything
    assert [sharded_rounds(r) for r in (2, 5)] == [5, 11]  # odd: the median is one round's ratio


def test_read_once_reads_every_file_once_across_the_ranks(tmp_path):
    from bench.common import read_once

    sizes = {"a.bin": 3, "b.bin": 70 << 20, "sub/c.bin": 5, "sub/d.bin": 0}  # one file larger than the 64 MiB buffer
    for name, size in sizes.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * size)
    shares = [read_once([tmp_path], rank, 3) for rank in range(3)]
    assert sum(shares) == sum(sizes.values())
    assert read_once([tmp_path / "sub", tmp_path / "a.bin"]) == 8  # a file given by name counts too
    assert sorted(shares) != [0, 0, sum(sizes.values())]  # split, not all on one rank


def test_fast_balance_gives_the_same_owners_as_the_library_balance():
    import random

    from bench.scale.resume import fast_balance
    from resilience.checkpoint.balance import balance

    rng = random.Random(7)
    for ranks in (1, 2, 7, 64):
        sizes = {f"f{i}": rng.choice([0, 1, 5, 5, 1 << 20, rng.randrange(1 << 30)]) for i in range(300)}
        assert fast_balance(sizes, ranks) == balance(sizes, ranks)


@pytest.mark.timeout(400)
def test_quick_scale_bench_writes_every_figure_per_mode_and_rank_count_with_consistent_bytes(tmp_path):
    from bench.scale.__main__ import QUICK_RANKS
    from bench.scale.figures import KEYS
    from bench.scale.llama import state_bytes

    small, large = (str(n) for n in QUICK_RANKS)

    out = tmp_path / "scale.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.scale", "--quick", "--dir", str(tmp_path / "work"), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=390,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    assert any(line.startswith(f"| fsdp2 | {large} |") for line in proc.stdout.splitlines()), proc.stdout
    doc = json.loads(out.read_text())
    assert set(doc) == {"ddp", "fsdp2"} and all(set(cells) == {small, large} for cells in doc.values())
    total = sum(state_bytes().values())  # 27 GB of weights + 54 GB of moments
    for mode, cells in doc.items():
        for n, fig in cells.items():
            where, n = f"{mode} N={n}", int(n)
            assert set(KEYS) <= set(fig) and fig["lower_bound"] == [] and "incomplete" not in fig, (where, fig)
            for key in KEYS:
                assert isinstance(fig[key], (int, float)) and fig[key] > 0, (where, key, fig[key])
            # every rank writes about 1/N of the state; the resume reads at least the rank's share
            assert total / n * 0.5 < fig["own_file_bytes"] < total / n * 1.6, (where, fig["own_file_bytes"])
            if mode == "fsdp2":
                assert fig["replicated_bytes"] <= fig["resume_read_bytes_per_rank"]
            else:  # loaded balanced: 1/N of the replicated bytes from storage, the rest broadcast
                assert fig["resume_read_bytes_per_rank"] <= 1.1 * fig["replicated_bytes"] / n + fig["own_file_bytes"], (where, fig)
            assert fig["index_bytes_per_rank"] < fig["resume_read_bytes_per_rank"]  # at the quick run's N the data outweighs the indexes
            assert fig["rank0_meta_ops"] == fig["rank0_critical_meta_ops"] + fig["rank0_background_meta_ops"]
            assert fig["rank0_choose_meta_ops"] <= fig["files"] / n + 30  # rank 0 stats its 1/N of the files, not all
            assert fig["files"] >= n  # a rank state file (RNG, data position) of every rank at least
    for mode, cells in doc.items():  # rank 0's deletion is spread over the ranks: it does not grow with N
        assert cells[large]["rank0_critical_meta_ops"] == cells[small]["rank0_critical_meta_ops"], mode
        assert cells[large]["rank0_meta_ops"] < cells[large]["files"], mode
    # DDP: every rank loads every model and optimizer byte, 1/N of them from storage; FSDP2: about its share
    n = int(large)
    assert doc["ddp"][large]["replicated_bytes"] > 0.95 * total
    assert doc["ddp"][large]["resume_read_bytes_per_rank"] < 1.1 * total / n
    assert doc["fsdp2"][large]["resume_read_bytes_per_rank"] < 4 * total / n


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_quick_agreement_bench_measures_a_gloo_hop_and_models_both_schemes_at_scale(tmp_path):
    from resilience.stop.node_groups import ring_hops

    out = tmp_path / "agreement.json"
    proc = subprocess.run([sys.executable, "-m", "bench.agreement", "--quick", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=390)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    doc = json.loads(out.read_text())
    assert set(doc["measured"]) == {"2", "4"} and doc["hop_s"]["median"] > 0 and doc["hop_s"]["n"] == 3
    assert doc["measured"]["4"]["node_groups"]["round_s"]["median"] > 0  # the library's own round, on 2 "nodes"
    hop = doc["hop_s"]
    for n in ("1024", "8192"):
        flat, grouped = doc["model"][n]["flat"], doc["model"][n]["node_groups"]
        assert (flat["hops"], grouped["hops"]) == (ring_hops(int(n)), ring_hops(int(n), 8))
        assert flat["round_s"]["median"] == pytest.approx(hop["median"] * flat["hops"])
        assert flat["round_s"]["ci_low"] <= flat["round_s"]["median"] <= flat["round_s"]["ci_high"]
        assert grouped["round_s"]["median"] < flat["round_s"]["median"] / 7  # 8 per node: ~8x fewer hops
    assert any(line.startswith("| 8192 | node_groups |") for line in proc.stdout.splitlines()), proc.stdout


def test_versus_pairs_head_and_base_by_round_and_calls_a_whole_interval_above_one_slower():
    from bench.versus import summarize

    def row(save_s: float, base_save_s: float) -> dict:
        anchors = {"disk_write_s": 2.0, "disk_read_s": 2.0, "memcpy_s": 0.5, "load_s": 1.0, "async_blocked_s": 0.5}
        return {"head": {**anchors, "save_s": save_s}, "base": {**anchors, "save_s": base_save_s}}

    slower = summarize([row(1.5 + i / 100, 1.0) for i in range(8)])
    assert slower["save_s"]["verdict"] == "slower" and slower["save_s"]["head_over_base"]["ci_low"] > 1
    assert slower["save_s"]["head_vs_anchor"]["median"] < slower["save_s"]["base_vs_anchor"]["median"] == 2.0
    assert slower["load_s"]["verdict"] == "level"  # every ratio exactly 1: the interval holds 1
    faster = summarize([row(0.5, 1.0 + i / 100) for i in range(8)])["save_s"]
    assert faster["verdict"] == "faster" and faster["head_over_base"]["ci_high"] < 1
    noisy = summarize([row(0.8 if i % 2 else 1.25, 1.0) for i in range(8)])["save_s"]
    assert noisy["verdict"] == "level"
    few = summarize([row(1.5, 1.0) for _ in range(5)])["save_s"]  # 5 rounds: a 94 % interval
    assert few["verdict"] == "undecided" and few["head_over_base"]["ci_low"] > 1


def test_quick_versus_runs_each_version_in_its_own_process_and_names_a_bad_base(tmp_path):
    out = tmp_path / "versus.json"
    quick = ["--size", "4M", "--rounds", "2", "--async-rounds", "1"]
    cmd = [sys.executable, "-m", "bench.versus", "HEAD", *quick, "--dir", str(tmp_path / "work"), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    doc = json.loads(out.read_text())
    assert len(doc["rounds"]) == 2 and doc["size"] == 4 * 2**20
    assert {s["verdict"] for s in doc["summary"].values()} == {"undecided"}  # 2 rounds decide nothing
    for row in doc["rounds"]:
        assert Path(row["head"]["resilience"]) == REPO / "resilience"
        base_package = Path(row["base"]["resilience"])
        assert base_package.parts[-2:] == ("base", "resilience") and not base_package.exists()  # extracted, then removed
        assert all(Path(m).is_relative_to(base_package) for m in row["base"]["modules"]) and len(row["base"]["modules"]) > 5
        assert row["base"]["staging_faulted"] and row["head"]["staging_faulted"]
        for version in row.values():
            assert version["state_bytes"] > 3 * 4 * 2**20 * 0.9  # weights + Adam's two moments
            assert all(version[k] > 0 for k in ("save_s", "load_s", "async_blocked_s", "disk_write_s", "disk_read_s", "memcpy_s"))
    assert set(doc["summary"]) == {"save_s", "load_s", "async_blocked_s"}
    assert proc.stdout.count("versus round") == 2 and "| save_s |" in proc.stdout
    assert not list((tmp_path / "work").iterdir())  # the scratch directory is left empty
    bad = subprocess.run([sys.executable, "-m", "bench.versus", "no-such-rev"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "base: git rev-parse 'no-such-rev' failed" in bad.stderr
    tree = subprocess.run([sys.executable, "-m", "bench.versus", "HEAD:resilience"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert tree.returncode == 2 and "git rev-parse 'HEAD:resilience' failed" in tree.stderr  # a tree is no commit
