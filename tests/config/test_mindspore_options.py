"""MindSpore Transformers options under their names: aliases of our keys, save/load switches,
``common.json``, the global-batch-size rescale on resume, the final save, and atomic re-saves."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from resilience import ExitCode, resilient_loop
from resilience.checkpoint import Checkpointer, CheckpointNotFound, TrainingState
from resilience.checkpoint.layout import LATEST
from resilience.checkpoint.storage.manifest import read_manifest, validate
from resilience.checkpoint.storage.pointers import read_pointer
from resilience.config import ConfigError, config_from_dict, load_config
from resilience.distributed import DistContext
from resilience.state.step_scheduler import StepScheduler

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # torchdata's set_vital deprecation
    pytest.mark.usefixtures("no_launcher_environment"),
]

BATCHES = [torch.full((2, 2), float(i)) for i in range(12)]


class MasterCopyAdam(torch.optim.Adam):
    """An optimizer with MindSpore's FP32-master-copy hook."""

    reloads = 0

    def reload_main_params_from_model(self) -> None:
        type(self).reloads += 1


def train(cfg: dict, *, dataloader=BATCHES, lr: float = 0.01, on_step=None, extra_state=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = MasterCopyAdam(model.parameters(), lr=lr)
    with resilient_loop(cfg, model=model, optimizer=optimizer, dataloader=dataloader, extra_state=extra_state) as loop:
        for step in loop:
            if on_step is not None:
                on_step(step, model, optimizer)
            optimizer.zero_grad()
            loss = model(step.batch).pow(2).mean()
            loss.backward()
            optimizer.step()
            loop.log(loss=loss.item())
    return loop, model, optimizer


def ms(root: Path, **checkpoint) -> dict:
    """A MindSpore-style configuration: the checkpoint section under MindSpore's names."""
    sched = {"max_steps": checkpoint.pop("max_steps", 3)}
    return {"step_scheduler": sched, "checkpoint": {"save_path": str(root), "save_interleaved_steps": 1, **checkpoint}}


# -- configuration ---------------------------------------------------------------------------------
def test_mindspore_names_map_onto_ours():
    cfg = config_from_dict(
        {
            "checkpoint": {
                "save_path": "/x/ck",
                "save_interleaved_steps": 50,
                "async_save": True,
                "save_max": 5,
                "no_save_optim": True,
                "no_load_optim": True,
                "load_path": "/x/pre",
                "load_balanced": True,
                "prefix": "llama",
                "enable_save": True,
            },
            "training": {"global_batch_size": 64, "seed": 1},
        }
    )
    ck = cfg.checkpoint
    assert (ck.checkpoint_dir, cfg.step_scheduler.ckpt_every_steps, ck.is_async) == ("/x/ck", 50, True)
    assert (ck.save_max, ck.no_save_optim, ck.no_load_optim, ck.load_path, ck.load_balanced, ck.prefix) == (5, True, True, "/x/pre", True, "llama")
    assert cfg.step_scheduler.global_batch_size == 64
    assert cfg.extra["training"] == {"global_batch_size": 64, "seed": 1}  # the user's section stays theirs
    again = config_from_dict(json.loads(json.dumps(cfg.to_dict())))  # round trip under our names
    assert again.checkpoint == ck and again.step_scheduler == cfg.step_scheduler


@pytest.mark.parametrize(
    "ours, theirs",
    [
        ({"checkpoint": {"checkpoint_dir": "/a"}}, {"checkpoint": {"save_path": "/b"}}),
        ({"step_scheduler": {"ckpt_every_steps": 10}}, {"checkpoint": {"save_interleaved_steps": 20}}),
        ({"checkpoint": {"is_async": False}}, {"checkpoint": {"async_save": True}}),
        ({"step_scheduler": {"global_batch_size": 8}}, {"training": {"global_batch_size": 16}}),
    ],
)
def test_both_spellings_with_different_values_is_an_error_naming_both(ours, theirs):
    data: dict = {}
    for part in (ours, theirs):
        for section, keys in part.items():
            data.setdefault(section, {}).update(keys)
    ((their_section, their_keys),) = theirs.items()
    ((our_section, our_keys),) = ours.items()
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert f"{their_section}.{next(iter(their_keys))}" in str(info.value)
    assert f"{our_section}.{next(iter(our_keys))}" in str(info.value)


def test_both_spellings_with_the_same_value_are_accepted():
    cfg = config_from_dict({"checkpoint": {"checkpoint_dir": "/a", "save_path": "/a"}})
    assert cfg.checkpoint.checkpoint_dir == "/a"


@pytest.mark.parametrize("value", ["", None, "  "])
def test_empty_save_path_while_saving_is_an_error(value):
    with pytest.raises(ConfigError, match="checkpoint.save_path must be provided when checkpoint.enable_save is true"):
        config_from_dict({"checkpoint": {"save_path": value}})
    config_from_dict({"checkpoint": {"save_path": value, "enable_save": False}})  # nothing is saved: fine


@pytest.mark.parametrize(
    "key, value",
    [
        ("enable_save", "yes"),
        ("no_save_optim", 1),
        ("no_load_optim", None),
        ("load_balanced", "true"),
        ("remove_redundancy", "false"),
        ("remove_redundancy", 1),
        ("is_async", 0),
        ("save_max", 0),
        ("prefix", 3),
        ("best_metric_key", ""),
        ("load_path", 5),
    ],
)
def test_bad_values_name_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"checkpoint\.{key}"):
        config_from_dict({"checkpoint": {key: value}})


@pytest.mark.parametrize(
    "misspelt, value, close",
    [("asyncsave", True, "async_save"), ("save_pth", "/tmp/x", "save_path"), ("save_interleaved_step", 3, "save_interleaved_steps")],
    ids=["async_save", "save_path", "save_interleaved_steps"],
)
def test_a_misspelt_mindspore_name_is_told_its_mindspore_spelling(misspelt, value, close):
    with pytest.raises(ConfigError, match=rf"checkpoint\.{misspelt}: unknown key; did you mean '{close}'\?"):
        config_from_dict({"checkpoint": {misspelt: value}})


@pytest.mark.parametrize(
    "key, value, ours",
    [("async_save", "maybe", "checkpoint.is_async"), ("save_interleaved_steps", 0, "step_scheduler.ckpt_every_steps")],
)
def test_a_bad_value_under_a_mindspore_name_names_the_key_as_written(key, value, ours):
    with pytest.raises(ConfigError, match=rf"^checkpoint\.{key} \(read as {re.escape(ours)}\): "):
        config_from_dict({"checkpoint": {key: value}})


@pytest.mark.parametrize("value", [True, False])
def test_remove_redundancy_loads_from_yaml_and_false_says_it_changes_nothing(tmp_path, caplog, value):
    """MindSpore's ``remove_redundancy`` is a key of ours (it was an unknown-key error): replicated
    tensors are stored once anyway, so ``false`` is accepted with a warning saying so."""
    path = tmp_path / "config.yaml"
    path.write_text(f"checkpoint:\n  save_path: {tmp_path / 'ck'}\n  remove_redundancy: {str(value).lower()}\n")
    with caplog.at_level(logging.WARNING, logger="resilience"):
        cfg = load_config(path)
    assert cfg.checkpoint.remove_redundancy is value
    said = [r.getMessage() for r in caplog.records if "remove_redundancy" in r.getMessage()]
    assert said == ([] if value else ["checkpoint.remove_redundancy: false has no effect: replicated tensors are stored once anyway (by one of their holders)"])
    assert config_from_dict({}).checkpoint.remove_redundancy is True  # the default, as MindSpore's


def test_load_path_and_restore_from_together_is_an_error():
    with pytest.raises(ConfigError, match="load_path and checkpoint.restore_from"):
        config_from_dict({"checkpoint": {"load_path": "/a", "restore_from": "/b"}})


# -- saving ----------------------------------------------------------------------------------------
def test_enable_save_false_trains_without_writing_anything(tmp_path):
    root = tmp_path / "ck"
    loop, _, _ = train(ms(root, enable_save=False))
    assert loop.exit_code == ExitCode.DONE
    assert not root.exists()


def test_save_path_and_save_interleaved_steps_drive_the_saves_and_a_final_save_ends_training(tmp_path):
    root = tmp_path / "ck"
    loop, _, _ = train({"step_scheduler": {"max_steps": 5}, "checkpoint": {"save_path": str(root), "save_interleaved_steps": 2}})
    assert sorted(p.name for p in root.glob("epoch_*")) == ["epoch_0_step_2", "epoch_0_step_4", "epoch_0_step_5"]
    assert read_manifest(root / "epoch_0_step_5")["meta"]["reason"] == "final"


def test_no_save_optim_saves_weights_without_optimizer_state_and_resume_starts_it_fresh(tmp_path, caplog):
    root = tmp_path / "ck"
    train(ms(root, no_save_optim=True, max_steps=2))
    files = read_manifest(root / "epoch_0_step_2")["files"]
    assert not [f for f in files if f.startswith("optim/") and f != "optim/lr_scheduler.json"]
    assert read_manifest(root / "epoch_0_step_2")["meta"]["optimizer_saved"] is False
    seen = []
    MasterCopyAdam.reloads = 0
    with caplog.at_level(logging.WARNING, logger="resilience.checkpoint"):
        train(ms(root, no_save_optim=True, max_steps=3), on_step=lambda s, m, o: seen.append((s.global_step, len(o.state))))
    assert seen == [(3, 0)]  # continues at step 3 with an empty optimizer state
    assert MasterCopyAdam.reloads == 1
    assert "holds no optimizer state" in caplog.text


def test_common_json_records_mindspore_training_info(tmp_path):
    root = tmp_path / "ck"
    cfg = ms(root, max_steps=4)
    cfg["step_scheduler"].update(num_epochs=2, global_batch_size=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    train(cfg, dataloader=BATCHES[:3], extra_state={"scaler": scaler})
    common = {p.name: json.loads((p / "common.json").read_text()) for p in root.glob("epoch_*")}
    assert common["epoch_0_step_3"] == {"epoch_num": 1, "step_num": 3, "global_step": 3, "loss_scale": 1024.0, "global_batch_size": 2, "ckpt_status": None}
    assert common["epoch_1_step_4"] == {"epoch_num": 2, "step_num": 1, "global_step": 4, "loss_scale": 1024.0, "global_batch_size": 2, "ckpt_status": None}
    assert "common.json" in read_manifest(root / "epoch_1_step_4")["files"]


def test_resaving_a_step_of_an_abandoned_timeline_replaces_it_atomically_and_keeps_the_old_one_aside(tmp_path):
    root = tmp_path / "ck"
    train({"step_scheduler": {"max_steps": 4, "ckpt_every_steps": 2}, "checkpoint": {"checkpoint_dir": str(root)}})
    first = read_manifest(root / "epoch_0_step_4")["meta"]
    _, model, _ = train(
        {"step_scheduler": {"max_steps": 4, "ckpt_every_steps": 2}, "checkpoint": {"checkpoint_dir": str(root), "restore_from": "epoch_0_step_2"}}, lr=0.5
    )
    second = validate(root / "epoch_0_step_4")["meta"]
    assert second["saved_at"] > first["saved_at"]
    assert read_pointer(root, LATEST) == root / "epoch_0_step_4"
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    assert names[:2] == ["epoch_0_step_2", "epoch_0_step_4"] and names[2].startswith("epoch_0_step_4.abandoned-") and len(names) == 3
    assert validate(root / names[2])["meta"]["checkpoint_id"] == first["checkpoint_id"]  # the first run's step 4, kept
    assert second["parent"] == {"name": "epoch_0_step_2", "checkpoint_id": validate(root / "epoch_0_step_2")["meta"]["checkpoint_id"]}
    fresh = torch.nn.Linear(2, 1)
    state = TrainingState(model=fresh)
    Checkpointer(
        config_from_dict({"checkpoint": {"checkpoint_dir": str(root)}}).checkpoint, DistContext(), state=state, scheduler=StepScheduler(num_epochs=1)
    ).load(root / "epoch_0_step_4", state)
    assert torch.equal(fresh.weight, model.weight)  # the second run's weights, not the first's


# -- loading ---------------------------------------------------------------------------------------
def test_no_load_optim_loads_only_weights_from_load_path_and_a_requeue_resumes_its_own_run(tmp_path):
    pre, out = tmp_path / "pretrained", tmp_path / "out"
    _, pretrained, _ = train(ms(pre, max_steps=3))
    seen = []

    def watch(step, model, optimizer):
        seen.append((step.global_step, len(optimizer.state), torch.equal(model.weight, pretrained.weight)))

    MasterCopyAdam.reloads = 0
    loop, _, _ = train(ms(out, load_path=str(pre), no_load_optim=True, load_balanced=True, max_steps=2), on_step=watch)
    assert seen[0] == (1, 0, True)  # step 1, a fresh optimizer, the pretrained weights
    assert MasterCopyAdam.reloads == 1  # the FP32 master copy is rebuilt from the loaded weights
    assert loop.checkpointer.run_id != read_manifest(pre / "epoch_0_step_3")["meta"]["run_id"]

    seen.clear()
    loop, _, _ = train(ms(out, load_path=str(pre), no_load_optim=True, max_steps=3), on_step=watch)
    assert loop.resumed_from == out / "epoch_0_step_2"  # its own LATEST, fully: not load_path again
    assert seen[0][:2] == (3, 2)  # step 3, with the optimizer state of its own step 2


def test_load_path_names_a_checkpoint_or_a_root(tmp_path):
    src = tmp_path / "src"
    train(ms(src, max_steps=4))
    steps = []
    train(ms(tmp_path / "a", load_path=str(src / "epoch_0_step_2"), max_steps=3), on_step=lambda s, m, o: steps.append(s.global_step))
    train(ms(tmp_path / "b", load_path=str(src), max_steps=5), on_step=lambda s, m, o: steps.append(s.global_step))
    assert steps == [3, 5]  # a full resume from step 2, then from the root's LATEST (step 4)
    with pytest.raises(ConfigError, match="checkpoint.load_path='.*missing': no such directory"):  # at resilient_loop(), before training
        train(ms(tmp_path / "c", load_path=str(tmp_path / "missing")), on_step=lambda *_: pytest.fail("trained"))
    with pytest.raises(ConfigError, match="checkpoint.restore_from='epoch_0_step_9': no such checkpoint directory"):
        train(ms(tmp_path / "c", restore_from="epoch_0_step_9"), on_step=lambda *_: pytest.fail("trained"))
    (tmp_path / "empty").mkdir()  # exists but holds no checkpoint: found when the resume looks
    with pytest.raises(CheckpointNotFound, match="checkpoint.load_path"):
        train(ms(tmp_path / "c", load_path=str(tmp_path / "empty")))
    train(ms(tmp_path / "a", load_path=str(tmp_path / "missing"), max_steps=4))  # "a" has its own LATEST: load_path is not read


# -- global batch size rescale ---------------------------------------------------------------------
SAMPLES = 1000


def sampler_loader(batch_size: int):
    dataset = TensorDataset(torch.arange(SAMPLES, dtype=torch.float32).unsqueeze(1))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=7)
    return StatefulDataLoader(dataset, batch_size=batch_size, sampler=sampler)


def sample_run(root: Path, batch_size: int, max_steps: int, first: list):
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    cfg = {"step_scheduler": {"max_steps": max_steps, "global_batch_size": batch_size}, "checkpoint": {"checkpoint_dir": str(root)}}
    with resilient_loop(cfg, model=model, optimizer=optimizer, dataloader=sampler_loader(batch_size)) as loop:
        for step in loop:
            first.append((step.global_step, step.batch[0].squeeze(1).long().tolist()))
            optimizer.zero_grad()
            model(step.batch[0]).pow(2).mean().backward()
            optimizer.step()
    return loop


def epoch_order() -> list[int]:
    sampler = DistributedSampler(range(SAMPLES), num_replicas=1, rank=0, shuffle=True, seed=7)
    sampler.set_epoch(0)
    return list(sampler)


@pytest.fixture(scope="module")
def saved_at_100_with_global_batch_2(tmp_path_factory):
    root = tmp_path_factory.mktemp("gbs") / "ck"
    batches: list = []
    loop = sample_run(root, 2, 100, batches)  # no periodic saves: the final save at step 100
    assert loop.exit_code == ExitCode.DONE and batches[-1][0] == 100
    return root


def test_resume_with_a_larger_global_batch_continues_at_the_next_sample_and_global_step_keeps_counting(saved_at_100_with_global_batch_2, tmp_path):
    root = tmp_path / "ck"
    shutil.copytree(saved_at_100_with_global_batch_2, root, symlinks=True)
    common = json.loads((root / "epoch_0_step_100" / "common.json").read_text())
    assert (common["global_step"], common["global_batch_size"]) == (100, 2)
    seen: list = []
    loop = sample_run(root, 4, 102, seen)
    order = epoch_order()
    assert loop.scheduler.global_step == 102
    assert seen[0] == (101, order[200:204])  # 100 steps x 2 = 200 samples consumed: sample 200 comes next
    assert seen[1] == (102, order[204:208])
    assert json.loads((root / "epoch_0_step_102" / "common.json").read_text())["global_batch_size"] == 4


def test_a_global_batch_that_does_not_divide_the_consumed_samples_is_refused_before_training(saved_at_100_with_global_batch_2, tmp_path, caplog):
    root = tmp_path / "ck"
    shutil.copytree(saved_at_100_with_global_batch_2, root, symlinks=True)
    seen: list = []
    with caplog.at_level(logging.ERROR, logger="resilience"):
        loop = sample_run(root, 3, 150, seen)
    assert loop.exit_code == ExitCode.CONFIG_ERROR and seen == []  # 200 samples are not a whole number of batches of 3
    assert "step_scheduler.global_batch_size changed from 2 (saved in epoch_0_step_100) to 3" in caplog.text
    assert read_pointer(root, LATEST).name == "epoch_0_step_100"
