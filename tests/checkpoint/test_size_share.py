"""The resume's size checks are spread over the ranks: rank 0 chooses and parses the manifest,
each rank ``stat``s its share (1/N of the files), one verdict decides; a file missing in rank 1's
share makes both ranks fall back together, with the warnings and ``.bad`` text a serial check
gives. 2 real ranks over gloo: checkpoints from ``helpers/sample_train.py``, the choice by
``helpers/resume_stats.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from resilience import ExitCode
from resilience.checkpoint.layout import BAD_MARKER, LATEST, MANIFEST, needed_to_resume
from resilience.checkpoint.size_checks import size_share
from resilience.launch import launch
from sample_runs import run

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]
EVERY_2 = "step_scheduler.ckpt_every_steps=2"
PROBE = Path(__file__).resolve().parents[1] / "helpers" / "resume_stats.py"


def _resume_files(directory: Path) -> dict:
    files = json.loads((directory / MANIFEST).read_text())["files"]
    return {rel: want for rel, want in files.items() if needed_to_resume(rel)}


def _stats(root: Path, out: Path) -> list[dict]:
    with launch([sys.executable, str(PROBE), str(root), str(out)], 2, env={"OMP_NUM_THREADS": "1"}, failure_grace_s=60.0) as group:
        assert group.wait(timeout=120) == 0
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in (0, 1)]


def test_each_rank_checks_the_sizes_of_its_half_and_a_file_missing_in_rank_1s_share_makes_both_fall_back(tmp_path):
    ckpt = tmp_path / "ck"
    assert run(ckpt, tmp_path / "first.rec", nproc=2, overrides=[EVERY_2, "step_scheduler.max_steps=4"]) == [ExitCode.DONE] * 2
    latest = (ckpt / LATEST).resolve()
    files = _resume_files(latest)

    # Each rank stats its own half of the chosen checkpoint's files, none of the other's.
    by_rank = _stats(ckpt, tmp_path / "stats")
    assert [r["found"] for r in by_rank] == ["epoch_0_step_4"] * 2
    for r, seen in enumerate(by_rank):
        mine = {str(latest / rel) for rel in size_share(files, r, 2)}
        stat_files = {p for p in seen["stats"] if p.removeprefix(f"{latest}/") in files}
        assert stat_files == mine and len(mine) in (len(files) // 2, (len(files) + 1) // 2), (r, sorted(stat_files))

    # A file only rank 1 checks is gone: both ranks fall back to step 2, rank 0 saying what a serial check says.
    target = latest / next(iter(size_share(files, 1, 2)))
    target.unlink()
    by_rank = _stats(ckpt, tmp_path / "fallback")
    assert [r["found"] for r in by_rank] == ["epoch_0_step_2"] * 2
    assert by_rank[0]["warnings"] == [f"skipping invalid checkpoint: {target}: missing", "falling back to epoch_0_step_2"], by_rank[0]
    assert (latest / BAD_MARKER).read_text() == f"{target}: missing\n"
