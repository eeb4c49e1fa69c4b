"""The Lightning integration on one process (no process group): train loaders that cannot resume
mid-epoch refused before the first step, settings owned twice or unusable refused at setup, and
Lightning's own signal handling (SLURM auto-requeue, its SIGTERM handler) off for the run."""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from resilience import ExitCode
from resilience.checkpoint.layout import LATEST, list_checkpoints
from resilience.checkpoint.storage.manifest import validate
from resilience.config import ConfigError
from resilience.integrations.lightning import fit

pytestmark = [pytest.mark.usefixtures("no_launcher_environment"), pytest.mark.filterwarnings("ignore::UserWarning")]
_spec = importlib.util.spec_from_file_location("lightning_example", Path(__file__).resolve().parents[2] / "examples" / "lightning" / "train.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def _trainer(callbacks=(), **kwargs):
    import lightning as L

    defaults = {"accelerator": "cpu", "devices": 1, "max_epochs": 1, "logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    return L.Trainer(callbacks=list(callbacks), **{**defaults, **kwargs})


def _model():
    torch.manual_seed(0)
    return example.DigitsMLP(16, 0.1, 0.01)


def _config(root: Path, **sched) -> dict:
    return {"step_scheduler": {"agreement_every_steps": 1, **sched}, "checkpoint": {"checkpoint_dir": str(root)}}


class Stream(IterableDataset):
    def __iter__(self):
        return iter(example.Digits(0, 32))


class RaisingLoader(StatefulDataLoader):
    def state_dict(self):
        raise RuntimeError("no state here")


class OpaqueLoader(StatefulDataLoader):
    def state_dict(self):
        return {"position": object()}


DATA = example.Digits(0, 32)
LOADERS = {
    "plain-dataloader": (lambda: DataLoader(DATA, batch_size=8, shuffle=True), r"train dataloader 0 \(DataLoader\) has no state_dict\(\)/load_state_dict\(\)"),
    "state-dict-raises": (lambda: RaisingLoader(DATA, batch_size=8), r"\(RaisingLoader\)\.state_dict\(\) raised RuntimeError: no state here"),
    "state-unusable": (lambda: OpaqueLoader(DATA, batch_size=8), r"\(OpaqueLoader\)\.state_dict\(\) cannot be saved: .*position"),
    "torch-random-sampler": (
        lambda: StatefulDataLoader(DATA, batch_size=8, sampler=RandomSampler(DATA)),
        r"shuffles with sampler \(RandomSampler, no generator",
    ),
    "no-length": (lambda: StatefulDataLoader(Stream(), batch_size=8), r"\(StatefulDataLoader\) has no len\(\)"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", list(LOADERS))
def test_a_train_loader_that_cannot_resume_mid_epoch_is_refused_before_the_first_step(tmp_path, kind):
    make, match = LOADERS[kind]
    steps = []

    class Count(example.L.Callback):
        def on_train_batch_start(self, *args):
            steps.append(1)

    sigterm = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ConfigError, match=match) as refused:
        fit(_trainer([Count()]), _model(), _config(tmp_path / "ck"), train_dataloaders=make())
    assert "StatefulDataLoader" in str(refused.value) and not steps  # the accepted form is named; nothing trained
    assert not list_checkpoints(tmp_path / "ck") and signal.getsignal(signal.SIGTERM) == sigterm


@pytest.mark.parametrize(
    "kwargs,config,match",
    [
        ({"callbacks": "monitor"}, {}, r"ModelCheckpoint\(\.\.\.\)\]\): its saves are not atomic"),
        ({"max_epochs": 2}, {"step_scheduler": {"num_epochs": 3}}, "num_epochs=3 and the Trainer's max_epochs=2 disagree"),
        ({"accumulate_grad_batches": 2}, {"step_scheduler": {"gradient_accumulation_steps": 4}}, "gradient_accumulation_steps=4"),
        ({}, {"step_scheduler": {"val_every_steps": 5}}, "val_check_interval"),
        ({}, {"checkpoint": {"best_metric_key": "val_loss"}}, "keeps no LOWEST_VAL"),
        ({}, {"checkpoint": {"is_async": True}}, "checkpoint.is_async"),
    ],
    ids=["model-checkpoint", "epochs", "accumulation", "val-every", "best-metric", "async"],
)
def test_settings_owned_twice_or_unusable_are_refused_at_setup(tmp_path, kwargs, config, match):
    from lightning.pytorch.callbacks import ModelCheckpoint

    if kwargs.get("callbacks") == "monitor":
        kwargs = {"callbacks": [ModelCheckpoint(monitor="val_loss")]}
    callbacks = kwargs.pop("callbacks", ())
    with pytest.raises(ConfigError, match=match):
        fit(_trainer(callbacks, **kwargs), _model(), config, train_dataloaders=StatefulDataLoader(DATA, batch_size=8))
    with pytest.raises(TypeError, match="checkpoint.restore_from"):
        fit(_trainer(), _model(), None, ckpt_path=str(tmp_path))


@pytest.mark.timeout(60)
def test_slurm_auto_requeue_and_lightnings_sigterm_handler_are_off_and_sigterm_stops_with_our_save(tmp_path, monkeypatch):
    """Under Slurm (SLURMEnvironment with auto_requeue=True, a fake ``scontrol`` that logs its calls),
    with TERM as the only stop signal: Lightning would install its SIGUSR1 requeue handler and wrap
    SIGTERM; during the run neither is there, SIGTERM stops after the step with our checkpoint and
    exit 75, and ``scontrol requeue`` is never called."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol_calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 1\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    slurm = {"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train"}
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    seen = {}

    class TermAtStep2(example.L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2 and not seen:
                seen.update(usr1=signal.getsignal(signal.SIGUSR1), term=signal.getsignal(signal.SIGTERM))
                os.kill(os.getpid(), signal.SIGTERM)  # recorded by the integration; Lightning's handler would end fit() without a save

    environment = SLURMEnvironment()
    trainer = _trainer([TermAtStep2()], plugins=[environment], default_root_dir=str(tmp_path / "root"))
    config = _config(tmp_path / "ck", preemption_signal="TERM")
    code = fit(trainer, _model(), config, train_dataloaders=StatefulDataLoader(DATA, batch_size=8, shuffle=True))  # 4 steps
    assert code == ExitCode.PREEMPTED and os.readlink(tmp_path / "ck" / LATEST) == "epoch_0_step_2"  # one rank: agreed at once
    assert validate(tmp_path / "ck" / "epoch_0_step_2")["meta"]["reason"] == "preemption"
    assert seen["usr1"] == signal.SIG_DFL and seen["term"].__qualname__.startswith("SignalRecorder"), seen
    assert "requeue" not in (calls.read_text() if calls.exists() else "")  # at most "show job" (the deadline's query)
    assert not list(tmp_path.rglob("hpc_ckpt_*.ckpt"))
    assert environment.auto_requeue and "register_signal_handlers" not in vars(trainer._signal_connector)  # as they were after fit()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # our handler gone with the run
