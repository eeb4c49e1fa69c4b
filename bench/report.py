"""Turn the measurements into the issue's figures, targets, a markdown table and the JSON.

Ratios are paired: each round's figure is divided by its anchor *of the same round*, and the
median of those per-round ratios is reported (disk speed drifts ~25 % between runs here).
Save and load ratios are speed ratios (anchor time / our time: higher is better); the async,
agreement, exit and memory ratios are cost ratios (lower is better).
"""

from __future__ import annotations

from typing import Any

from bench.common import human_bytes, median

KEYS = (
    "save_vs_disk",
    "save_vs_torch_save",
    "save_vs_dcp",
    "load_vs_disk",
    "async_block_vs_memcpy",
    "async_block_vs_dcp_async",
    "agreement_overhead_fraction",
    "signal_to_exit_vs_budget",
    "save_peak_extra_rss_fraction",
    "sharded_save_vs_disk",
    "sharded_save_vs_dcp",
)

# key -> (comparison, bound, text); None: a comparison with a peer, no target in the issue.
TARGETS: dict[str, tuple[str, float, str] | None] = {
    "save_vs_disk": (">=", 0.9, ">= 0.9 of the disk rate"),
    "save_vs_torch_save": (">=", 1.5, ">= 1.5x torch.save"),
    "save_vs_dcp": None,
    "load_vs_disk": (">=", 0.8, ">= 0.8 of the disk rate"),
    "async_block_vs_memcpy": ("<=", 1.2, "<= 1.2x one memcpy"),
    "async_block_vs_dcp_async": None,
    "agreement_overhead_fraction": ("<=", 0.01, "<= 1 % of a step"),
    "signal_to_exit_vs_budget": ("<=", 1.0, "<= step + save + 1 s"),
    "save_peak_extra_rss_fraction": ("<=", 0.10, "<= 10 % of the state"),
    "sharded_save_vs_disk": (">=", 0.9, ">= 0.9 of the disk rate"),
    "sharded_save_vs_dcp": None,
}
STOP_LATENCY_TARGET_S = 1.0


def _meets(key: str, value: float | None) -> bool | None:
    target = TARGETS[key]
    if target is None or value is None:
        return None
    op, bound, _ = target
    return value >= bound if op == ">=" else value <= bound


def _paired(num: list[float], den: list[float]) -> float | None:
    """Median over rounds of ``num[r] / den[r]``."""
    return median([n / d for n, d in zip(num, den) if d])


def _entry(key: str, value: float | None, **raw: Any) -> dict[str, Any]:
    target = TARGETS[key]
    return {"value": value, "target": target[2] if target else None, "pass": _meets(key, value), **raw}


def figures(results: dict[str, Any]) -> dict[str, Any]:
    """The keys of the issues from the sections' raw results (missing sections: ``value``
    None with an ``error`` or ``status``); ``bench.report_sharded.figures`` replaces the sharded ones."""
    out: dict[str, Any] = {}
    save = results.get("save")
    if isinstance(save, dict) and "times" in save:
        t, state = save["times"], save["state_bytes"]
        common = {"ours_s": median(t["ours"]), "state_bytes": state, "bytes_written": save["bytes_written"]}
        out["save_vs_disk"] = _entry(
            "save_vs_disk", _paired(t["disk"], t["ours"]), **common, disk_s=median(t["disk"]), ours_s_all=t["ours"], disk_s_all=t["disk"]
        )
        out["save_vs_torch_save"] = _entry(
            "save_vs_torch_save", _paired(t["torch_save"], t["ours"]), **common, torch_save_s=median(t["torch_save"]), torch_save_s_all=t["torch_save"]
        )
        out["save_vs_dcp"] = _entry("save_vs_dcp", _paired(t["dcp"], t["ours"]), **common, dcp_s=median(t["dcp"]), dcp_s_all=t["dcp"])
    load = results.get("load")
    if isinstance(load, dict) and "times" in load:
        t = load["times"]
        out["load_vs_disk"] = _entry(
            "load_vs_disk",
            _paired(t["disk"], t["ours"]),
            ours_s=median(t["ours"]),
            disk_s=median(t["disk"]),
            safetensors_s=median(t["safetensors"]),
            dcp_s=median(t["dcp"]),
            ours_validate_s=median(t["ours_validate"]),
            load_vs_safetensors=_paired(t["safetensors"], t["ours"]),
            load_vs_dcp=_paired(t["dcp"], t["ours"]),
            resume_vs_disk=_paired(t["disk"], [a + b for a, b in zip(t["ours"], t["ours_validate"])]),
            state_bytes=load["state_bytes"],
            bytes_read=load["bytes_read"],
            times_all=t,
        )
    asy = results.get("async")
    if isinstance(asy, dict) and "blocked_s" in asy:
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
        if asy["available"]:
            raw.update(ours_blocked_s=median(b["ours"]), ours_total_s=median(tot["ours"]))
            # DCP ran in other rounds than ours: compare each with its own memcpy anchor
            anchors = asy["memcpy_anchor_s"]
            vs_memcpy = _paired(b["ours"], anchors["ours"])
            dcp_vs_memcpy = _paired(b["dcp_async"], anchors["dcp_async"]) if "dcp_async" in anchors else None
            out["async_block_vs_memcpy"] = _entry("async_block_vs_memcpy", vs_memcpy, **raw)
            out["async_block_vs_dcp_async"] = _entry("async_block_vs_dcp_async", vs_memcpy / dcp_vs_memcpy if vs_memcpy and dcp_vs_memcpy else None, **raw)
        else:
            for key in ("async_block_vs_memcpy", "async_block_vs_dcp_async"):
                out[key] = _entry(key, None, status=f"not available yet: {asy['why_not']}", **raw)
    ddp = results.get("agreement")
    if isinstance(ddp, dict) and "variants" in ddp:
        v, lat = ddp["variants"], ddp["stop_latency"]
        # The figure is the default cadence (auto); k=1 and k=big_k are rows beside it.
        default = "auto" if "ours_auto" in v else "k1"
        chosen = lat.get(default, {})
        value = v[f"ours_{default}"]["overhead_fraction"]
        entry = _entry(
            "agreement_overhead_fraction",
            value,
            step_s={name: row["step_s"] for name, row in v.items()},
            overhead_fraction={name: row["overhead_fraction"] for name, row in v.items()},
            boundary_call_s={name: row.get("boundary_call_s") for name, row in v.items()},
            stop_latency_s={k: row["seconds"] for k, row in lat.items()},
            stop_latency_max_s={k: row["seconds_max"] for k, row in lat.items()},
            stop_latency_steps={k: row["steps"] for k, row in lat.items()},
            big_k=ddp["raw"]["big_k"],
            steps_per_block=ddp["raw"]["steps_per_block"],
            rounds=ddp["raw"]["rounds"],
        )
        if entry["pass"] is not None:
            entry["pass"] = bool(entry["pass"] and chosen.get("seconds", float("inf")) <= STOP_LATENCY_TARGET_S)
        entry["target"] += f", stop latency <= {STOP_LATENCY_TARGET_S:g} s"
        out["agreement_overhead_fraction"] = entry
    ext = results.get("exit")
    if isinstance(ext, dict) and "median_s" in ext and isinstance(ddp, dict) and "variants" in ddp:
        step_s, save_s = ddp["variants"]["none"]["step_s"], ddp["save_s"]
        budget = step_s + save_s + 1.0
        worst = max(s for s in ext["median_s"].values() if s is not None)
        published = [s for s in ext["median_published_s"].values() if s is not None]
        out["signal_to_exit_vs_budget"] = _entry(
            "signal_to_exit_vs_budget",
            worst / budget,
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
            out["signal_to_exit_vs_budget"]["pass"] = False
    rss = results.get("rss")
    if isinstance(rss, dict) and "extra_bytes" in rss:
        state = rss["state_bytes"]
        med = rss["median_extra_bytes"]
        out["save_peak_extra_rss_fraction"] = _entry(
            "save_peak_extra_rss_fraction",
            med["ours"] / state,
            extra_bytes=med,
            state_bytes=state,
            fraction={k: b / state for k, b in med.items()},
            method=rss["method"],
        )
    for key in KEYS:
        if key not in out:
            section = {
                "save_vs_disk": "save",
                "save_vs_torch_save": "save",
                "save_vs_dcp": "save",
                "load_vs_disk": "load",
                "async_block_vs_memcpy": "async",
                "async_block_vs_dcp_async": "async",
                "agreement_overhead_fraction": "agreement",
                "signal_to_exit_vs_budget": "exit",
                "save_peak_extra_rss_fraction": "rss",
                "sharded_save_vs_disk": "sharded",
                "sharded_save_vs_dcp": "sharded",
            }[key]
            got = results.get(section)
            reason = got.get("error") if isinstance(got, dict) and "error" in got else "skipped"
            out[key] = _entry(key, None, error=reason)
    return out


# -- the markdown table ------------------------------------------------------------------------------
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


def table(fig: dict[str, Any], meta: dict[str, Any], extra_rows: list[tuple[str, str, str, str, str, str]] = ()) -> str:
    """The markdown table of the issue's figures (one row per figure, with its anchor), then ``extra_rows``
    (``bench.report_sharded.rows``)."""
    rows: list[tuple[str, str, str, str, str, str]] = []
    state = meta.get("state_bytes") or 0
    f = fig["save_vs_disk"]
    if f.get("value") is not None:
        rows.append(
            (
                f"sync save, {human_bytes(state)} state",
                f"{_s(f['ours_s'])} ({_rate(state, f['ours_s'])})",
                f"disk write+fsync {_s(f['disk_s'])} ({_rate(state, f['disk_s'])})",
                _x(f["value"], "{:.2f} of disk"),
                f["target"],
                _verdict(f["pass"]),
            )
        )
        g = fig["save_vs_torch_save"]
        rows.append(
            (
                "sync save vs torch.save",
                _s(g["ours_s"]),
                f"torch.save {_s(g['torch_save_s'])} ({_rate(state, g['torch_save_s'])})",
                _x(g["value"], "{:.2f}x as fast"),
                g["target"],
                _verdict(g["pass"]),
            )
        )
        g = fig["save_vs_dcp"]
        rows.append(
            (
                "sync save vs DCP save",
                _s(g["ours_s"]),
                f"DCP save {_s(g['dcp_s'])} ({_rate(state, g['dcp_s'])})",
                _x(g["value"], "{:.2f}x as fast"),
                "peer",
                "—",
            )
        )
    else:
        rows.append(("sync save", "n/a", "", "", f.get("target") or "", f.get("error", "n/a")))
    f = fig["load_vs_disk"]
    if f.get("value") is not None:
        rows.append(
            (
                "load for resume (cold)",
                f"{_s(f['ours_s'])} ({_rate(state, f['ours_s'])})",
                f"disk cold read {_s(f['disk_s'])} ({_rate(state, f['disk_s'])})",
                _x(f["value"], "{:.2f} of disk"),
                f["target"],
                _verdict(f["pass"]),
            )
        )
        rows.append(
            ("load vs safetensors load", _s(f["ours_s"]), f"safetensors {_s(f['safetensors_s'])}", _x(f["load_vs_safetensors"], "{:.2f}x as fast"), "peer", "—")
        )
        rows.append(("load vs DCP load", _s(f["ours_s"]), f"DCP load {_s(f['dcp_s'])}", _x(f["load_vs_dcp"], "{:.2f}x as fast"), "peer", "—"))
        rows.append(
            (
                "resume = choose (manifests, sizes) + load (digests checked while reading)",
                _s(f["ours_validate_s"] + f["ours_s"]),
                f"disk cold read {_s(f['disk_s'])}",
                _x(f["resume_vs_disk"], "{:.2f} of disk"),
                "info",
                "—",
            )
        )
    else:
        rows.append(("load for resume", "n/a", "", "", f.get("target") or "", f.get("error", "n/a")))
    f = fig["async_block_vs_memcpy"]
    if f.get("value") is not None:
        g = fig["async_block_vs_dcp_async"]
        rows.append(("async save: loop blocked", _s(f["ours_blocked_s"]), f"memcpy {_s(f['memcpy_s'])}", _x(f["value"]), f["target"], _verdict(f["pass"])))
        rows.append(
            (
                "async blocked vs DCP async_save",
                _s(f["ours_blocked_s"]),
                f"DCP async_save {_s(g['dcp_async_blocked_s'])} (DefaultStager {_s(g['dcp_async_staged_blocked_s'])})",
                _x(g["value"]),
                "peer",
                "—",
            )
        )
    elif "memcpy_s" in f:
        rows.append(("async save: loop blocked", f.get("status", "n/a").split(":")[0], f"memcpy {_s(f['memcpy_s'])}", "n/a", f["target"], "n/a"))
        rows.append(
            (
                "async blocked vs DCP async_save",
                "n/a",
                f"DCP async_save {_s(f['dcp_async_blocked_s'])} (DefaultStager {_s(f['dcp_async_staged_blocked_s'])})",
                "n/a",
                "peer",
                "—",
            )
        )
    else:
        rows.append(("async save", "n/a", "", "", f.get("target") or "", f.get("error", "n/a")))
    f = fig["agreement_overhead_fraction"]
    if f.get("value") is not None:
        step, over, k = f["step_s"], f["overhead_fraction"], f["big_k"]
        lat, steps = f["stop_latency_s"], f["stop_latency_steps"]
        for name, label in (
            ("ours_k1", "stop agreement, ours k=1"),
            (f"ours_k{k}", f"stop agreement, ours k={k}"),
            ("ours_auto", "stop agreement, ours k=auto (default, 0.1 s)"),
            ("blocking", "blocking all-reduce every step"),
        ):
            if name not in over:
                continue
            ok = None if name == "blocking" else over[name] <= 0.01
            inside = f["boundary_call_s"].get(name)
            where = f" ({_s(inside)} inside the call)" if inside is not None else ""
            rows.append(
                (
                    f"{label} (2 ranks, DDP step)",
                    _s(step[name]) + where,
                    f"no agreement {_s(step['none'])}",
                    f"{over[name]:+.1%}",
                    "<= 1 %" if ok is not None else "peer",
                    _verdict(ok),
                )
            )
        for key, label in (("k1", "stop latency, k=1"), (f"k{k}", f"stop latency, k={k}"), ("auto", "stop latency, k=auto")):
            if key in lat:
                ok = lat[key] <= STOP_LATENCY_TARGET_S
                rows.append((label, f"{_s(lat[key])}, {steps[key]:g} steps", "os.kill of one rank", "", f"<= {STOP_LATENCY_TARGET_S:g} s", _verdict(ok)))
    else:
        rows.append(("stop agreement", "n/a", "", "", f.get("target") or "", f.get("error", "n/a")))
    f = fig["signal_to_exit_vs_budget"]
    if f.get("value") is not None:
        ex, pub, td = f["exit_s"], f["published_s"], f["python_teardown_s"]

        def modes(d: dict[str, Any]) -> str:
            return ", ".join(f"{'all signalled' if m == 'all' else 'one signalled'} {_s(v)}" for m, v in d.items())

        budget = f"step {_s(f['step_s'])} + save {_s(f['save_s'])} + 1 s = {_s(f['budget_s'])}"
        rows.append(("signal to exit, 2 ranks (digits)", modes(ex), budget, _x(f["value"], "{:.2f} of budget"), f["target"], _verdict(f["pass"])))
        ok = f["published_vs_budget"] <= 1 if f["published_vs_budget"] is not None else None
        rows.append(
            (
                "signal to stop checkpoint published",
                modes(pub),
                budget,
                _x(f["published_vs_budget"], "{:.2f} of budget"),
                "info",
                _verdict(ok, f["published_vs_budget"]),
            )
        )
        rows.append(
            (
                "python exit with torch imported (limit)",
                f"{_s(td.get('plain'))}",
                f"with gc.freeze() {_s(td.get('gc_freeze'))}; os._exit {_s(td.get('os_exit'))}",
                "",
                "info",
                "—",
            )
        )
    else:
        rows.append(("signal to exit", "n/a", "", "", f.get("target") or "", f.get("error", "n/a")))
    f = fig["save_peak_extra_rss_fraction"]
    if f.get("value") is not None:
        e, fr = f["extra_bytes"], f["fraction"]
        rows.append(
            (
                "peak extra RSS, sync save",
                human_bytes(e["ours"]),
                f"state {human_bytes(f['state_bytes'])}; torch.save +{fr['torch_save']:.0%}, DCP +{fr['dcp']:.0%}",
                f"{f['value']:.1%}",
                f["target"],
                _verdict(f["pass"]),
            )
        )
    else:
        rows.append(("peak extra RSS", "n/a", "", "", f.get("target") or "", f.get("error", "n/a")))
    rows += extra_rows
    header = ("figure", "ours", "anchor (same run)", "ratio", "target", "")
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
