"""Balanced resume of replicated state (``checkpoint.load_balanced``): each byte of a DDP model's
weight shards and of its optimizer's files is read from storage by one rank and broadcast to the
others, and what every rank loads is bitwise what was saved (real gloo ranks,
``helpers/balanced_train.py``, read bytes from ``/proc/self/io``)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from resilience import ExitCode
from resilience.checkpoint.layout import BAD_MARKER, LATEST, MANIFEST, MODEL_DIR, OPTIM_DIR, SKELETON, needed_to_resume, optim_shard_name
from resilience.checkpoint.storage.manifest import all_files
from resilience.launch import launch

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "balanced_train.py"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def run(ckpt: Path, out: Path, nproc: int, overrides: list[str], env: dict[str, str] | None = None, timeout: float = 180.0) -> list[int]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(HELPER), str(ckpt), str(out), *overrides]
    deadline = time.monotonic() + timeout
    with launch(cmd, nproc, env={"OMP_NUM_THREADS": "1", **(env or {})}, failure_grace_s=30.0) as group:
        while group.poll() is None:
            assert time.monotonic() < deadline, f"balanced_train.py still running after {timeout} s"
            time.sleep(0.02)
        return [proc.returncode for proc in group.procs]


def replicated_and_rest(checkpoint: Path) -> tuple[int, int]:
    """(bytes of the model shards and optimizer files, bytes of every other file a resume reads)."""
    doc = json.loads((checkpoint / MANIFEST).read_text())
    files = {rel: e for rel, e in all_files(checkpoint, doc).items() if needed_to_resume(rel)}  # the ranks' own files too
    replicated = sum(e["size"] for rel, e in files.items() if rel.startswith((f"{MODEL_DIR}/shard-", f"{OPTIM_DIR}/shard-")))
    return replicated, sum(e["size"] for e in files.values()) - replicated + (checkpoint / MANIFEST).stat().st_size


def assert_loaded_as_saved(saver: Path, loader: Path, nproc: int) -> None:
    """What each rank of the run writing ``loader`` loaded is bitwise what the run writing ``saver`` ended with."""
    for rank in range(nproc):
        saved, loaded = torch.load(saver / f"end.rank{rank}.pt"), torch.load(loader / f"loaded.rank{rank}.pt")
        assert saved["model"].keys() == loaded["model"].keys()
        assert all(torch.equal(saved["model"][k], loaded["model"][k]) for k in saved["model"]), f"rank {rank}: weights differ"
        for p, state in saved["optim"]["state"].items():
            assert all(torch.equal(v, loaded["optim"]["state"][p][k]) for k, v in state.items()), f"rank {rank}: optimizer state differs"


def reads(out: Path, nproc: int) -> list[int]:
    return [json.loads((out / f"read.rank{rank}.json").read_text())["rchar"] for rank in range(nproc)]


@pytest.mark.timeout(600)
def test_four_ranks_each_read_a_quarter_of_the_replicated_bytes_write_no_empty_optimizer_file_and_load_bitwise(tmp_path):
    """One bias-free layer: 3 optimizer tensors over 4 ranks, so rank 3 owns none and writes no
    file. Resumed on 4 ranks, each reads ~1/4 of the weight and optimizer files (every rank read
    all of them before) and loads them bitwise; a checkpoint with every rank's optimizer file,
    rank 3's empty (as written before), resumes bitwise too."""
    ckpt, env = tmp_path / "ck", {"SMALL": "1"}
    assert run(ckpt, tmp_path / "a", 4, ["step_scheduler.max_steps=2", "step_scheduler.ckpt_every_steps=2"], env) == [ExitCode.DONE] * 4
    new = (ckpt / LATEST).resolve()
    owners = [optim_shard_name(r, 4) for r in (1, 2, 3)]
    assert json.loads((new / SKELETON).read_text())["files"] == owners
    assert sorted(p.name for p in (new / OPTIM_DIR).glob("shard-*")) == owners

    # resumed balanced from the new checkpoint; saves step 4 as before the change (every rank's file)
    second = ["step_scheduler.max_steps=4", "step_scheduler.ckpt_every_steps=2"]
    assert run(ckpt, tmp_path / "b", 4, second, {**env, "OLD_OPTIM_FILES": "1"}) == [ExitCode.DONE] * 4
    assert_loaded_as_saved(tmp_path / "a", tmp_path / "b", 4)
    replicated, rest = replicated_and_rest(new)
    got = reads(tmp_path / "b", 4)
    assert all(n <= 1.1 * replicated / 4 + rest for n in got), (got, replicated, rest)

    old = (ckpt / LATEST).resolve()
    assert old.name == "epoch_0_step_4" and (old / OPTIM_DIR / optim_shard_name(4, 4)).stat().st_size < 100, "rank 3's file: a header, no tensor"
    assert run(ckpt, tmp_path / "c", 4, ["step_scheduler.max_steps=5", "step_scheduler.ckpt_every_steps=100"], env) == [ExitCode.DONE] * 4
    assert_loaded_as_saved(tmp_path / "b", tmp_path / "c", 4)


@pytest.mark.timeout(400)
def test_load_balanced_false_reads_everything_and_a_byte_read_by_rank_1_is_caught_by_its_owner_rank_0(tmp_path):
    """Off, each of 2 ranks reads every weight and optimizer file. On, the one model shard (one
    layer, owned by rank 0, the rank holding its first byte) has its second half read by rank 1:
    a flipped byte there is caught by rank 0's digest of the bytes it received, and both ranks
    fall back to the older checkpoint. A rank whose model has other shapes stops both ranks with
    the same error."""
    ckpt, env = tmp_path / "ck", {"SMALL": "1"}
    assert run(ckpt, tmp_path / "a", 2, ["step_scheduler.max_steps=4", "step_scheduler.ckpt_every_steps=2"], env) == [ExitCode.DONE] * 2
    off = ["step_scheduler.max_steps=5", "step_scheduler.ckpt_every_steps=100", "checkpoint.load_balanced=false"]
    assert run(ckpt, tmp_path / "b", 2, off, env) == [ExitCode.DONE] * 2
    assert_loaded_as_saved(tmp_path / "a", tmp_path / "b", 2)
    replicated, _ = replicated_and_rest(ckpt / "epoch_0_step_4")
    assert all(n >= replicated for n in reads(tmp_path / "b", 2))

    latest = (ckpt / LATEST).resolve()
    (shard,) = (latest / MODEL_DIR).glob("shard-*.safetensors")
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # the last weight bytes: in rank 1's half of the data
    shard.write_bytes(bytes(data))
    assert run(ckpt, tmp_path / "c", 2, ["step_scheduler.max_steps=6"], env) == [ExitCode.DONE] * 2
    (bad,) = [p for p in ckpt.iterdir() if (p / BAD_MARKER).is_file()]
    assert f"rank 0: {latest / MODEL_DIR / shard.name}" in (bad / BAD_MARKER).read_text()

    # rank 1's model has other shapes: the same error on both ranks, before any byte moves, no hang
    codes = run(ckpt, tmp_path / "d", 2, ["step_scheduler.max_steps=7"], {**env, "MISMATCH_RANK": "1"})
    assert all(code not in (ExitCode.DONE, ExitCode.PREEMPTED) for code in codes), codes
    errors = [(tmp_path / "d" / f"error.rank{rank}").read_text() for rank in range(2)]
    assert errors[0] == errors[1] and "rank 1: the model does not match" in errors[0] and "weight [128, 256] (saved [256, 256])" in errors[0], errors


def test_a_files_owner_is_the_rank_whose_range_holds_its_first_byte():
    """The digest share (``reader._share``) and the loader agree on who owns a file through this."""
    import random

    from resilience.checkpoint.balance import stream_owners, stream_range

    rng = random.Random(3)
    for _ in range(500):
        ranks = rng.randint(1, 20)
        sizes = [(f"f{i}", rng.choice([0, 1, 8, 100, rng.randrange(10_000)])) for i in range(rng.randint(1, 10))]
        total, start, owners = sum(n for _, n in sizes), 0, stream_owners(sizes, ranks)
        for name, n in sizes:
            if start < total:
                assert stream_range(total, owners[name], ranks)[0] <= start < stream_range(total, owners[name], ranks)[1]
            start += n
