"""resilience.config: YAML loading, defaults, dotted overrides, and errors that name the key."""

from __future__ import annotations

import signal
import textwrap

import pytest
import yaml

from resilience.config import (
    CheckpointConfig,
    ConfigError,
    ResilienceConfig,
    StepSchedulerConfig,
    apply_overrides,
    config_from_dict,
    load_config,
)


def _write(tmp_path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_yaml_sections_are_ours_and_user_sections_pass_through_in_extra(tmp_path):
    path = _write(
        tmp_path,
        """
        step_scheduler:
          num_epochs: 3
          max_steps: 100
          ckpt_every_steps: 10
          preemption_signal: [SIGUSR1, TERM]
          agreement_every_steps: 2
        checkpoint:
          checkpoint_dir: /scratch/ck
          restore_from: epoch_0_step_5
          resume: false
        model:
          hidden: [64, 32]
          name: mlp
        optimizer:
          lr: 0.001
        """,
    )
    cfg = load_config(path)
    assert cfg.step_scheduler.num_epochs == 3
    assert cfg.step_scheduler.max_steps == 100
    assert cfg.step_scheduler.ckpt_every_steps == 10
    assert cfg.step_scheduler.agreement_every_steps == 2
    assert cfg.step_scheduler.signals == (signal.SIGUSR1, signal.SIGTERM)
    assert cfg.checkpoint.checkpoint_dir == "/scratch/ck"
    assert cfg.checkpoint.restore_from == "epoch_0_step_5"
    assert cfg.checkpoint.resume is False
    assert cfg.extra == {"model": {"hidden": [64, 32], "name": "mlp"}, "optimizer": {"lr": 0.001}}


def test_defaults_without_file_or_with_empty_sections(tmp_path):
    for cfg in (load_config(), load_config(_write(tmp_path, "")), load_config(_write(tmp_path, "checkpoint:\nstep_scheduler:\n"))):
        assert cfg.step_scheduler == StepSchedulerConfig()
        assert cfg.step_scheduler.num_epochs == 1
        assert cfg.step_scheduler.max_steps is None
        assert cfg.step_scheduler.ckpt_every_steps is None
        assert cfg.step_scheduler.agreement_every_steps == "auto" and cfg.step_scheduler.agreement_interval_s == 0.5
        assert cfg.step_scheduler.agreement_nodes == "auto"
        assert cfg.step_scheduler.signals == (signal.SIGTERM,)
        assert cfg.checkpoint == CheckpointConfig()
        assert cfg.checkpoint.enabled is True and cfg.checkpoint.resume is True
        assert cfg.checkpoint.checkpoint_dir == "checkpoints/"
        assert cfg.checkpoint.restore_from is None
        assert cfg.extra == {}


def test_dotted_overrides_replace_file_values_and_parse_as_yaml(tmp_path):
    path = _write(
        tmp_path,
        """
        step_scheduler:
          num_epochs: 3
        checkpoint:
          checkpoint_dir: /from/file
        model:
          width: 8
        """,
    )
    cfg = load_config(
        path,
        [
            "checkpoint.checkpoint_dir=/x",
            "step_scheduler.preemption_signal=[USR1,TERM]",
            "step_scheduler.num_epochs=5",
            "step_scheduler.max_steps=null",
            "--checkpoint.resume=false",  # a leading '--' (CLI style) is accepted
            "model.width=16",
            "data.batch_size=4",  # creates a user section
        ],
    )
    assert cfg.checkpoint.checkpoint_dir == "/x"
    assert cfg.step_scheduler.signals == (signal.SIGUSR1, signal.SIGTERM)
    assert cfg.step_scheduler.num_epochs == 5 and isinstance(cfg.step_scheduler.num_epochs, int)
    assert cfg.step_scheduler.max_steps is None
    assert cfg.checkpoint.resume is False
    assert cfg.extra == {"model": {"width": 16}, "data": {"batch_size": 4}}


def test_override_with_empty_value_is_refused_and_null_is_spelled_out():
    # An empty value read as null would turn signal handling off without a word.
    with pytest.raises(ConfigError, match=r"step_scheduler.preemption_signal=null"):
        apply_overrides({}, ["step_scheduler.preemption_signal="])
    data = apply_overrides({}, ["step_scheduler.preemption_signal=null"])
    assert data == {"step_scheduler": {"preemption_signal": None}}
    assert config_from_dict(data).step_scheduler.signals == ()


def test_slurm_times_with_colons_stay_the_text_typed_not_yaml_base_60_numbers(tmp_path):
    # PyYAML's YAML 1.1 reads 12:00:00 as 43200 and 30:00 as 1800; Slurm means the text.
    cfg = load_config(None, ["slurm.time=12:00:00", "slurm.job_name=12:30", "checkpoint.checkpoint_dir=1:30"])
    assert (cfg.slurm.time, cfg.slurm.job_name, cfg.checkpoint.checkpoint_dir) == ("12:00:00", "12:30", "1:30")
    assert load_config(_write(tmp_path, "slurm:\n  time: 30:00\n")).slurm.time == "30:00"
    assert load_config(None, ["slurm.time=90"]).slurm.time == "90"  # minutes, as sbatch --time=90
    numbers = load_config(None, ["model.a=3", "model.b=1.5", "model.c=0x10", "model.d=1_000", "model.e=1.0e-4"]).extra["model"]
    assert numbers == {"a": 3, "b": 1.5, "c": 16, "d": 1000, "e": 1.0e-4}


@pytest.mark.parametrize(
    "text, seconds",
    [("90", 5400), ("30:00", 1800), ("1:30", 90), ("12:00:00", 43200), ("1-12", 129600), ("1-12:30", 131400), ("1-0:0:15", 86415), ("unlimited", None)],
)
def test_slurm_time_forms_in_seconds_as_sbatch_reads_them(text, seconds):
    from resilience.config.slurm import slurm_time_s

    assert slurm_time_s(text) == seconds


def test_a_signal_lead_not_shorter_than_the_wall_time_is_refused_and_unlimited_time_is_accepted():
    with pytest.raises(ConfigError, match=r"slurm.signal_lead_s: 300 s is not shorter than slurm.time 5 \(300 s\)"):
        load_config(None, ["slurm.time=5"])
    assert load_config(None, ["slurm.time=6"]).slurm.time == "6"
    assert load_config(None, ["slurm.time=UNLIMITED"]).slurm.time == "UNLIMITED"


def test_to_dict_round_trips_through_yaml():
    cfg = load_config(None, ["step_scheduler.preemption_signal=[USR1, 15]", "model.width=3", "checkpoint.checkpoint_dir=/ck"])
    again = config_from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict())))
    assert again.step_scheduler.signals == cfg.step_scheduler.signals
    assert again.checkpoint == cfg.checkpoint
    assert again.extra == {"model": {"width": 3}}
    assert isinstance(ResilienceConfig().to_dict()["step_scheduler"]["preemption_signal"], str)


# (overrides, YAML text or None, substrings the ConfigError message must contain)
_ERRORS = [
    pytest.param(["checkpoint.chekpoint_dir=/x"], None, ["checkpoint.chekpoint_dir", "did you mean 'checkpoint_dir'"], id="unknown-key-suggests"),
    pytest.param([], "checkpont:\n  checkpoint_dir: /x\n", ["checkpont", "did you mean 'checkpoint'"], id="top-level-typo"),
    pytest.param([], "step_schedular:\n  num_epochs: 2\n", ["step_schedular", "did you mean 'step_scheduler'"], id="top-level-typo-2"),
    pytest.param(["step_scheduler.zzz=1"], None, ["step_scheduler.zzz", "accepted keys"], id="unknown-key-lists-accepted"),
    pytest.param(["step_scheduler.num_epochs=three"], None, ["step_scheduler.num_epochs", "integer"], id="string-num-epochs"),
    pytest.param(["step_scheduler.num_epochs=1.5"], None, ["step_scheduler.num_epochs", "integer"], id="float-num-epochs"),
    pytest.param(["step_scheduler.ckpt_every_steps=true"], None, ["step_scheduler.ckpt_every_steps", "integer"], id="bool-ckpt-every"),
    pytest.param(["checkpoint.checkpoint_dir=[a, b]"], None, ["checkpoint.checkpoint_dir", "path"], id="list-checkpoint-dir"),
    pytest.param(["checkpoint.checkpoint_dir=''"], None, ["checkpoint.checkpoint_dir"], id="empty-checkpoint-dir"),
    pytest.param(["checkpoint.resume=yes please"], None, ["checkpoint.resume", "true or false"], id="string-resume"),
    pytest.param(["checkpoint.restore_from=5"], None, ["checkpoint.restore_from"], id="int-restore-from"),
    pytest.param(["checkpoint.model_save_format=torch"], None, ["checkpoint.model_save_format", "safetensors"], id="bad-format"),
    pytest.param(["step_scheduler.num_epochs=0"], None, ["step_scheduler.num_epochs", ">= 1"], id="zero-epochs"),
    pytest.param(["step_scheduler.max_steps=-3"], None, ["step_scheduler.max_steps", ">= 1"], id="negative-max-steps"),
    pytest.param(["step_scheduler.ckpt_every_steps=0"], None, ["step_scheduler.ckpt_every_steps", ">= 1"], id="zero-ckpt-every"),
    pytest.param(["step_scheduler.agreement_every_steps=-1"], None, ["step_scheduler.agreement_every_steps", ">= 1"], id="negative-agreement"),
    pytest.param(["step_scheduler.agreement_nodes=ring"], None, ["step_scheduler.agreement_nodes", "auto, flat"], id="agreement-nodes"),
    pytest.param(["step_scheduler.preemption_signal=SIGFOO"], None, ["step_scheduler.preemption_signal", "unknown signal"], id="unknown-signal"),
    pytest.param(["step_scheduler.preemption_signal=KILL"], None, ["step_scheduler.preemption_signal", "cannot be caught"], id="uncatchable-signal"),
    pytest.param(["step_scheduler.preemption_signal=true"], None, ["step_scheduler.preemption_signal", "bool"], id="bool-signal"),
    pytest.param(["step_scheduler.preemption_signal=[]"], None, ["step_scheduler.preemption_signal", "empty list"], id="empty-signal-list"),
    pytest.param(["step_scheduler.preemption_signal=[TERM, 15]"], None, ["step_scheduler.preemption_signal", "already in the list"], id="repeated-signal"),
    pytest.param([], "checkpoint: [1, 2]\n", ["checkpoint", "mapping"], id="section-not-mapping"),
    pytest.param([], "step_scheduler:\n  num_epochs: [unclosed\n", ["invalid YAML"], id="invalid-yaml"),
    pytest.param([], "- checkpoint\n- step_scheduler\n", ["top level must be a mapping"], id="top-level-list"),
    pytest.param(["checkpoint.checkpoint_dir"], None, ["checkpoint.checkpoint_dir", "section.key=value"], id="override-without-equals"),
    pytest.param(["=5"], None, ["section.key=value"], id="override-empty-key"),
    pytest.param(["model=3", "model.width=4"], None, ["model", "not a section"], id="override-into-scalar"),
]


@pytest.mark.parametrize("overrides, text, expected", _ERRORS)
def test_bad_config_raises_config_error_naming_the_key(tmp_path, overrides, text, expected):
    path = _write(tmp_path, text) if text is not None else None
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_unreadable_config_file_raises_config_error_naming_the_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml.*cannot read"):
        load_config(missing)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path)  # a directory


def test_config_error_is_a_value_error():
    # Callers that catch ValueError (argument parsing) keep working.
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ValueError):
        StepSchedulerConfig(num_epochs="2")


def test_dataclasses_are_keyword_only():
    with pytest.raises(TypeError):
        StepSchedulerConfig(3)  # type: ignore[misc]
