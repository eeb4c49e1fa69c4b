"""The sharded-save figures of ``make bench`` (FSDP2, every rank writing its shards): their
entries from the ``sharded`` section's raw results, and their table rows."""

from __future__ import annotations

from typing import Any

from bench.common import human_bytes, median
from bench.report import _entry, _paired, _rate, _s, _verdict, _x


def figures(results: dict[str, Any]) -> dict[str, Any]:
    """``sharded_save_vs_disk`` and ``sharded_save_vs_dcp`` (absent when the section did not run)."""
    out: dict[str, Any] = {}
    sharded = results.get("sharded")
    if isinstance(sharded, dict) and "times" in sharded:
        t = sharded["times"]
        raw = {
            "ours_s": median(t["ours"]),
            "disk_s": median(t["disk"]),
            "dcp_s": median(t["dcp"]),
            "world_size": sharded["world_size"],
            "model_save_format": sharded["model_save_format"],
            "state_bytes": sharded["state_bytes"],
            "state_bytes_per_rank": sharded["state_bytes_per_rank"],
            "bytes_written": sharded["bytes_written"],
            "times_all": t,
        }
        out["sharded_save_vs_disk"] = _entry("sharded_save_vs_disk", _paired(t["disk"], t["ours"]), **raw)
        out["sharded_save_vs_dcp"] = _entry("sharded_save_vs_dcp", _paired(t["dcp"], t["ours"]), **raw)
    return out


def rows(fig: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """The two table rows: ours vs the disk, ours vs DCP (or one n/a row)."""
    f = fig["sharded_save_vs_disk"]
    if f.get("value") is None:
        return [("sync save, FSDP2 sharded", "n/a", "", "", f.get("target") or "", f.get("error", "n/a"))]
    state, n, g = f["state_bytes"], f["world_size"], fig["sharded_save_vs_dcp"]
    return [
        (
            f"sync save, FSDP2 {n} ranks ({f['model_save_format']}), {human_bytes(state)} state, each rank its 1/{n}",
            f"{_s(f['ours_s'])} ({_rate(state, f['ours_s'])} aggregate)",
            f"disk write+fsync, every rank its shards {_s(f['disk_s'])} ({_rate(state, f['disk_s'])})",
            _x(f["value"], "{:.2f} of disk"),
            f["target"],
            _verdict(f["pass"]),
        ),
        (
            f"sharded save vs DCP save ({n} ranks)",
            _s(f["ours_s"]),
            f"DCP save {_s(g['dcp_s'])} ({_rate(state, g['dcp_s'])})",
            _x(g["value"], "{:.2f}x as fast"),
            "peer",
            "—",
        ),
    ]
