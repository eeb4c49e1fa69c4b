"""The Hugging Face Trainer integration on one process (no process group): the Trainer's own
``save_strategy`` routed through our atomic path, ``save_total_limit`` as our retention, and the
settings refused at setup, before any training (resilience.integrations.transformers.settings)."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from resilience import ExitCode
from resilience.checkpoint.layout import LATEST, LOWEST_VAL, list_checkpoints
from resilience.checkpoint.storage.manifest import validate
from resilience.config import ConfigError
from resilience.integrations.transformers import train

pytestmark = [pytest.mark.usefixtures("no_launcher_environment"), pytest.mark.filterwarnings("ignore::UserWarning")]


class Windows(torch.utils.data.Dataset):
    def __init__(self, count: int):
        g = torch.Generator().manual_seed(count)
        self.ids = torch.randint(0, 64, (count, 16), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(output_dir, callbacks=(), **args):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=None, eos_token_id=None))
    defaults = {"per_device_train_batch_size": 2, "use_cpu": True, "report_to": [], "disable_tqdm": True, "save_strategy": "no"}
    args = TrainingArguments(output_dir=str(output_dir), **{**defaults, **args})
    return Trainer(model=model, args=args, train_dataset=Windows(12), eval_dataset=Windows(4), callbacks=list(callbacks))


@pytest.mark.timeout(120)
def test_the_trainers_save_steps_and_save_total_limit_go_through_our_atomic_path(tmp_path):
    out = tmp_path / "out"
    trainer = _trainer(out, save_strategy="steps", save_steps=2, save_total_limit=2, max_steps=5, eval_strategy="steps", eval_steps=2)
    assert train(trainer, {"step_scheduler": {"agreement_every_steps": 1}}) == ExitCode.DONE
    kept = [path.name for path in list_checkpoints(out)]  # steps 2 and 4, then the final 5 (6 steps an epoch)
    best = os.readlink(out / LOWEST_VAL)  # retention keeps pointer targets besides the newest save_total_limit=2
    assert kept[:2] == ["epoch_0_step_5", "epoch_0_step_4"] and set(kept[2:]) <= {best} and "epoch_0_step_2" not in kept[:2], kept
    assert not [name for name in os.listdir(out) if name.startswith("checkpoint-")]  # no checkpoint the Trainer wrote itself
    reasons = [validate(out / name)["meta"]["reason"] for name in kept[:2]]
    assert reasons == ["final", "periodic"] and os.readlink(out / LATEST) == "epoch_0_step_5"
    assert trainer._save_checkpoint.__func__ is type(trainer)._save_checkpoint  # the Trainer's own again after train()


@pytest.mark.timeout(120)
def test_early_stopping_ends_with_a_final_save_and_the_best_model_loads_from_our_checkpoint(tmp_path):
    from transformers import EarlyStoppingCallback

    out = tmp_path / "out"
    stop_early = EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=10.0)  # no eval improves by 10
    # lr 3: the second evaluation is worse than the first, so the best checkpoint is an older one
    every_2 = {"eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps", "save_steps": 2}
    trainer = _trainer(out, [stop_early], max_steps=6, load_best_model_at_end=True, learning_rate=3.0, **every_2)
    assert train(trainer, {"step_scheduler": {"agreement_every_steps": 1}}) == ExitCode.DONE
    assert os.readlink(out / LATEST) == "epoch_0_step_4" and validate(out / "epoch_0_step_4")["meta"]["reason"] == "final"
    best = out.absolute() / f"epoch_0_step_{trainer.state.best_global_step}"  # where the Trainer's own checkpoint-<N> would be
    assert trainer.state.best_model_checkpoint == str(best) and trainer.state.best_global_step == 2
    saved, last = load_file(best / "model.safetensors"), load_file(out / "epoch_0_step_4" / "model.safetensors")
    assert all(torch.equal(trainer.model.state_dict()[key], tensor) for key, tensor in saved.items())  # load_best_model_at_end read it
    assert not all(torch.equal(last[key], tensor) for key, tensor in saved.items())


@pytest.mark.parametrize(
    "args,config,match",
    [
        ({"enable_jit_checkpoint": True}, {}, "enable_jit_checkpoint"),
        ({"save_only_model": True}, {}, "save_only_model"),
        ({"save_strategy": "best", "eval_strategy": "steps", "metric_for_best_model": "loss"}, {}, "save_strategy='best'"),
        ({"save_strategy": "steps", "save_steps": 10}, {"step_scheduler": {"ckpt_every_steps": 5}}, "ckpt_every_steps=5 and TrainingArguments.save_strategy"),
        ({"save_total_limit": 2}, {"checkpoint": {"max_recent_checkpoints": 3}}, "save_total_limit=2 disagree"),
        ({}, {"checkpoint": {"checkpoint_dir": "/elsewhere"}}, "checkpoint.checkpoint_dir='/elsewhere' and TrainingArguments.output_dir"),
        ({"gradient_accumulation_steps": 2}, {"step_scheduler": {"gradient_accumulation_steps": 4}}, "gradient_accumulation_steps=4"),
        ({"num_train_epochs": 2}, {"step_scheduler": {"num_epochs": 3}}, "num_epochs=3"),
        ({"metric_for_best_model": "accuracy", "eval_strategy": "steps"}, {}, "greater_is_better=True"),
        ({}, {"checkpoint": {"is_async": True}}, "checkpoint.is_async"),
    ],
    ids=["jit-checkpoint", "save-only-model", "save-best", "save-steps", "retention", "root", "accumulation", "epochs", "metric", "async"],
)
def test_settings_owned_twice_or_unusable_are_refused_before_training(tmp_path, args, config, match):
    sigterm = signal.getsignal(signal.SIGTERM)
    trainer = _trainer(tmp_path / "out", **args)
    signal.signal(signal.SIGTERM, sigterm)  # enable_jit_checkpoint's Trainer installed its own handler in this process
    with pytest.raises(ConfigError, match=match):
        train(trainer, config)
    assert not (tmp_path / "out").exists() or not list_checkpoints(tmp_path / "out")


def test_a_resume_path_of_the_callers_own_is_refused(tmp_path):
    with pytest.raises(TypeError, match="checkpoint.restore_from"):
        train(_trainer(tmp_path / "out"), None, resume_from_checkpoint=str(tmp_path))
