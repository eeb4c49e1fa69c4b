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
from bench.report import KEYS  # noqa: E402


def test_size_option_accepts_bytes_and_binary_suffixes_and_names_itself_on_bad_input():
    assert parse_size("4096000") == 4096000
    assert parse_size("64M") == 64 << 20
    assert parse_size("1G") == 1 << 30
    assert parse_size("1.5GiB") == 3 << 29
    for bad in ("", "1X", "-1G", "G", "1K"):  # 1K: below the 64K floor
        with pytest.raises(ValueError, match="--size"):
            parse_size(bad)


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_quick_bench_prints_the_table_and_writes_every_figure_with_raw_times(tmp_path):
    out = tmp_path / "latest.json"
    work = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--size", "4M", "--repeat", "1", "--dir", str(work), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"

    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert table[0].startswith("| figure | ours | anchor (same run) | ratio | target |")
    for label in (
        "sync save",
        "load for resume",
        "async save",
        "stop agreement, ours k=1",
        "stop latency, k=1",
        "signal to exit",
        "peak extra RSS",
        "sync save, FSDP2 2 ranks",
        "sharded save vs DCP save",
    ):
        assert any(row.startswith(f"| {label}") for row in table), f"no table row for {label!r}:\n" + "\n".join(table)

    doc = json.loads(out.read_text())
    assert set(KEYS) <= set(doc)
    for key in KEYS:
        entry = doc[key]
        assert {"value", "target", "pass"} <= set(entry), (key, entry)
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
    assert doc["agreement_overhead_fraction"]["step_s"]["none"] > 0
    assert doc["agreement_overhead_fraction"]["stop_latency_steps"]["k1"] >= 1
    assert doc["signal_to_exit_vs_budget"]["all_exited_preempted"] is True
    assert doc["save_peak_extra_rss_fraction"]["state_bytes"] == doc["meta"]["state_bytes"]
    # the sharded save: 2 ranks, each holding about half of a state of the same size, all three methods timed
    sharded = doc["sharded_save_vs_disk"]
    assert sharded["world_size"] == 2 and len(sharded["state_bytes_per_rank"]) == 2
    assert abs(sharded["state_bytes_per_rank"][0] - sharded["state_bytes_per_rank"][1]) < 0.1 * sharded["state_bytes"]
    assert sharded["state_bytes"] > 3 * (4 << 20) * 0.9
    assert sharded["ours_s"] > 0 and sharded["disk_s"] > 0 and doc["sharded_save_vs_dcp"]["dcp_s"] > 0
    assert sharded["bytes_written"]["ours"] >= sharded["state_bytes"]
    # the scratch files are gone
    assert not any(work.iterdir()) if work.exists() else True
