"""The Hugging Face bundle of a sharded (FSDP2 / tensor-parallel / 2-D) checkpoint, streamed from
every rank's pieces: at save time (``save_consolidated``), with ``resilience consolidate`` and
``consolidate()``. The shards are written by torch's own ``HuggingFaceStorageWriter(save_distributed=True)``
(tests/helpers/hf_sharded_save.py), the file format ``model_save_format: safetensors`` uses for
DTensor models, from a tiny Llama whose vocabulary (257) splits unevenly over 2 ranks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from resilience.checkpoint.formats import shard_pieces
from resilience.checkpoint.formats.bundle_shards import plan_bundle, write_files
from resilience.checkpoint.formats.consolidate import consolidate
from resilience.checkpoint.formats.sharded_model import ConsolidateError
from resilience.checkpoint.layout import LATEST
from resilience.checkpoint.storage.durable import file_digest
from resilience.checkpoint.storage.manifest import validate
from resilience.launch import launch

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("no_launcher_environment")]

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "hf_sharded_save.py"


def sharded_save(out: Path, mode: str, ranks: int = 2, *extra: str) -> Path:
    """Run the helper under ``ranks`` gloo ranks; returns ``out``."""
    with launch([sys.executable, str(HELPER), str(out), mode, *extra], ranks, env={"OMP_NUM_THREADS": "1"}) as group:
        assert group.wait(timeout=280) == 0
    return out


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> Path:
    """A 2-rank FSDP2 checkpoint published by our writer with ``save_consolidated`` (ckpt/LATEST)."""
    return sharded_save(tmp_path_factory.mktemp("fsdp"), "fsdp", 2, "publish")


@pytest.fixture(scope="module")
def tp(tmp_path_factory) -> Path:
    """2-rank tensor parallel shards: Shard(0) and Shard(1) pieces, replicated tensors once (model/)."""
    return sharded_save(tmp_path_factory.mktemp("tp"), "tp")


def bundle_tensors(directory: Path) -> dict[str, torch.Tensor]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(directory / name)))
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors


def assert_loads_with_equal_weights_and_logits(bundle: Path, full: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> None:
    """``from_pretrained`` gives the full tensors (in ``dtype``); in float32, also the logits of a
    model holding them (a bf16 model built from a config keeps other buffers than one loaded)."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(bundle)).eval()
    state = loaded.state_dict()
    assert set(state) == set(full)
    for key, tensor in full.items():
        assert state[key].dtype == dtype and torch.equal(state[key], tensor.to(dtype)), key
    ids = torch.arange(12).reshape(2, 6) * 19 % 257
    with torch.no_grad():
        logits = loaded(ids).logits
        assert torch.isfinite(logits).all()
        if dtype == torch.float32:
            reference = transformers.LlamaForCausalLM(loaded.config).eval()
            reference.load_state_dict(full)
            assert torch.equal(logits, reference(ids).logits)


def test_our_names_for_the_sharding_metadata_are_torchs():
    from torch.distributed.checkpoint import _hf_utils

    assert shard_pieces.SHARDING_INFO == _hf_utils.CUSTOM_METADATA_KEY
    assert shard_pieces.SAVED_OFFSETS == _hf_utils.SAVED_OFFSETS_KEY


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_sharded_fsdp2_save_gets_its_bundle_from_every_ranks_shards_and_it_loads_with_equal_weights_and_logits(fsdp):
    step = (fsdp / "ckpt" / LATEST).resolve()
    manifest = validate(step)  # the bundle is in the checkpoint's own manifest, digests included
    bundle = step / "model" / "consolidated"
    files = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json", "config.json"}
    assert {p.name for p in bundle.iterdir()} == files
    assert {f"model/consolidated/{name}" for name in files} <= set(manifest["files"])
    weight_map = json.loads((bundle / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map["model.embed_tokens.weight"] == "model-00001-of-00002.safetensors"  # the shards' 0000I-of-0000N
    assert weight_map["lm_head.weight"] == "model-00002-of-00002.safetensors"
    full = load_file(str(fsdp / "full.safetensors"))
    pieces = shard_pieces.list_pieces(step / "model")
    assert [p.shape for p in pieces["model.embed_tokens.weight"].pieces] == [(129, 64), (128, 64)]  # uneven
    assert_loads_with_equal_weights_and_logits(bundle, full)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_failure_writing_one_ranks_share_of_the_bundle_raises_on_every_rank_and_publishes_nothing(tmp_path):
    out = sharded_save(tmp_path, "fsdp", 2, "publish", "1")
    for rank in (0, 1):
        message = (out / f"failed-rank{rank}.txt").read_text()
        assert "rank 1: consolidated: OSError" in message and "No space left on device (injected)" in message, message
        assert "LATEST was not moved" in message
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == []  # no checkpoint, no staging left


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_consolidating_the_fsdp2_shards_later_writes_the_same_bytes_whatever_the_band_size_or_worker_count(fsdp, tmp_path):
    model_dir = (fsdp / "ckpt" / LATEST).resolve() / "model"
    at_save = model_dir / "consolidated"
    later = consolidate(model_dir, tmp_path / "later", progress=False)
    entries = json.loads((later / "bundle_manifest.json").read_text())["files"]
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert file_digest(later / name) == file_digest(at_save / name) == entries[name]["xxh3_128"]
        assert entries[name]["size"] == (later / name).stat().st_size
    plan = plan_bundle(model_dir)
    (tmp_path / "rows").mkdir()
    records = write_files(tmp_path / "rows", plan, band_bytes=1, num_threads=3)  # one row per band, pieces read by 3 threads
    assert {rec.path: rec.digest for rec in records} == {name: entries[name]["xxh3_128"] for name in plan.files}
    (tmp_path / "procs").mkdir()
    records = write_files(tmp_path / "procs", plan, nproc=2, band_bytes=4096)
    assert {rec.path: rec.digest for rec in records} == {name: entries[name]["xxh3_128"] for name in plan.files}


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_resilience_consolidate_on_tensor_parallel_shards_shows_progress_casts_and_loads_in_transformers(tp, tmp_path):
    full = load_file(str(tp / "full.safetensors"))
    pieces = shard_pieces.list_pieces(tp / "model")
    assert [p.offsets for p in pieces["model.layers.0.mlp.down_proj.weight"].pieces] == [(0, 0), (0, 48)]  # Shard(1)
    assert len(pieces["model.layers.0.self_attn.q_proj.weight"].pieces) == 1  # replicated: stored once

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilience",
            "consolidate",
            str(tp),
            "--nproc",
            "2",
            "--num-threads",
            "2",
            "--cast-dtype",
            "bf16",
            "--output",
            str(tmp_path / "bf16"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(tmp_path / "bf16")
    assert "consolidating" in run.stderr and "100%" in run.stderr  # the progress bar, to the end
    bundle = bundle_tensors(tmp_path / "bf16")
    assert all(bundle[k].dtype == torch.bfloat16 and torch.equal(bundle[k], v.to(torch.bfloat16)) for k, v in full.items())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert_loads_with_equal_weights_and_logits(tmp_path / "bf16", full, torch.bfloat16)

    assert consolidate(tp, progress=False) == tp / "model" / "consolidated"  # original dtypes, in place
    assert_loads_with_equal_weights_and_logits(tp / "model" / "consolidated", full)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_missing_shard_file_is_refused_naming_the_tensor_left_uncovered(tp, tmp_path):
    partial = tmp_path / "model"
    shutil.copytree(tp / "model", partial, ignore=shutil.ignore_patterns("consolidated"))
    (partial / "shard-00001-model-00001-of-00002.safetensors").unlink()  # rank 0's first column blocks
    with pytest.raises(ConsolidateError, match=r"down_proj.weight: its pieces cover 3072 of its 6144 elements"):
        consolidate(partial, progress=False)
    assert not (partial / "consolidated").exists()


def write_pieces(model_dir: Path, full: torch.Tensor, blocks: list[tuple[slice, slice]], **info) -> None:
    """``full`` as 2-D ``blocks``, one shard file each, in torch's HuggingFaceStorageWriter format
    (plus ``info`` per piece, e.g. the ``global_shape`` our sharded writer records)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    for rank, (rows, cols) in enumerate(blocks):
        sharding = {"w": {"saved_offsets": [rows.start, cols.start], **info}}
        name = f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"
        save_file({"w": full[rows, cols].contiguous()}, str(model_dir / name), metadata={"DCP_SHARDING_INFO": json.dumps(sharding)})


def test_a_missing_last_block_is_caught_by_the_recorded_global_shape(tmp_path):
    full = torch.arange(35.0).reshape(5, 7)
    write_pieces(tmp_path / "model", full, [(slice(0, 3), slice(0, 7)), (slice(3, 5), slice(0, 7))], global_shape=[5, 7])
    assert torch.equal(bundle_tensors(consolidate(tmp_path / "model", progress=False))["w"], full)
    (tmp_path / "model" / "shard-00002-model-00001-of-00001.safetensors").unlink()
    with pytest.raises(ConsolidateError, match=r"w: its pieces cover 21 of its 35 elements"):
        consolidate(tmp_path / "model", tmp_path / "again", progress=False)


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_a_2d_mesh_checkpoint_with_shard0_shard1_blocks_consolidates_to_the_full_tensors(tmp_path):
    out = sharded_save(tmp_path, "2d", 4)
    pieces = shard_pieces.list_pieces(out / "model")
    down = pieces["model.layers.0.mlp.down_proj.weight"]  # (Shard(0) over dp, Shard(1) over tp): 4 blocks
    assert sorted(p.offsets for p in down.pieces) == [(0, 0), (0, 48), (32, 0), (32, 48)]
    full = load_file(str(out / "full.safetensors"))
    bundle = bundle_tensors(consolidate(out, progress=False))
    assert set(bundle) == set(full) and all(torch.equal(bundle[k], full[k]) for k in full)


MEASURE = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from resilience.checkpoint.formats.bundle_shards import plan_bundle, write_files

    def peak_rss():  # VmHWM: this process's high-water mark (ru_maxrss would carry the forking parent's)
        return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1]) * 1024

    model_dir, out, band = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    plan = plan_bundle(model_dir)
    out.mkdir()
    before = peak_rss()
    write_files(out, plan, band_bytes=band, num_threads=1)
    print(peak_rss() - before)
    """
)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmHWM from /proc (Linux)")
@pytest.mark.timeout(300)
def test_a_tensor_is_streamed_in_bands_so_peak_memory_stays_far_below_its_size(tmp_path):
    """A 64 MiB tensor in two column pieces (Shard(1), the layout that needs assembling): with
    1 MiB bands the writer's peak RSS grows by well under the tensor's size; with one band for the
    whole tensor it grows by more than the tensor (so the measurement does see a whole tensor).
    glibc's threshold for returning large blocks to the system is pinned (``MALLOC_MMAP_THRESHOLD_``):
    it otherwise rises with each freed band and keeps up to 32 MiB cached, which is the
    allocator's, bounded, not the writer's."""
    model_dir = tmp_path / "model"
    full = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0))
    write_pieces(model_dir, full, [(slice(0, 4096), slice(0, 2048)), (slice(0, 4096), slice(2048, 4096))])
    tensor_bytes = full.numel() * full.element_size()
    growth = {}
    for band in (1 << 20, tensor_bytes):
        script = [sys.executable, "-c", MEASURE, str(model_dir), str(tmp_path / f"out{band}"), str(band)]
        run = subprocess.run(
            script, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
        )
        assert run.returncode == 0, run.stderr
        growth[band] = int(run.stdout.split()[-1])
        assert torch.equal(load_file(str(tmp_path / f"out{band}" / "model-00001-of-00001.safetensors"))["w"], full)
    assert growth[1 << 20] < tensor_bytes // 4, growth
    assert growth[tensor_bytes] > tensor_bytes, growth
