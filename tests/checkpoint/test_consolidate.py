"""Model weights on disk: per-rank safetensors shards, DCP, the consolidated Hugging Face bundle,
and ``model/consolidate.sh`` / ``resilience consolidate`` (NeMo AutoModel's layout and helper)."""

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
from safetensors.torch import load_file

from resilience import resilient_loop
from resilience.checkpoint.formats import model_io
from resilience.checkpoint.formats.consolidate import consolidate, is_complete
from resilience.checkpoint.layout import LATEST
from resilience.checkpoint.storage.manifest import validate
from resilience.cli import main as cli_main
from resilience.config import ConfigError, config_from_dict
from resilience.launch import launch

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # torchdata / DCP single-process notices
    pytest.mark.usefixtures("no_launcher_environment"),
]

ORDINARY = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Mixed(torch.nn.Module):
    """Ordinary floats of three dtypes, FP8, integer and bool tensors: every case of the dtype policy."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4).to(torch.bfloat16)
        self.c = torch.nn.Linear(4, 2).to(torch.float64)
        self.register_buffer("steps", torch.arange(5, dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("scale", torch.linspace(-2, 2, 6).to(torch.float8_e4m3fn))

    def forward(self, x):
        return self.c(self.b(self.a(x).to(torch.bfloat16)).to(torch.float64)).float()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point and a.element_size() == 1:  # FP8: compare the bits
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def read_bundle(directory: Path) -> dict[str, torch.Tensor]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        part = load_file(str(directory / name))
        assert all(index["weight_map"][k] == name for k in part)
        tensors.update(part)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors


def script_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC_PER_NODE", "NUM_THREADS", "CAST_DTYPE")}
    env.update(PYTHON=sys.executable, **extra)
    return env


# -- configuration --------------------------------------------------------------------------------
def test_save_consolidated_accepts_nemo_values_and_refuses_torch_save():
    def checkpoint(**keys):
        return config_from_dict({"checkpoint": keys}).checkpoint

    assert checkpoint().save_consolidated == "final"
    assert checkpoint(save_consolidated=True).save_consolidated == "every"  # legacy spelling
    assert checkpoint(save_consolidated="every").save_consolidated == "every"
    assert checkpoint(save_consolidated=False).save_consolidated is False
    assert checkpoint(model_save_format="torch_save").save_consolidated is False  # nothing to consolidate
    with pytest.raises(ConfigError, match="save_consolidated.*model_save_format"):
        checkpoint(model_save_format="torch_save", save_consolidated="final")
    with pytest.raises(ConfigError, match="checkpoint.save_consolidated"):
        checkpoint(save_consolidated="sometimes")
    with pytest.raises(ConfigError, match="checkpoint.model_save_format.*torch_save"):
        checkpoint(model_save_format="pickle")


# -- one rank: shards and bundle round trip -------------------------------------------------------
def test_sharded_and_consolidated_round_trip_keeps_keys_shapes_dtypes_and_values(tmp_path):
    torch.manual_seed(0)
    model = Mixed()
    written = [getattr(item, "path", item) for item in model_io.save_model(tmp_path, model, consolidated=True)]
    assert model_io.model_file() in written and "model/consolidate.sh" in written
    assert os.access(tmp_path / "model" / "consolidate.sh", os.X_OK)
    expected = model.state_dict()

    restored = Mixed()
    for p in restored.parameters():
        torch.nn.init.zeros_(p)
    restored.steps.zero_()
    model_io.load_model(tmp_path, restored)
    got = restored.state_dict()
    assert list(got) == list(expected)
    assert all(same(got[k], expected[k]) for k in expected)

    bundle = read_bundle(tmp_path / "model" / "consolidated")
    assert set(bundle) == set(expected)
    assert all(same(bundle[k], expected[k]) for k in expected)  # no original headers: saved dtypes


def test_shards_split_into_consolidated_files_and_parallel_workers_write_the_same_bundle(tmp_path):
    torch.manual_seed(0)
    model = Mixed()
    model_io.save_model(tmp_path, model, max_file_bytes=300)  # forces several consolidated files
    names = sorted(p.name for p in (tmp_path / "model").glob("shard-*.safetensors"))
    assert len(names) > 1 and all(n.startswith("shard-00001-model-") and n.endswith(f"-of-{len(names):05d}.safetensors") for n in names)

    serial = consolidate(tmp_path, tmp_path / "serial", progress=False)  # a checkpoint dir works too
    assert cli_main(["consolidate", str(tmp_path / "model"), "--nproc", "2", "--num-threads", "2", "--no-progress"]) == 0
    parallel = tmp_path / "model" / "consolidated"
    assert sorted(p.name for p in parallel.glob("model-*.safetensors")) == sorted(p.name for p in serial.glob("model-*.safetensors"))
    assert len(list(parallel.glob("model-*.safetensors"))) == len(names)
    a, b = read_bundle(serial), read_bundle(parallel)
    assert set(a) == set(b) == set(model.state_dict()) and all(same(a[k], b[k]) for k in a)


def test_consolidate_refuses_a_checkpoint_whose_shard_does_not_match_its_manifest(tmp_path, capsys):
    """Found by a newcomer: a flipped byte in a shard gave a bundle with a wrong weight, exit 0."""
    torch.manual_seed(0)
    model = Mixed()
    cfg = {"step_scheduler": {"max_steps": 1}, "checkpoint": {"checkpoint_dir": str(tmp_path / "ck"), "save_consolidated": False}}
    with resilient_loop(cfg, model=model, dataloader=[0]) as loop:
        for _ in loop:
            pass
    checkpoint = tmp_path / "ck" / "epoch_0_step_1"
    (shard,) = (checkpoint / "model").glob("shard-*.safetensors")
    pristine = shard.read_bytes()
    with open(shard, "r+b") as fh:  # one byte of the last tensor's data
        fh.seek(len(pristine) - 1)
        fh.write(bytes([pristine[-1] ^ 0x01]))
    assert cli_main(["consolidate", str(checkpoint), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"{shard}: checksum mismatch (corrupted bytes); not consolidating a corrupt checkpoint" in err
    assert not (checkpoint / "model" / "consolidated").exists() and not list((checkpoint / "model").glob(".consolidated*"))
    shard.write_bytes(pristine)
    assert cli_main(["consolidate", str(checkpoint), "--no-progress"]) == 0
    bundle = read_bundle(checkpoint / "model" / "consolidated")
    assert all(same(bundle[k], v) for k, v in model.state_dict().items())


def test_removing_or_exporting_again_the_bundle_saved_with_a_checkpoint_keeps_it_resumable(tmp_path, capsys, caplog):
    """Found by a newcomer: the bundle written with the checkpoint is in its manifest, so deleting
    it (or exporting it again in bf16) made the checkpoint 'corrupt' and the next start trained
    from scratch. A resume never reads the bundle: it is left out of the resume's checks."""
    from resilience.checkpoint.reader import find_resume_checkpoint
    from resilience.distributed import DistContext

    def pick():
        return find_resume_checkpoint(DistContext(), tmp_path / "ck", None).name

    def train(max_steps):
        torch.manual_seed(0)
        model = Mixed()
        cfg = {"step_scheduler": {"max_steps": max_steps}, "checkpoint": {"checkpoint_dir": str(tmp_path / "ck"), "save_consolidated": "final"}}
        with resilient_loop(cfg, model=model, dataloader=[0, 1, 2, 3]) as loop:
            for _ in loop:
                pass
        return loop

    train(2)
    checkpoint = tmp_path / "ck" / "epoch_0_step_2"
    assert any(rel.startswith("model/consolidated/") for rel in validate(checkpoint)["files"])
    bundle = checkpoint / "model" / "consolidated"
    assert cli_main(["consolidate", str(checkpoint), "--cast-dtype", "bf16", "--no-progress"]) == 0
    assert "CAST_DTYPE bf16 was not applied" in caplog.text  # complete already: said, not silent
    shutil.rmtree(bundle)
    assert pick() == checkpoint.name
    capsys.readouterr()
    assert cli_main(["verify", str(checkpoint), "--no-progress"]) == 0
    assert "model/consolidated/: removed since the checkpoint was saved" in capsys.readouterr().out
    assert cli_main(["consolidate", str(checkpoint), "--cast-dtype", "bf16", "--no-progress"]) == 0
    assert read_bundle(bundle)["a.weight"].dtype == torch.bfloat16  # was float32
    assert pick() == checkpoint.name
    capsys.readouterr()
    assert cli_main(["verify", str(checkpoint), "--no-progress"]) == 0
    assert "verified against its bundle_manifest.json" in capsys.readouterr().out
    assert cli_main(["status", str(tmp_path / "ck")]) == 0
    assert f"Resume would pick: {checkpoint.name}" in capsys.readouterr().out
    loop = train(3)  # resumes from step 2, not from scratch
    assert loop.exit_code == 0 and not (checkpoint / ".bad").exists()
    assert validate(tmp_path / "ck" / "epoch_0_step_3")["meta"]["parent"]["name"] == checkpoint.name  # continued it


# -- consolidate.sh --------------------------------------------------------------------------------
def test_consolidate_sh_works_after_the_root_moves_from_any_directory_casts_only_floats_and_is_a_no_op_when_done(tmp_path):
    torch.manual_seed(0)
    model = Mixed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    root = tmp_path / "ck"
    cfg = {"step_scheduler": {"num_epochs": 1}, "checkpoint": {"checkpoint_dir": str(root), "save_consolidated": False}}
    loop = resilient_loop(cfg, model=model, optimizer=optimizer, dataloader=[torch.randn(3, 8) for _ in range(2)])
    with loop:
        for step in loop:
            optimizer.zero_grad()
            model(step.batch).pow(2).mean().backward()
            optimizer.step()
    expected = model.state_dict()
    assert not (root / LATEST / "model" / "consolidated").exists()  # save_consolidated: false

    moved = tmp_path / "elsewhere" / "renamed_root"
    moved.parent.mkdir()
    shutil.move(str(root), str(moved))
    script = moved / LATEST / "model" / "consolidate.sh"
    cwd = tmp_path / "some_other_dir"
    cwd.mkdir()
    run = subprocess.run(["bash", str(script)], cwd=cwd, env=script_env(CAST_DTYPE="fp16"), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = moved / LATEST / "model" / "consolidated"
    assert run.stdout.strip() == str(out.resolve())
    assert "consolidating" in run.stderr  # the progress bar
    assert not list(cwd.iterdir())  # nothing written where it was run from

    bundle = read_bundle(out)
    assert set(bundle) == set(expected)
    for key, tensor in expected.items():
        if tensor.dtype in ORDINARY:
            assert bundle[key].dtype == torch.float16 and torch.equal(bundle[key], tensor.to(torch.float16)), key
        else:  # FP8, int64, bool: untouched
            assert same(bundle[key], tensor), key
    assert {str(bundle[k].dtype) for k in ("scale", "steps", "mask")} == {"torch.float8_e4m3fn", "torch.int64", "torch.bool"}
    validate(moved / LATEST)  # the added bundle leaves the checkpoint valid

    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = subprocess.run(["bash", str(script), "--no-progress"], cwd=cwd, env=script_env(CAST_DTYPE="bf16"), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "already complete" in again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps

    # an incomplete bundle is not mistaken for a complete one: it is written again
    next(out.glob("model-*.safetensors")).unlink()
    assert not is_complete(out)
    assert cli_main(["consolidate", str(out.parent), "--no-progress"]) == 0
    assert is_complete(out) and read_bundle(out)["a.weight"].dtype == torch.float32  # no CAST_DTYPE: saved dtypes
    assert cli_main(["consolidate", str(out.parent), "--cast-dtype", "int8"]) == 2


# -- two ranks, real processes ----------------------------------------------------------------------
WORKER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from resilience import resilient_loop

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for fmt in ("safetensors", "torch_save"):
        root = Path(sys.argv[1]) / fmt
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        data = [torch.randn(4, 6, generator=torch.Generator().manual_seed(i + 10 * rank)) for i in range(3)]
        checkpoint = {"checkpoint_dir": str(root), "model_save_format": fmt, "save_consolidated": "final" if fmt == "safetensors" else False}
        loop = resilient_loop({"step_scheduler": {"num_epochs": 1}, "checkpoint": checkpoint}, model=ddp, optimizer=optimizer, dataloader=data)
        with loop:
            for step in loop:
                optimizer.zero_grad()
                ddp(step.batch).pow(2).mean().backward()
                optimizer.step()
        if int(loop.exit_code) != 0:
            sys.exit(int(loop.exit_code))
        if rank == 0:
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / "expected.safetensors"))
    dist.destroy_process_group()
    """
)


def fresh_model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    return model


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_two_ranks_each_write_a_part_and_one_process_reassembles_the_model(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    with launch([sys.executable, str(worker), str(tmp_path)], 2, env={"OMP_NUM_THREADS": "1"}) as group:
        assert group.wait(timeout=140) == 0

    # safetensors: rank K-1 writes shard-0000K-..., disjoint balanced parts; rank 0 adds the bundle
    root = tmp_path / "safetensors"
    expected = load_file(str(root / "expected.safetensors"))
    model_dir = root / LATEST / "model"
    shards = {"shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"}
    assert shards | {"consolidate.sh", "consolidated"} <= {p.name for p in model_dir.iterdir()}
    parts = [load_file(str(model_dir / f"shard-0000{k}-model-00001-of-00001.safetensors")) for k in (1, 2)]
    assert parts[0] and parts[1] and not set(parts[0]) & set(parts[1])
    assert set(parts[0]) | set(parts[1]) == set(expected)
    bundle = read_bundle(model_dir / "consolidated")
    assert set(bundle) == set(expected) and all(same(bundle[k], expected[k]) for k in expected)
    manifest = json.loads((root / LATEST / "manifest.json").read_text())["files"]
    assert {"model/shard-00001-model-00001-of-00001.safetensors", "model/shard-00002-model-00001-of-00001.safetensors"} <= set(manifest)
    restored = fresh_model()
    model_io.load_model(root / LATEST, restored)  # one process reassembles both ranks' shards
    assert all(same(restored.state_dict()[k], expected[k]) for k in expected)

    # torch_save: the model as DCP, one file per rank, nothing to consolidate
    root = tmp_path / "torch_save"
    expected = load_file(str(root / "expected.safetensors"))
    model_dir = root / LATEST / "model"
    names = {p.name for p in model_dir.iterdir()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= names
    assert not any(n.endswith(".safetensors") or n == "consolidate.sh" for n in names)
    assert cli_main(["consolidate", str(model_dir), "--no-progress"]) == 2
    restored = fresh_model()
    model_io.load_model(root / LATEST, restored)
    assert all(same(restored.state_dict()[k], expected[k]) for k in expected)


# -- save_consolidated: final when the last step is also a periodic one ---------------------------
class _NoLength:
    """Batches from a list, with no ``__len__``: the loop cannot tell the last batch before the end."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def _train_to_the_end(root: Path, loader) -> int:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"step_scheduler": {"num_epochs": 1, "ckpt_every_steps": 2}, "checkpoint": {"checkpoint_dir": str(root)}}
    with resilient_loop(cfg, model=model, optimizer=optimizer, dataloader=loader) as loop:
        for step in loop:
            model(step.batch).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert int(loop.exit_code) == 0
    return model


@pytest.mark.parametrize("loader_kind", ["with-length", "without-length"])
def test_save_consolidated_final_writes_the_bundle_when_the_last_step_is_also_a_periodic_checkpoint(tmp_path, loader_kind):
    batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    root = tmp_path / "ck"
    model = _train_to_the_end(root, batches if loader_kind == "with-length" else _NoLength(batches))
    last = (root / LATEST).resolve()
    assert last.name == "epoch_0_step_4"
    manifest = validate(last)
    assert manifest["meta"]["reason"] == "final"
    assert any(rel.startswith("model/consolidated/") for rel in manifest["files"]), "the bundle is in the manifest"
    bundle = read_bundle(last / "model" / "consolidated")
    assert set(bundle) == {"weight", "bias"}
    assert all(torch.equal(bundle[k], v) for k, v in model.state_dict().items())
    assert not (root / "epoch_0_step_2" / "model" / "consolidated").exists(), "only the last checkpoint has the bundle"
