"""A corrupt file that only rank 1 digests at a resume: every rank falls back to the older
checkpoint together, the corrupt one is marked bad naming the rank that found it (and kept aside when the step is saved again), and training
goes on from the older step (2 real ranks, DDP over gloo, ``helpers/sample_train.py``)."""

from __future__ import annotations

import json

from resilience import ExitCode
from resilience.checkpoint.formats import balanced_load
from resilience.checkpoint.layout import BAD_MARKER, LATEST, MANIFEST, needed_to_resume
from resilience.checkpoint.reader import _share
from sample_runs import run, steps

EVERY_2 = "step_scheduler.ckpt_every_steps=2"


def test_a_file_corrupt_in_rank_1s_share_makes_both_ranks_fall_back_to_the_older_checkpoint(tmp_path):
    ckpt = tmp_path / "ck"
    assert run(ckpt, tmp_path / "first.rec", nproc=2, overrides=[EVERY_2, "step_scheduler.max_steps=4"]) == [ExitCode.DONE] * 2
    latest = (ckpt / LATEST).resolve()
    assert latest.name == "epoch_0_step_4"
    files = {rel: want for rel, want in json.loads((latest / MANIFEST).read_text())["files"].items() if needed_to_resume(rel)}
    streams = list(balanced_load.streams(files).values())  # a DDP model and its optimizer: loaded balanced
    only_rank_1 = max(_share(files, 1, 2, streams), key=lambda rel: files[rel]["size"])
    target = latest / only_rank_1
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the digest can tell
    target.write_bytes(bytes(data))

    codes = run(ckpt, tmp_path / "second.rec", nproc=2, overrides=[EVERY_2, "step_scheduler.max_steps=6"])

    assert codes == [ExitCode.DONE] * 2, codes
    (aside,) = ckpt.glob("epoch_0_step_4.abandoned-*")  # the new step 4 moved it aside, kept
    assert f"rank 1: {target}" in (aside / BAD_MARKER).read_text()
    assert list(steps(tmp_path / "second.rec", nproc=2)) == [3, 4, 5, 6], "resumed from step 2 on both ranks"
