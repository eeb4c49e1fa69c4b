"""The markdown table of the bench's figures (one row per figure, with its anchor and interval).

Each ratio is printed as the median over rounds with its interval in brackets and the interval's
coverage (``[0.90, 0.97] 94 %``: between two rounds' values, see :mod:`bench.stats`).
"""

from __future__ import annotations

from typing import Any

from bench.common import human_bytes
from bench.direct_cost import AUTO_INTERVAL_S
from bench.report import STOP_LATENCY_TARGET_S


def _s(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x * 1e3:.2f} ms" if x < 0.1 else f"{x:.3f} s"


def _rate(nbytes: int, seconds: float | None) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds else "n/a"


def _verdict(passed: bool | None, value: Any = 0) -> str:
    if value is None:
        return "n/a"
    return "—" if passed is None else ("PASS" if passed else "MISS")


def _x(v: float | None, fmt: str = "{:.2f}x") -> str:
    return "n/a" if v is None else fmt.format(v)


def _ci(entry: dict[str, Any], fmt: str = "{:.2f}") -> str:
    """`` [low, high] 94 %`` after a median, or nothing without an interval."""
    low, high, conf = entry.get("ci_low"), entry.get("ci_high"), entry.get("ci_confidence")
    if low is None or high is None:
        return ""
    return f" [{fmt.format(low)}, {fmt.format(high)}] {conf:.0%}" if conf is not None else f" [{fmt.format(low)}, {fmt.format(high)}]"


Row = tuple[str, str, str, str, str, str]


def _missing(label: str, f: dict[str, Any]) -> Row:
    return (label, "n/a", "", "", f.get("target") or "", f.get("error", f.get("status", "n/a")))


def _cpu(f: dict[str, Any], method: str) -> str:
    """``, CPU 1.23 s`` (this process's CPU time for ``method``, all threads) or nothing."""
    seconds = (f.get("cpu_s") or {}).get(method)
    return f", CPU {_s(seconds)}" if seconds is not None else ""


def _storage_rows(fig: dict[str, Any], state: int) -> list[Row]:
    rows: list[Row] = []
    f = fig["save_vs_disk"]
    if f.get("value") is None:
        return [_missing("sync save", f)]
    rows.append(
        (
            f"sync save, {human_bytes(state)} state",
            f"{_s(f['ours_s'])} ({_rate(state, f['ours_s'])}{_cpu(f, 'ours')})",
            f"disk write+fsync {_s(f['disk_s'])} ({_rate(state, f['disk_s'])}{_cpu(f, 'disk')})",
            _x(f["value"], "{:.2f} of disk") + _ci(f),
            f["target"],
            _verdict(f["pass"]),
        )
    )
    for key, label, peer, name in (
        ("save_vs_torch_save", "sync save vs torch.save", "torch_save_s", "torch.save"),
        ("save_vs_dcp", "sync save vs DCP save", "dcp_s", "DCP save"),
    ):
        g = fig[key]
        rows.append(
            (
                label,
                _s(g["ours_s"]),
                f"{name} {_s(g[peer])} ({_rate(state, g[peer])})",
                _x(g["value"], "{:.2f}x as fast") + _ci(g),
                g["target"],
                _verdict(g["pass"]),
            )
        )
    return rows


def _load_rows(fig: dict[str, Any], state: int) -> list[Row]:
    f = fig["load_vs_disk"]
    if f.get("value") is None:
        return [_missing("load for resume", f)]
    rows: list[Row] = [
        (
            "load for resume (cold)",
            f"{_s(f['ours_s'])} ({_rate(state, f['ours_s'])}{_cpu(f, 'ours')})",
            f"disk cold read {_s(f['disk_s'])} ({_rate(state, f['disk_s'])}{_cpu(f, 'disk')})",
            _x(f["value"], "{:.2f} of disk") + _ci(f),
            f["target"],
            _verdict(f["pass"]),
        )
    ]
    for key, label, peer, name in (
        ("load_vs_safetensors", "load vs safetensors load", "safetensors_s", "safetensors"),
        ("load_vs_dcp", "load vs DCP load", "dcp_s", "DCP load"),
    ):
        g = fig[key]
        cpu = _cpu(g, peer.removesuffix("_s"))
        anchor = f"{name} {_s(g[peer])}" + (f" ({cpu.removeprefix(', ')})" if cpu else "")
        rows.append((label, _s(g["ours_s"]), anchor, _x(g["value"], "{:.2f}x as fast") + _ci(g), g["target"], _verdict(g["pass"])))
    rows.append(
        (
            "resume = choose (manifests, sizes) + load (digests checked while reading)",
            _s(f["ours_validate_s"] + f["ours_s"]),
            f"disk cold read {_s(f['disk_s'])}",
            _x(f["resume_vs_disk"], "{:.2f} of disk") + _ci(f["resume_vs_disk_interval"] | {"ci_confidence": f["resume_vs_disk_interval"]["confidence"]}),
            "info",
            "—",
        )
    )
    return rows


def _async_rows(fig: dict[str, Any]) -> list[Row]:
    f, g = fig["async_block_vs_memcpy"], fig["async_block_vs_dcp_async"]
    if "memcpy_s" not in f:
        return [_missing("async save", f)]
    staged = f"DCP async_save {_s(f['dcp_async_blocked_s'])} (DefaultStager {_s(f['dcp_async_staged_blocked_s'])})"
    if f.get("value") is None:
        return [
            ("async save: loop blocked", f.get("status", "n/a").split(":")[0], f"memcpy {_s(f['memcpy_s'])}", "n/a", f["target"], "n/a"),
            ("async blocked vs DCP async_save", "n/a", staged, "n/a", "peer", "—"),
        ]
    return [
        ("async save: loop blocked", _s(f["ours_blocked_s"]), f"memcpy {_s(f['memcpy_s'])}", _x(f["value"]) + _ci(f), f["target"], _verdict(f["pass"])),
        ("async blocked vs DCP async_save", _s(f["ours_blocked_s"]), staged, _x(g["value"]) + _ci(g), "peer", "—"),
    ]


def _ab_row(label: str, f: dict[str, Any], treated: str, base: str) -> Row:
    """The row of an overhead from interleaved blocks (``f["ab"]``): ``treated`` vs its control
    (a no-op call in the same harness, where the run had one; else the bare step, ``base``), with
    the raw figure vs the bare step and the no-op's own reading (A/A) beside it."""
    ab = f["ab"]
    control = ab.get("control", "none")
    against = f"a no-op call {_s(ab['step_s'][control])}" if control != "none" else f"{base} {_s(ab['step_s']['none'])}"
    extra = ""
    if ab.get("aa"):
        raw, aa = ab["raw"], ab["aa"]
        extra = f"; vs {base}: {raw['value']:+.2%}, A/A (no-op vs {base}): {aa['value']:+.2%}" + _ci(aa | {"ci_confidence": aa.get("confidence")}, "{:+.2%}")
    return (
        f"{label}, {ab['n']} interleaved rows of {ab['steps_per_block']} steps (blocks of {ab.get('block', 1)} rows resampled)",
        f"{_s(ab['step_s'][treated])} ({_s(ab['boundary_call_s'])} inside the call)",
        against,
        _x(f["value"], "{:+.2%}") + _ci(f, "{:+.2%}") + extra,
        f["target"],
        _verdict(f["pass"]),
    )


def _us(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e6:.1f} us"


def _direct_row(label: str, f: dict[str, Any], what: str) -> Row:
    """The row of a boundary call timed directly (bench/direct_cost.py): cost per boundary and its
    parts over the median step of the same run, with the A/B figure beside it."""
    if f.get("value") is None:
        return _missing(label, f)
    cost, step = f["cost_s"], f["step_s"]
    parts = f"call: CPU {_us(f['call_cpu_s'])}, asleep or reading the clocks {_us(f['call_blocked_s'])}, waiting for a CPU {_us(f['call_runq_s'])} (uncharged)"
    parts += f" + {what} CPU {_us(f['thread_cpu_s'])}" if f.get("thread_cpu_s") else ""
    parts += f"; less the timing's own {_us((f.get('baseline_s') or {}).get('mean'))} (a no-op timed alike)"
    if f.get("launcher_cpu_per_s") is not None:
        parts += f"; launcher reads {f['launcher_cpu_per_s']:.3%} of a core"
    ab = f" (A/B: {f['ab_value']:+.2%})" if f.get("ab_value") is not None else ""
    interval = f"; rounds {f['agreement_interval_s']:g} s apart" if f.get("agreement_interval_s") else ""
    return (
        f"{label}, timed directly: {f['calls']} calls x {f['calls_per_step']} per step (rank {f['rank']}{interval})",
        f"{(cost['mean'] - (f.get('baseline_s') or {}).get('mean', 0.0)) * 1e6:.1f} us per step ({parts})",
        f"median step {_s(step['median'])}",
        _x(f["value"], "{:+.3%}") + _ci(f, "{:+.3%}") + f"; with the calls' wall time {f['wall_figure']['value']:+.3%}" + ab,
        f["target"],
        _verdict(f["pass"]),
    )


def _agreement_rows(fig: dict[str, Any]) -> list[Row]:
    f = fig["agreement_overhead_fraction"]
    if not f.get("step_s"):
        return [_missing("stop agreement", f)]
    step, over, k = f["step_s"], f["overhead_fraction"], f["big_k"]
    lat, steps, ab = f["stop_latency_s"], f["stop_latency_steps"], f.get("ab") or {}
    rows: list[Row] = []
    if ab.get("n"):
        rows.append(_ab_row("stop agreement, ours k=auto (default)", f, "ours_auto", "no agreement"))
    d = fig.get("agreement_direct_overhead_fraction") or {}
    rows.append(_direct_row("stop agreement, ours k=auto (default)", d, "gloo threads'"))
    if d.get("k1_calibration"):
        k1 = d["k1_calibration"]
        ab_k1 = f" vs the rounds' A/B {k1['rounds_ab']:+.1%}" if k1.get("rounds_ab") is not None else ""
        rows.append(
            (
                "  calibration: k=1 (a round every step), timed directly",
                f"call: CPU {_us(k1['call_cpu_s'])}, other {_us(k1['call_blocked_s'])} + gloo threads' CPU {_us(k1['thread_cpu_s'])} per step",
                "",
                _x(k1["direct"], "{:+.2%}") + ab_k1,
                "info",
                "—",
            )
        )
    for name, label in (
        ("ours_k1", "stop agreement, ours k=1"),
        (f"ours_k{k}", f"stop agreement, ours k={k}"),
        ("ours_auto", f"stop agreement, ours k=auto (default, {AUTO_INTERVAL_S:g} s)"),
        ("blocking", "blocking all-reduce every step"),
    ):
        if name not in over:
            continue
        ok = None if name == "blocking" else over[name] <= 0.01
        inside = f["boundary_call_s"].get(name)
        where = f" ({_s(inside)} inside the call)" if inside is not None else ""
        iv = (f.get("overhead_interval") or {}).get(name) or {}
        rows.append(
            (
                f"{label} (2 ranks, DDP step; rounds)",
                _s(step[name]) + where,
                f"no agreement {_s(step['none'])}",
                f"{over[name]:+.1%}" + _ci(iv | {"ci_confidence": iv.get("confidence")}, "{:+.1%}"),
                "<= 1 %" if ok is not None else "peer",
                _verdict(ok),
            )
        )
    for key, label in (("k1", "stop latency, k=1"), (f"k{k}", f"stop latency, k={k}"), ("auto", "stop latency, k=auto")):
        if key in lat:
            ok = lat[key] <= STOP_LATENCY_TARGET_S
            rows.append((label, f"{_s(lat[key])}, {steps[key]:g} steps", "os.kill of one rank", "", f"<= {STOP_LATENCY_TARGET_S:g} s", _verdict(ok)))
    return rows


def _watchdog_rows(fig: dict[str, Any]) -> list[Row]:
    f, d = fig["watchdog_overhead_fraction"], fig["watchdog_detection_vs_limit"]
    rows: list[Row] = []
    if (f.get("ab") or {}).get("n"):
        rows.append(_ab_row("watchdog: progress reports", f, "progress", "no reports"))
    else:
        rows.append(_missing("watchdog: progress reports", f))
    rows.append(_direct_row("watchdog: progress reports", fig.get("watchdog_direct_overhead_fraction") or {}, "launcher"))
    if d.get("value") is None:
        return [*rows, _missing("watchdog detection", d)]
    for kind, what in (("hang", "a rank hung in a step"), ("kill", "a rank SIGKILLed"), ("stop", "a rank SIGSTOPped")):
        limit = d["limits_s"][kind]
        iv = d["detect_interval"][kind]
        rows.append(
            (
                f"watchdog detection, {what} ({d['ranks']} ranks)",
                f"{_s(d['detect_s'][kind])} after the fault; ranks ended after {_s(d['recover_s'][kind])}",
                f"--progress-timeout {d['progress_timeout_s']:g} s",
                _x(d["detect_s"][kind] / limit, "{:.2f} of limit") + _ci(iv | {"ci_confidence": iv.get("confidence")}, "{:.2f} s"),
                f"<= {limit:g} s",
                _verdict(d["pass_by_kind"][kind]),
            )
        )
    return rows


def _exit_rows(fig: dict[str, Any]) -> list[Row]:
    f = fig["signal_to_exit_vs_budget"]
    if f.get("value") is None:
        return [_missing("signal to exit", f)]
    ex, pub, td = f["exit_s"], f["published_s"], f["python_teardown_s"]

    def modes(d: dict[str, Any]) -> str:
        return ", ".join(f"{'all signalled' if m == 'all' else 'one signalled'} {_s(v)}" for m, v in d.items())

    budget = f"step {_s(f['step_s'])} + save {_s(f['save_s'])} + 1 s = {_s(f['budget_s'])}"
    ok = f["published_vs_budget"] <= 1 if f["published_vs_budget"] is not None else None
    return [
        ("signal to exit, 2 ranks (digits)", modes(ex), budget, _x(f["value"], "{:.2f} of budget") + _ci(f), f["target"], _verdict(f["pass"])),
        (
            "signal to stop checkpoint published",
            modes(pub),
            budget,
            _x(f["published_vs_budget"], "{:.2f} of budget"),
            "info",
            _verdict(ok, f["published_vs_budget"]),
        ),
        (
            "python exit with torch imported (limit)",
            f"{_s(td.get('plain'))}",
            f"with gc.freeze() {_s(td.get('gc_freeze'))}; os._exit {_s(td.get('os_exit'))}",
            "",
            "info",
            "—",
        ),
    ]


def _rss_rows(fig: dict[str, Any]) -> list[Row]:
    f = fig["save_peak_extra_rss_fraction"]
    if f.get("value") is None:
        return [_missing("peak extra RSS", f)]
    e, fr = f["extra_bytes"], f["fraction"]
    state = f"state {human_bytes(f['state_bytes'])}; torch.save +{fr['torch_save']:.0%}, DCP +{fr['dcp']:.0%}"
    return [("peak extra RSS, sync save", human_bytes(e["ours"]), state, f"{f['value']:.1%}" + _ci(f, "{:.1%}"), f["target"], _verdict(f["pass"]))]


def _goodput_rows(fig: dict[str, Any]) -> list[Row]:
    f, c = fig["goodput_fraction"], fig["preemption_cost_s"]
    if f.get("value") is None:
        return [_missing("goodput under repeated preemption", f)]
    rows: list[Row] = []
    for period, value in f["by_period"].items():
        useful, wall, n = f["useful_s"][period], f["wall_s"][period], f["preemptions"][period]
        rows.append((f"goodput, digits preempted every {period} s ({n} preemptions)", f"useful {_s(useful)}", f"wall {_s(wall)}", f"{value:.1%}", "info", "—"))
    budget = f"save {_s(c['save_s'])} + load {_s(c['load_s'])} + {c['process_start_allowance_s']:g} s = {_s(c['budget_s'])}"
    redone = sum(c["steps_redone"])
    rows.append(
        (
            "cost per preemption (training time lost)",
            _s(c["value"]) + _ci(c, "{:.2f}"),
            budget,
            _x(c["vs_budget"], "{:.2f} of budget"),
            c["target"],
            _verdict(c["pass"]),
        )
    )
    rows.append(
        (
            "  signal -> exit, restart -> first step (start, imports, rendezvous, choose, load)",
            f"{_s(c['signal_to_exit_s'])}, {_s(c['restart_to_first_step_s'])}",
            "",
            "",
            "info",
            "—",
        )
    )
    rows.append(("  steps redone after a preemption", f"{redone} in {len(c['steps_redone'])} preemptions", "", "", "0", "PASS" if redone == 0 else "MISS"))
    return rows


def _restart_rows(fig: dict[str, Any]) -> list[Row]:
    f = fig["restart_ours_s"]
    if f.get("value") is None:
        return [_missing("restart -> first step, ours", f)]
    p = f["phases_s"]
    ours = " + ".join(f"{name} {_s(p[name])}" for name in f["ours_phases"])
    theirs = ", ".join(f"{name} {_s(p[name])}" for name in p if name not in f["ours_phases"])
    return [
        (
            "restart -> first step, ours (digits, 2 ranks; slower rank per trial)",
            _s(f["value"]) + _ci(f, "{:.3f}") + f" = {ours}",
            f"0.5 s + load's own {_s(f['load_own_s'])} = {_s(f['budget_s'])}",
            _x(f["vs_budget"], "{:.2f} of budget"),
            f["target"],
            _verdict(f["pass"]),
        ),
        (f"  the rest (interpreter, torch, the example's own); first step after {_s(f['restart_to_first_step_s'])}", theirs, "", "", "info", "—"),
    ]


def _sharded_rows(fig: dict[str, Any]) -> list[Row]:
    f, g = fig["sharded_save_vs_disk"], fig["sharded_save_vs_dcp"]
    if f.get("value") is None:
        return [_missing("sync save, FSDP2 sharded", f)]
    state, n = f["state_bytes"], f["world_size"]
    return [
        *_disk_and_dcp_rows(
            (
                f,
                f"sync save, FSDP2 {n} ranks ({f['model_save_format']}), {human_bytes(state)} state, each rank its 1/{n}; {len(f['rounds'])} rounds",
                "disk write+fsync, every rank its shards",
            ),
            (g, f"sharded save vs DCP save ({n} ranks)", "DCP save", g["target"], _verdict(g["pass"])),
        ),
        *_sharded_load_rows(fig, "sharded_load"),
        *_sharded_load_rows(fig, "sharded_reshard_load"),
    ]


def _sharded_load_rows(fig: dict[str, Any], prefix: str) -> list[Row]:
    f, g = fig[f"{prefix}_vs_disk"], fig[f"{prefix}_vs_dcp"]
    if f.get("value") is None:
        return [_missing(f"load, FSDP2 sharded ({prefix})", f)]
    saved, n = f["saved_world_size"], f["world_size"]
    return _disk_and_dcp_rows(
        (
            f,
            f"load, FSDP2 {saved} -> {n} rank(s), cold, bitwise equal ({f['bitwise_checks']} checks)",
            f"cold read, {'every rank its own file' if saved == n else 'every saver file'}",
        ),
        (g, f"sharded load vs DCP load ({saved} -> {n})", "DCP load + set_state_dict", "peer", "—"),
    )


def _disk_and_dcp_rows(disk: tuple[dict[str, Any], str, str], dcp: tuple[dict[str, Any], str, str, str, str]) -> list[Row]:
    """A sharded figure's two rows: ours against the disk's rate, then against DCP's
    (``disk``: figure, label, anchor; ``dcp``: figure, label, anchor, target, verdict)."""
    (f, label, anchor), (g, dcp_label, dcp_anchor, target, verdict) = disk, dcp
    state = f["state_bytes"]
    return [
        (
            label,
            f"{_s(f['ours_s'])} ({_rate(state, f['ours_s'])} aggregate)",
            f"{anchor} {_s(f['disk_s'])} ({_rate(state, f['disk_s'])})",
            _x(f["value"], "{:.2f} of disk") + _ci(f),
            f["target"],
            _verdict(f["pass"]),
        ),
        (
            dcp_label,
            _s(g["ours_s"]),
            f"{dcp_anchor} {_s(g['dcp_s'])} ({_rate(state, g['dcp_s'])})",
            _x(g["value"], "{:.2f}x as fast") + _ci(g),
            target,
            verdict,
        ),
    ]


def table(fig: dict[str, Any], meta: dict[str, Any]) -> str:
    """The markdown table of the issue's figures (one row per figure, with its anchor)."""
    state = meta.get("state_bytes") or 0
    rows = [
        *_storage_rows(fig, state),
        *_load_rows(fig, state),
        *_async_rows(fig),
        *_agreement_rows(fig),
        *_watchdog_rows(fig),
        *_exit_rows(fig),
        *_rss_rows(fig),
        *_goodput_rows(fig),
        *_restart_rows(fig),
        *_sharded_rows(fig),
    ]
    header = ("figure", "ours", "anchor (same run)", "ratio [95 % interval, coverage]", "target", "")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def breakdown_table(bd: dict[str, Any]) -> str:
    """Where ours spends a save and a load (phases nest; the content check runs on a thread beside the load)."""
    lines = ["| phase of ours | seconds | share |", "|---|---|---|"]
    for phase in [key for key, value in bd.items() if isinstance(value, dict) and "total_s" in value]:
        part = bd.get(phase)
        if not part:
            continue
        total = part["total_s"]
        lines.append(f"| **{phase}, cold, total** | {total:.3f} | 100 % |" if phase != "save" else f"| **{phase}, total** | {total:.3f} | 100 % |")
        for name, seconds in part["phases_s"].items():
            lines.append(f"| {name} | {seconds:.3f} | {seconds / total:.0%} |")
    prof = bd.get("async_blocked_profile")
    if prof:
        total = prof["blocked_s_under_profiler"]
        lines.append(f"| **async save, blocked part (cProfile, cumulative)** | {total:.3f} | 100 % |")
        for row in prof["top"][:8]:
            lines.append(f"| `{row['function']}` x{row['calls']} | {row['cumulative_s']:.3f} | {row['cumulative_s'] / total:.0%} |")
    return "\n".join(lines)
