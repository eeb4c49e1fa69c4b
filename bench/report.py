"""Turn the measurements into the issue's figures and targets (the JSON; the table is bench/table.py).

Ratios are paired: each round's figure is divided by its anchor *of the same round*, and the
median of those per-round ratios is reported with its 95 % interval (:mod:`bench.stats`; the
``rounds`` beside it). Save and load ratios are speed ratios (anchor time / our time: higher is
better); the async, agreement, exit and memory ratios are cost ratios (lower is better). The
agreement overhead and the watchdog's (progress reports on vs off) are the figures from
interleaved rows of blocks against a no-op call in the same harness (value = ratio of sums over
the rows; :func:`bench.stats.controlled_overhead`).
"""

from __future__ import annotations

from typing import Any

from bench.common import median
from bench.stats import median_interval

KEYS = (
    "save_vs_disk",
    "save_vs_torch_save",
    "save_vs_dcp",
    "load_vs_disk",
    "load_vs_safetensors",
    "load_vs_dcp",
    "async_block_vs_memcpy",
    "async_block_vs_dcp_async",
    "agreement_overhead_fraction",
    "agreement_direct_overhead_fraction",
    "watchdog_overhead_fraction",
    "watchdog_direct_overhead_fraction",
    "watchdog_detection_vs_limit",
    "signal_to_exit_vs_budget",
    "save_peak_extra_rss_fraction",
    "goodput_fraction",
    "preemption_cost_s",
    "restart_ours_s",
    "sharded_save_vs_disk",
    "sharded_save_vs_dcp",
    "sharded_load_vs_disk",
    "sharded_load_vs_dcp",
    "sharded_reshard_load_vs_disk",
    "sharded_reshard_load_vs_dcp",
)
# Intervals as top-level numbers too (the issues' "with _ci_high"), and the restart's budget beside its figure.
CI_KEYS = (
    "agreement_overhead_fraction_ci_low",
    "agreement_overhead_fraction_ci_high",
    "agreement_direct_overhead_fraction_ci_low",
    "agreement_direct_overhead_fraction_ci_high",
    "watchdog_direct_overhead_fraction_ci_low",
    "watchdog_direct_overhead_fraction_ci_high",
    "restart_budget_s",
)
LOADED_PREFIX = "loaded."

# key -> (comparison, bound, text); None: a comparison with a peer or an info figure.
TARGETS: dict[str, tuple[str, float, str] | None] = {
    "save_vs_disk": (">=", 0.9, ">= 0.9 of the disk rate"),
    "save_vs_torch_save": (">=", 1.1, ">= 1.1x torch.save"),
    "save_vs_dcp": (">=", 1.2, ">= 1.2x DCP save"),
    "load_vs_disk": (">=", 0.8, ">= 0.8 of the disk rate"),
    "load_vs_safetensors": (">", 1.0, "ahead of safetensors load"),
    "load_vs_dcp": (">", 1.0, "ahead of DCP load"),
    "async_block_vs_memcpy": ("<=", 1.2, "<= 1.2x one memcpy"),
    "async_block_vs_dcp_async": None,
    "agreement_overhead_fraction": ("<=", 0.01, "95 % CI upper end <= 1 % of a step"),
    "agreement_direct_overhead_fraction": ("<=", 0.01, "95 % CI upper end <= 1 % of the median step"),
    "watchdog_overhead_fraction": ("<=", 0.01, "95 % CI upper end <= 1 % of a step (within noise)"),
    "watchdog_direct_overhead_fraction": ("<=", 0.01, "95 % CI upper end <= 1 % of the median step"),
    "watchdog_detection_vs_limit": ("<=", 1.0, "hang, stop: <= timeout + 1 s; kill: <= 1 s"),
    "signal_to_exit_vs_budget": ("<=", 1.0, "<= step + save + 1 s"),
    "save_peak_extra_rss_fraction": ("<=", 0.10, "<= 10 % of the state"),
    "goodput_fraction": None,
    "preemption_cost_s": ("<=", 1.0, "<= one save + one load + 2 s"),  # compared as cost / budget
    "restart_ours_s": ("<=", 1.0, "<= 0.5 s + the load's own time"),  # compared as ours / budget
    "sharded_save_vs_disk": (">=", 0.9, ">= 0.9 of the disk rate"),
    "sharded_save_vs_dcp": (">=", 1.2, ">= 1.2x DCP save"),
    "sharded_load_vs_disk": (">=", 0.8, ">= 0.8 of the disk rate"),
    "sharded_load_vs_dcp": None,
    "sharded_reshard_load_vs_disk": (">=", 0.8, ">= 0.8 of the disk rate"),
    "sharded_reshard_load_vs_dcp": None,
}
SECTION_OF = {
    "save_vs_disk": "save",
    "save_vs_torch_save": "save",
    "save_vs_dcp": "save",
    "load_vs_disk": "load",
    "load_vs_safetensors": "load",
    "load_vs_dcp": "load",
    "async_block_vs_memcpy": "async",
    "async_block_vs_dcp_async": "async",
    "agreement_overhead_fraction": "agreement",
    "watchdog_overhead_fraction": "agreement",
    "agreement_direct_overhead_fraction": "agreement",
    "watchdog_direct_overhead_fraction": "agreement",
    "restart_ours_s": "restart",
    "watchdog_detection_vs_limit": "watchdog",
    "signal_to_exit_vs_budget": "exit",
    "save_peak_extra_rss_fraction": "rss",
    "goodput_fraction": "goodput",
    "preemption_cost_s": "goodput",
    "sharded_save_vs_disk": "sharded",
    "sharded_save_vs_dcp": "sharded",
    "sharded_load_vs_disk": "sharded",
    "sharded_load_vs_dcp": "sharded",
    "sharded_reshard_load_vs_disk": "sharded",
    "sharded_reshard_load_vs_dcp": "sharded",
}
STOP_LATENCY_TARGET_S = 1.0


def meets(key: str, value: float | None) -> bool | None:
    """Whether ``value`` meets ``key``'s target (None: no target, or no value)."""
    target = TARGETS[key]
    if target is None or value is None:
        return None
    op, bound, _ = target
    return {">=": value >= bound, ">": value > bound, "<=": value <= bound}[op]


def _ratios(num: list[float], den: list[float]) -> list[float]:
    """``num[r] / den[r]`` per round."""
    return [n / d for n, d in zip(num, den) if d]


def _entry(key: str, rounds: list[float], **raw: Any) -> dict[str, Any]:
    """One figure: the median of ``rounds`` with its interval, target, verdict and raw data.

    ``pass`` judges the median; ``pass_whole_interval`` whether the whole interval meets the
    target (None without an interval)."""
    iv = median_interval(rounds)
    target = TARGETS[key]
    entry = {
        "value": iv["median"],
        "ci_low": iv["ci_low"],
        "ci_high": iv["ci_high"],
        "ci_confidence": iv["confidence"],
        "rounds": iv["rounds"],
        "target": target[2] if target else None,
        "pass": meets(key, iv["median"]),
        "pass_whole_interval": None,
        **raw,
    }
    if iv["ci_low"] is not None and target is not None:
        entry["pass_whole_interval"] = bool(meets(key, iv["ci_low"]) and meets(key, iv["ci_high"]))
    return entry


def _save(out: dict[str, Any], save: dict[str, Any]) -> None:
    t, state = save["times"], save["state_bytes"]
    cpu = {name: median(v) for name, v in save.get("cpu_s", {}).items()}  # CPU-s of each method: what a busy neighbour takes from
    common = {"ours_s": median(t["ours"]), "state_bytes": state, "bytes_written": save["bytes_written"], "ours_s_all": t["ours"], "cpu_s": cpu}
    for key, peer in (("save_vs_disk", "disk"), ("save_vs_torch_save", "torch_save"), ("save_vs_dcp", "dcp")):
        out[key] = _entry(key, _ratios(t[peer], t["ours"]), **common, **{f"{peer}_s": median(t[peer]), f"{peer}_s_all": t[peer]})


def _load(out: dict[str, Any], load: dict[str, Any]) -> None:
    t = load["times"]
    common = {
        "ours_s": median(t["ours"]),
        "ours_validate_s": median(t["ours_validate"]),
        "state_bytes": load["state_bytes"],
        "bytes_read": load["bytes_read"],
        "cpu_s": {name: median(v) for name, v in load.get("cpu_s", {}).items()},
    }
    resume = median_interval(_ratios(t["disk"], [a + b for a, b in zip(t["ours"], t["ours_validate"])]))
    out["load_vs_disk"] = _entry(
        "load_vs_disk",
        _ratios(t["disk"], t["ours"]),
        **common,
        disk_s=median(t["disk"]),
        safetensors_s=median(t["safetensors"]),
        dcp_s=median(t["dcp"]),
        resume_vs_disk=resume["median"],
        resume_vs_disk_interval=resume,
        times_all=t,
    )
    out["load_vs_safetensors"] = _entry("load_vs_safetensors", _ratios(t["safetensors"], t["ours"]), **common, safetensors_s=median(t["safetensors"]))
    out["load_vs_dcp"] = _entry("load_vs_dcp", _ratios(t["dcp"], t["ours"]), **common, dcp_s=median(t["dcp"]))


def _async(out: dict[str, Any], asy: dict[str, Any]) -> None:
    b, tot = asy["blocked_s"], asy["total_s"]
    raw = {
        "memcpy_s": median(b["memcpy"]),
        "dcp_async_blocked_s": median(b["dcp_async"]),
        "dcp_async_total_s": median(tot["dcp_async"]),
        "dcp_async_staged_blocked_s": median(b.get("dcp_async_staged", [])),
        "dcp_async_staged_total_s": median(tot.get("dcp_async_staged", [])),
        "state_bytes": asy["state_bytes"],
        "peer_errors": asy.get("peer_errors", {}),
    }
    if not asy["available"]:
        for key in ("async_block_vs_memcpy", "async_block_vs_dcp_async"):
            out[key] = _entry(key, [], status=f"not available yet: {asy['why_not']}", **raw)
        return
    raw.update(ours_blocked_s=median(b["ours"]), ours_total_s=median(tot["ours"]))
    # DCP ran in other rounds than ours: compare each with its own memcpy anchor, round by round
    anchors = asy["memcpy_anchor_s"]
    ours = _ratios(b["ours"], anchors["ours"])
    dcp = _ratios(b["dcp_async"], anchors["dcp_async"]) if "dcp_async" in anchors else []
    out["async_block_vs_memcpy"] = _entry("async_block_vs_memcpy", ours, **raw)
    out["async_block_vs_dcp_async"] = _entry("async_block_vs_dcp_async", [o / d for o, d in zip(ours, dcp) if d], **raw)


def _agreement(out: dict[str, Any], ddp: dict[str, Any]) -> None:
    v, lat, ab = ddp["variants"], ddp["stop_latency"], ddp.get("ab") or {}
    default = "auto" if "ours_auto" in v else "k1"
    entry = _entry(
        "agreement_overhead_fraction",
        ab.get("pair_fractions", []),
        step_s={name: row["step_s"] for name, row in v.items()},
        overhead_fraction={name: row["overhead_fraction"] for name, row in v.items()},
        overhead_interval={name: row.get("overhead_interval") for name, row in v.items()},
        boundary_call_s={name: row.get("boundary_call_s") for name, row in v.items()},
        stop_latency_s={k: row["seconds"] for k, row in lat.items()},
        stop_latency_max_s={k: row["seconds_max"] for k, row in lat.items()},
        stop_latency_steps={k: row["steps"] for k, row in lat.items()},
        big_k=ddp["raw"]["big_k"],
        steps_per_block=ddp["raw"]["steps_per_block"],
        rounds_of_variants=ddp["raw"]["rounds"],
        ab=ab,
    )
    # The figure is the estimate against the no-op control (ratio of sums over the rows) with its block-bootstrap interval;
    # the target is judged on the interval's upper end.
    entry.update(value=ab.get("value"), ci_low=ab.get("ci_low"), ci_high=ab.get("ci_high"), ci_confidence=ab.get("confidence"))
    latency_ok = lat.get(default, {}).get("seconds", float("inf")) <= STOP_LATENCY_TARGET_S
    upper = entry["ci_high"] if entry["ci_high"] is not None else entry["value"]
    entry["pass"] = None if upper is None else bool(meets("agreement_overhead_fraction", upper) and latency_ok)
    entry["pass_whole_interval"] = entry["pass"] if entry["ci_high"] is not None else None
    entry["target"] += f", stop latency <= {STOP_LATENCY_TARGET_S:g} s"
    out["agreement_overhead_fraction"] = entry


def _watchdog_overhead(out: dict[str, Any], ddp: dict[str, Any]) -> None:
    """The progress reports' overhead against the no-op control (ratio of sums over the rows, block-bootstrap interval),
    judged on the interval's upper end like the agreement's."""
    ab = ddp.get("watchdog_ab") or {}
    entry = _entry("watchdog_overhead_fraction", ab.get("pair_fractions", []), ab=ab, stalls_seen=ab.get("stalls_seen"))
    entry.update(value=ab.get("value"), ci_low=ab.get("ci_low"), ci_high=ab.get("ci_high"), ci_confidence=ab.get("confidence"))
    upper = entry["ci_high"] if entry["ci_high"] is not None else entry["value"]
    entry["pass"] = meets("watchdog_overhead_fraction", upper)
    entry["pass_whole_interval"] = entry["pass"] if entry["ci_high"] is not None else None
    out["watchdog_overhead_fraction"] = entry


def _direct(out: dict[str, Any], ddp: dict[str, Any]) -> None:
    """The boundary calls timed directly (bench/direct_cost.py): cost per boundary x 1 call per step
    over the median step, judged on the interval's upper end; the A/B figures and the k=1
    calibration beside them."""
    d = ddp["direct"]
    for key, name, ab in (("agreement_direct_overhead_fraction", "agreement", "ab"), ("watchdog_direct_overhead_fraction", "progress", "watchdog_ab")):
        fig = d[name]
        entry = _entry(
            key,
            [r["value"] for r in fig["ranks"]],
            calls=fig["calls"],
            calls_per_step=fig["calls_per_step"],
            call_s=fig["call_s"],
            call_cpu_s=fig["call_cpu_s"],
            call_blocked_s=fig["call_blocked_s"],
            call_runq_s=fig["call_runq_s"],
            wall_figure=fig["wall_figure"],
            thread_cpu_s=fig["thread_cpu_s"],
            idle_thread_cpu_s=fig["idle_thread_cpu_s"],
            cost_s=fig["cost_s"],
            baseline_s=fig["baseline_s"],
            step_s=fig["step_s"],
            rank=fig["rank"],
            ranks=fig["ranks"],
            every_steps_at_end=fig.get("every_steps_at_end"),
            agreement_interval_s=fig.get("interval_s"),
            ab_value=(ddp.get(ab) or {}).get("value"),
        )
        entry.update(value=fig["value"], ci_low=fig["ci_low"], ci_high=fig["ci_high"], ci_confidence=fig["confidence"])
        upper = entry["ci_high"] if entry["ci_high"] is not None else entry["value"]
        entry["pass"] = meets(key, upper)
        entry["pass_whole_interval"] = entry["pass"] if entry["ci_high"] is not None else None
        if name == "agreement":
            k1 = d["agreement_k1"]
            entry["k1_calibration"] = {
                "direct": k1["value"],
                "direct_ci": [k1["ci_low"], k1["ci_high"]],
                "call_s": k1["call_s"],
                "call_cpu_s": k1["call_cpu_s"],
                "call_blocked_s": k1["call_blocked_s"],
                "thread_cpu_s": k1["thread_cpu_s"],
                "rounds_ab": (ddp["variants"].get("ours_k1") or {}).get("overhead_fraction"),
            }
        else:
            entry["launcher_cpu_per_s"] = fig["launcher_cpu_per_s"]
        out[key] = entry


def _restart(out: dict[str, Any], rs: dict[str, Any]) -> None:
    """Ours of restart -> first step (import resilience, config, build the loop, resume), the slower
    rank per trial, against 0.5 s + the load's own time measured in the same trial."""
    rows = rs["trials"]
    entry = _entry(
        "restart_ours_s",
        rs["ours_s"],
        budget_s=median(rs["budget_s"]),
        load_own_s=rs["load_own_s"],
        allowance_s=rs["allowance_s"],
        vs_budget=median([o / b for o, b in zip(rs["ours_s"], rs["budget_s"])]),
        phases_s={name: iv["median"] for name, iv in rs["by_phase_s"].items()},
        phase_intervals=rs["by_phase_s"],
        ours_phases=list(rs["ours_phases"]),
        restart_to_first_step_s=rs["total_s"],
        heavy_modules=rows[0]["heavy_modules"][0] if rows else None,
    )
    entry["pass"] = meets("restart_ours_s", entry["vs_budget"])
    if entry["ci_high"] is not None:
        entry["pass_whole_interval"] = bool(entry["ci_high"] <= entry["budget_s"])
    out["restart_ours_s"] = entry


def _watchdog_detection(out: dict[str, Any], wd: dict[str, Any]) -> None:
    """Per trial the worst of the three kinds' detection latency / its limit (<= 1 meets it)."""
    limits, trials = wd["limits_s"], wd["trials"]
    kinds = list(limits)
    rounds = [max(trial[kind]["detect_s"] / limits[kind] for kind in kinds) for trial in trials]
    per_kind = {kind: median_interval([trial[kind]["detect_s"] for trial in trials]) for kind in kinds}
    out["watchdog_detection_vs_limit"] = _entry(
        "watchdog_detection_vs_limit",
        rounds,
        progress_timeout_s=wd["timeout_s"],
        ranks=wd.get("nproc"),
        limits_s=limits,
        detect_s={kind: iv["median"] for kind, iv in per_kind.items()},
        detect_interval={kind: iv for kind, iv in per_kind.items()},
        recover_s={kind: median([trial[kind]["recover_s"] for trial in trials]) for kind in kinds},
        silence_s={kind: median([trial[kind]["silence_s"] for trial in trials]) for kind in kinds},
        pass_by_kind={kind: per_kind[kind]["median"] <= limits[kind] for kind in kinds},
    )


def _exit(out: dict[str, Any], ext: dict[str, Any], ddp: dict[str, Any]) -> None:
    step_s, save_s = ddp["variants"]["none"]["step_s"], ddp["save_s"]
    budget = step_s + save_s + 1.0
    trials = ext["trials"]
    n = min(len(rows) for rows in trials.values())
    rounds = [max(rows[t]["seconds"] for rows in trials.values()) / budget for t in range(n)]  # the slower mode per trial
    published = [s for s in ext["median_published_s"].values() if s is not None]
    entry = _entry(
        "signal_to_exit_vs_budget",
        rounds,
        exit_s=ext["median_s"],
        published_s=ext["median_published_s"],
        budget_s=budget,
        step_s=step_s,
        save_s=save_s,
        published_vs_budget=max(published) / budget if published else None,
        python_teardown_s={k: v["median_s"] for k, v in ext["teardown_s"].items()},
        all_exited_preempted=ext["all_preempted"],
    )
    if not ext["all_preempted"]:
        entry["pass"] = False
    out["signal_to_exit_vs_budget"] = entry


def _rss(out: dict[str, Any], rss: dict[str, Any]) -> None:
    state = rss["state_bytes"]
    med = rss["median_extra_bytes"]
    out["save_peak_extra_rss_fraction"] = _entry(
        "save_peak_extra_rss_fraction",
        [b / state for b in rss["extra_bytes"]["ours"]],
        extra_bytes=med,
        state_bytes=state,
        fraction={k: b / state for k, b in med.items()},
        method=rss["method"],
    )


def _goodput(out: dict[str, Any], gp: dict[str, Any]) -> None:
    cases = gp["cases"]
    worst = min(cases, key=lambda c: c["period_s"])  # the most frequent preemption is the figure
    out["goodput_fraction"] = _entry(
        "goodput_fraction",
        [c["goodput_fraction"] for c in cases if c["period_s"] == worst["period_s"]],
        period_s=worst["period_s"],
        by_period={f"{c['period_s']:g}": c["goodput_fraction"] for c in cases},
        useful_s={f"{c['period_s']:g}": c["useful_s"] for c in cases},
        wall_s={f"{c['period_s']:g}": c["wall_s"] for c in cases},
        preemptions={f"{c['period_s']:g}": len(c["preemptions"]) for c in cases},
    )
    costs = [p["preemption_cost_s"] for c in cases for p in c["preemptions"]]
    budget = gp["budget_s"]
    entry = _entry(
        "preemption_cost_s",
        costs,
        budget_s=budget,
        save_s=gp["save_s"],
        load_s=gp["load_s"],
        process_start_allowance_s=gp["process_start_allowance_s"],
        vs_budget=median([c / budget for c in costs]),
        signal_to_exit_s=median([p["signal_to_exit_s"] for c in cases for p in c["preemptions"]]),
        restart_to_first_step_s=median([p["restart_to_first_step_s"] for c in cases for p in c["preemptions"]]),
        steps_redone=[p["steps_redone"] for c in cases for p in c["preemptions"]],
    )
    # judged as cost / budget (the budget is measured in the same run)
    entry["pass"] = meets("preemption_cost_s", entry["vs_budget"])
    if entry["ci_high"] is not None:
        entry["pass_whole_interval"] = bool(entry["ci_high"] <= budget)
    if any(p["steps_redone"] for c in cases for p in c["preemptions"]):
        entry["pass"] = False
    out["preemption_cost_s"] = entry


def _medians(times: dict[str, list[float]]) -> dict[str, float]:
    """The median seconds of ours, the disk anchor and DCP (``ours_s``, ``disk_s``, ``dcp_s``)."""
    return {f"{name}_s": median(times[name]) for name in ("ours", "disk", "dcp")}


def _sharded(out: dict[str, Any], sharded: dict[str, Any]) -> None:
    t = sharded["times"]
    raw = {
        **_medians(t),
        "world_size": sharded["world_size"],
        "model_save_format": sharded["model_save_format"],
        "state_bytes": sharded["state_bytes"],
        "state_bytes_per_rank": sharded["state_bytes_per_rank"],
        "bytes_written": sharded["bytes_written"],
        "times_all": t,
    }
    for key, peer in (("sharded_save_vs_disk", "disk"), ("sharded_save_vs_dcp", "dcp")):
        out[key] = _entry(key, _ratios(t[peer], t["ours"]), **raw)
    # the loads of that checkpoint: on the saver's ranks, then resharded (each checked bitwise by the worker)
    for prefix, load in (("sharded_load", sharded.get("load")), ("sharded_reshard_load", (sharded.get("reshard") or {}).get("load"))):
        if not load:
            continue
        lt = load["times"]
        raw = {
            **_medians(lt),
            "saved_world_size": sharded["world_size"],
            "world_size": load["world_size"],
            "state_bytes": sharded["state_bytes"],
            "bytes_read": load["bytes_read"],
            "bitwise_checks": load["bitwise_checks"],
            "times_all": lt,
        }
        for suffix, peer in (("vs_disk", "disk"), ("vs_dcp", "dcp")):
            out[f"{prefix}_{suffix}"] = _entry(f"{prefix}_{suffix}", _ratios(lt[peer], lt["ours"]), **raw)


def figures(results: dict[str, Any]) -> dict[str, Any]:
    """Every key of :data:`KEYS` (and :data:`CI_KEYS`) from the sections' raw results (missing
    sections: ``value`` None with an ``error``: the section's error, or ``skipped``)."""
    out: dict[str, Any] = {}
    have = {name: isinstance(results.get(name), dict) and "error" not in results[name] for name in set(SECTION_OF.values())}
    if have["save"]:
        _save(out, results["save"])
    if have["load"]:
        _load(out, results["load"])
    if have["async"]:
        _async(out, results["async"])
    if have["agreement"]:
        _agreement(out, results["agreement"])
        if results["agreement"].get("watchdog_ab", {}).get("n"):
            _watchdog_overhead(out, results["agreement"])
        if results["agreement"].get("direct"):
            _direct(out, results["agreement"])
    if have["watchdog"]:
        _watchdog_detection(out, results["watchdog"])
        if have["exit"]:
            _exit(out, results["exit"], results["agreement"])
    if have["rss"]:
        _rss(out, results["rss"])
    if have["goodput"] and results["goodput"].get("cases"):
        _goodput(out, results["goodput"])
    if have["sharded"]:
        _sharded(out, results["sharded"])
    if have["restart"] and results["restart"].get("trials"):
        _restart(out, results["restart"])
    for key in KEYS:
        if key not in out:
            got = results.get(SECTION_OF[key])
            reason = got.get("error") if isinstance(got, dict) and "error" in got else "skipped"
            if key == "signal_to_exit_vs_budget" and got is not None and not have["agreement"]:
                reason = "needs the agreement section (its step and save times are the budget)"
            out[key] = _entry(key, [], error=reason)
    for key in ("agreement_overhead_fraction", "agreement_direct_overhead_fraction", "watchdog_direct_overhead_fraction"):
        out[f"{key}_ci_low"], out[f"{key}_ci_high"] = out[key]["ci_low"], out[key]["ci_high"]
    out["restart_budget_s"] = out["restart_ours_s"].get("budget_s")
    return out


def prefixed(fig: dict[str, Any], prefix: str = LOADED_PREFIX) -> dict[str, Any]:
    """The same figures under ``prefix`` (``loaded.save_vs_disk``, ...)."""
    return {prefix + key: value for key, value in fig.items()}
