"""Bad input is refused before any training starts, with an error that names the key (or the
option) and what is accepted.

Configurations go through ``resilient_loop`` with a body that records the steps it runs, so
"before any training" is checked, not assumed; a bad ``checkpoint_dir`` is also checked on two
real ranks (every rank raises, none waits for the other). The ``resilience run`` and
``resilience template`` rows run the command line in this process; a ``run`` row's target
program would leave a marker file if it were ever started.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from resilience import cli
from resilience.checkpoint import CheckpointNotFound
from resilience.config import ConfigError, load_config
from resilience.launch import launch
from tiny_runs import attempt  # the tiny training run under a config

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "phase_train.py"
SIGNAL_FORMS = "a signal name (case-insensitive, with or without SIG"


def _with_dir(config: dict, ckpt: Path) -> dict:
    section = dict(config.get("checkpoint") or {}) if isinstance(config.get("checkpoint"), dict) else config.get("checkpoint")
    if isinstance(section, dict) and "checkpoint_dir" not in section and "save_path" not in section:
        section["checkpoint_dir"] = str(ckpt)
        return {**config, "checkpoint": section}
    return config


SIG = "step_scheduler.preemption_signal"
# (id, configuration, substrings the message must contain: the key, then what is accepted)
CONFIGS = [
    # unknown keys, with a suggestion
    ("unknown-step-key", {"step_scheduler": {"ckpt_every_step": 5}}, ["step_scheduler.ckpt_every_step", "did you mean 'ckpt_every_steps'"]),
    ("unknown-checkpoint-key", {"checkpoint": {"max_recent_checkpoint": 2}}, ["checkpoint.max_recent_checkpoint", "did you mean 'max_recent_checkpoints'"]),
    ("unknown-slurm-key", {"slurm": {"partion": "gpu"}}, ["slurm.partion", "did you mean 'partition'"]),
    ("misspelt-section", {"checkpiont": {"checkpoint_dir": "/x"}}, ["checkpiont", "did you mean 'checkpoint'"]),
    # wrong types
    ("num-epochs-string", {"step_scheduler": {"num_epochs": "2"}}, ["step_scheduler.num_epochs", "an integer"]),
    ("is-async-string", {"checkpoint": {"is_async": "yes"}}, ["checkpoint.is_async", "true or false"]),
    ("enabled-string", {"checkpoint": {"enabled": "no"}}, ["checkpoint.enabled", "true or false"]),
    ("async-timeout-string", {"checkpoint": {"async_timeout_s": "10s"}}, ["checkpoint.async_timeout_s", "number of seconds > 0"]),
    ("save-max-float", {"checkpoint": {"save_max": 2.5}}, ["checkpoint.save_max", "an integer or null"]),
    ("world-size-change-word", {"checkpoint": {"world_size_change": "loose"}}, ["checkpoint.world_size_change", "accepted: strict, elastic"]),
    ("load-path-int", {"checkpoint": {"load_path": 5}}, ["checkpoint.load_path", "a path"]),
    ("best-metric-key-empty", {"checkpoint": {"best_metric_key": ""}}, ["checkpoint.best_metric_key", "a metric name"]),
    ("section-is-a-list", {"step_scheduler": [1]}, ["step_scheduler", "a mapping of keys"]),
    ("save-consolidated-word", {"checkpoint": {"save_consolidated": "sometimes"}}, ["checkpoint.save_consolidated", "final, every, false"]),
    ("model-format-word", {"checkpoint": {"model_save_format": "pickle"}}, ["checkpoint.model_save_format", "'safetensors' or 'torch_save'"]),
    # negative or zero intervals
    ("ckpt-every-negative", {"step_scheduler": {"ckpt_every_steps": -5}}, ["step_scheduler.ckpt_every_steps", ">= 1"]),
    ("val-every-zero", {"step_scheduler": {"val_every_steps": 0}}, ["step_scheduler.val_every_steps", ">= 1"]),
    ("agreement-every-zero", {"step_scheduler": {"agreement_every_steps": 0}}, ["step_scheduler.agreement_every_steps", ">= 1"]),
    ("max-steps-negative", {"step_scheduler": {"max_steps": -1}}, ["step_scheduler.max_steps", ">= 1"]),
    ("global-batch-zero", {"step_scheduler": {"global_batch_size": 0}}, ["step_scheduler.global_batch_size", ">= 1"]),
    ("async-timeout-negative", {"checkpoint": {"async_timeout_s": -1}}, ["checkpoint.async_timeout_s", "> 0"]),
    ("keep-zero-checkpoints", {"checkpoint": {"max_recent_checkpoints": 0}}, ["checkpoint.max_recent_checkpoints", ">= 1"]),
    # conflicting options
    (
        "save-max-and-max-recent",
        {"checkpoint": {"save_max": 2, "max_recent_checkpoints": 3}},
        ["checkpoint.max_recent_checkpoints and checkpoint.save_max both set", "set one of them"],
    ),
    (
        "consolidated-with-torch-save",
        {"checkpoint": {"save_consolidated": "every", "model_save_format": "torch_save"}},
        ["checkpoint.save_consolidated", "needs checkpoint.model_save_format: safetensors"],
    ),
    (
        "load-path-and-restore-from",
        {"checkpoint": {"load_path": "/a", "restore_from": "/b"}},
        ["checkpoint.load_path and checkpoint.restore_from", "set one of them"],
    ),
    (
        "retention-on-a-url-without-a-backend",
        {"checkpoint": {"checkpoint_dir": "gs://b/ck", "max_recent_checkpoints": 2}},
        ["checkpoint.checkpoint_dir", "gs:// URLs are not supported", "a local or mounted path", "s3://bucket/prefix"],
    ),
    (
        "two-spellings-disagree",
        {"checkpoint": {"save_path": "/a", "checkpoint_dir": "/b"}},
        ["checkpoint.save_path", "checkpoint.checkpoint_dir", "give one of them"],
    ),
    # bad signal specs
    ("signal-unknown-name", {"step_scheduler": {"preemption_signal": "SIGFOO"}}, [SIG, "unknown signal 'SIGFOO'", SIGNAL_FORMS]),
    ("signal-kill", {"step_scheduler": {"preemption_signal": "KILL"}}, [SIG, "cannot be caught", SIGNAL_FORMS]),
    ("signal-stop", {"step_scheduler": {"preemption_signal": "STOP"}}, [SIG, "cannot be caught", SIGNAL_FORMS]),
    ("signal-twice", {"step_scheduler": {"preemption_signal": ["USR1", "USR1"]}}, [SIG, "already in the list", SIGNAL_FORMS]),
    ("signal-zero", {"step_scheduler": {"preemption_signal": 0}}, [SIG, "positive", SIGNAL_FORMS]),
    ("signal-out-of-range", {"step_scheduler": {"preemption_signal": 99999}}, [SIG, "99999 is not a signal number", SIGNAL_FORMS]),
    ("signal-float", {"step_scheduler": {"preemption_signal": 3.5}}, [SIG, "3.5 (float)", SIGNAL_FORMS]),
    ("signal-nested-list", {"step_scheduler": {"preemption_signal": [["USR1"]]}}, [SIG + "[0]", "nested list", SIGNAL_FORMS]),
]


@pytest.mark.parametrize("config,expected", [pytest.param(c, e, id=i) for i, c, e in CONFIGS])
def test_a_bad_configuration_is_refused_before_any_step_naming_the_key_and_the_accepted_values(tmp_path, config, expected):
    error, ran = attempt(_with_dir(config, tmp_path / "ck"))
    assert isinstance(error, ConfigError), repr(error)
    for part in expected:
        assert part in str(error), f"{part!r} not in {str(error)!r}"
    assert ran == [], "no step may run"
    assert not (tmp_path / "ck").exists(), "nothing written"


def test_at_least_thirty_distinct_bad_inputs_are_covered():
    rows = len(CONFIGS) + len(YAML_FILES) + len(RUN_ARGS) + len(TEMPLATE_ARGS) + len(DIR_CASES) + 2  # + restore_from, load_path
    assert rows >= 30 and len({i for i, _, _ in CONFIGS}) == len(CONFIGS)


# -- checkpoint_dir: a file, under a file, not writable ------------------------------------------
@pytest.fixture
def read_only_dir(tmp_path, tmpfs):
    """A directory this process cannot write: a read-only tmpfs as root (root ignores mode bits),
    mode 0555 otherwise."""
    if os.geteuid() == 0:
        yield tmpfs("ro", "ro,size=64k")
        return
    path = tmp_path / "ro"
    path.mkdir()
    path.chmod(0o555)
    yield path
    path.chmod(0o755)


DIR_CASES = ["is-a-file", "under-a-file", "read-only", "under-a-read-only-dir"]


@pytest.mark.parametrize("case", DIR_CASES)
def test_a_checkpoint_dir_that_cannot_hold_checkpoints_is_refused_before_any_step(tmp_path, request, case):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    if case == "is-a-file":
        ckpt, expected = afile, f"{afile} is a file, not a directory"
    elif case == "under-a-file":
        ckpt, expected = afile / "sub" / "ck", f"{afile}, a parent of it, is a file"
    elif case == "read-only":
        ckpt = request.getfixturevalue("read_only_dir")
        expected = f"cannot write in {ckpt}"
    else:
        ro = request.getfixturevalue("read_only_dir")
        ckpt, expected = ro / "run1" / "ck", f"cannot create directories in {ro}"
    error, ran = attempt({"checkpoint": {"checkpoint_dir": str(ckpt)}})
    assert isinstance(error, ConfigError), repr(error)
    message = str(error)
    assert message.startswith(f"checkpoint.checkpoint_dir={str(ckpt)!r}: ") and expected in message, message
    assert "accepted: a directory" in message
    assert ran == []
    assert afile.read_text() == "not a directory"


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_a_checkpoint_dir_that_is_a_file_fails_every_rank_at_once(tmp_path, capfd):
    afile = tmp_path / "afile"
    afile.write_text("x")
    events = tmp_path / "events"
    cmd = [sys.executable, str(HELPER), str(afile), str(events)]
    with launch(cmd, 2, env={"OMP_NUM_THREADS": "1"}, failure_grace_s=60.0) as group:
        code = group.wait(timeout=60)  # a rank left waiting for its peer would time this out
        codes = [proc.returncode for proc in group.procs]
    captured = capfd.readouterr()
    assert code == 1 and codes == [1, 1], (codes, captured.err[-3000:])
    assert captured.err.count("ConfigError: checkpoint.checkpoint_dir=") == 2, "both ranks raise the same clear error"
    for rank in (0, 1):
        assert (events / f"rank_{rank}.events").read_text().splitlines() == ["start", "exit 1"], "no step, no save"


def test_restore_from_a_missing_checkpoint_is_an_error_naming_it_before_any_step(tmp_path):
    error, ran = attempt({"checkpoint": {"checkpoint_dir": str(tmp_path / "ck"), "restore_from": "epoch_0_step_99"}})
    assert isinstance(error, ConfigError), repr(error)  # at resilient_loop(): exit 2, like every bad setting
    assert "checkpoint.restore_from='epoch_0_step_99'" in str(error) and "no such checkpoint directory" in str(error)
    assert ran == [], "a missing restore_from is never a fresh start"


def test_load_path_without_any_checkpoint_is_an_error_naming_it_before_any_step(tmp_path):
    (tmp_path / "empty").mkdir()
    error, ran = attempt({"checkpoint": {"checkpoint_dir": str(tmp_path / "ck"), "load_path": str(tmp_path / "empty")}})
    assert isinstance(error, CheckpointNotFound), repr(error)
    assert "checkpoint.load_path=" in str(error) and "neither a checkpoint directory nor a root" in str(error)
    assert ran == []


# -- unreadable YAML ---------------------------------------------------------------------------------
YAML_FILES = [
    ("not-utf8", b"\xff\xfe\x00step_scheduler: {}\n", ["not UTF-8 text", "accepted: a UTF-8 YAML file"]),
    ("tab-indented", b"step_scheduler:\n\tnum_epochs: 2\n", ["invalid YAML", "line 2"]),
    ("unclosed-quote", b"checkpoint:\n  checkpoint_dir: 'x\n", ["invalid YAML"]),
    ("duplicate-key", b"step_scheduler:\n  num_epochs: 2\n  num_epochs: 3\n", ["key 'num_epochs' appears twice", "line 2 and line 3"]),
    ("top-level-scalar", b"42\n", ["the top level must be a mapping of sections"]),
    ("missing-file", None, ["cannot read it", "No such file"]),
    ("a-directory", "dir", ["cannot read it"]),
]


@pytest.mark.parametrize("content,expected", [pytest.param(c, e, id=i) for i, c, e in YAML_FILES])
def test_an_unreadable_yaml_file_is_a_config_error_naming_the_file(tmp_path, content, expected):
    path = tmp_path / "train.yaml"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"config file {path}: ")
    for part in expected:
        assert part in message, message


# -- resilience run ------------------------------------------------------------------------------------
RUN_ARGS = [
    ("no-arguments", [], ["the following arguments are required: --nproc-per-node"]),
    ("no-program", ["--nproc-per-node", "1"], ["the following arguments are required: script.py|module|program"]),
    ("nproc-not-a-number", ["--nproc-per-node", "abc", "{marker}"], ["argument --nproc-per-node/--nproc_per_node/-n: invalid int value: 'abc'"]),
    ("nproc-zero", ["--nproc-per-node", "0", "{marker}"], ["nproc_per_node must be an int >= 1, got 0"]),
    (
        "node-rank-too-large",
        ["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "2", "--master-port", "29500", "{marker}"],
        ["node_rank must be in 0..nnodes-1 = 0..1, got 2"],
    ),
    ("negative-failure-grace", ["--nproc-per-node", "1", "--failure-grace", "-1", "{marker}"], ["failure_grace_s must be a number of seconds >= 0"]),
    ("kill-grace-not-a-number", ["--nproc-per-node", "1", "--kill-grace", "soon", "{marker}"], ["argument --kill-grace: invalid float value: 'soon'"]),
    ("port-out-of-range", ["--nproc-per-node", "1", "--master-port", "70000", "{marker}"], ["master_port must be an int in 1..65535, got 70000"]),
    ("two-nodes-without-a-port", ["--nproc-per-node", "1", "--nnodes", "2", "{marker}"], ["master_port is required when nnodes > 1 outside Slurm"]),
    ("module-and-no-python", ["--nproc-per-node", "1", "-m", "--no-python", "{marker}"], ["argument --no-python: not allowed with argument -m/--module"]),
    ("program-does-not-exist", ["--nproc-per-node", "1", "--no-python", "/nonexistent/train"], ["/nonexistent/train", "No such file"]),
]


@pytest.mark.parametrize("argv,expected", [pytest.param(a, e, id=i) for i, a, e in RUN_ARGS])
def test_bad_run_arguments_exit_2_naming_the_option_and_start_no_rank(tmp_path, capsys, monkeypatch, argv, expected):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    marker = tmp_path / "started"
    program = tmp_path / "train.py"
    program.write_text(f"open({str(marker)!r}, 'w').close()\n")
    code = cli.main(["run", *(str(program) if a == "{marker}" else a for a in argv)])
    err = capsys.readouterr().err
    assert code == 2, err
    for part in expected:
        assert part in err, err
    assert not marker.exists(), "no rank may start"


# -- resilience template -------------------------------------------------------------------------------
TEMPLATE_ARGS = [
    ("nodes-zero", ["slurm.nodes=0"], ["slurm.nodes: must be >= 1, got 0"]),
    ("job-name-with-space", ["slurm.job_name=a b"], ["slurm.job_name: 'a b' holds whitespace"]),
    ("time-not-slurm", ["slurm.time=1h"], ["slurm.time: '1h' is not a Slurm time; accepted: MM, MM:SS, HH:MM:SS"]),
    ("unknown-launcher", ["slurm.launcher=mpirun"], ["slurm.launcher: 'mpirun'; accepted: resilience, srun, torchrun"]),
    ("unknown-requeue-mode", ["slurm.requeue=never"], ["slurm.requeue: 'never'; accepted: requeue, resubmit"]),
    ("negative-max-restarts", ["slurm.max_restarts=-1"], ["slurm.max_restarts: must be >= 0"]),
    ("script-args-not-a-list", ["slurm.script_args=notalist"], ["slurm.script_args: expected a list of strings"]),
    ("misspelt-slurm-key", ["slurm.partion=gpu"], ["slurm.partion: unknown key; did you mean 'partition'?"]),
    ("no-preemption-signal", ["step_scheduler.preemption_signal=null"], ["step_scheduler.preemption_signal: null", "set it, e.g. SIGUSR1"]),
    ("signal-slurm-cannot-send", ["step_scheduler.preemption_signal=WINCH"], ["step_scheduler.preemption_signal", "SIGWINCH", "accepted: SIGUSR1"]),
    ("fault-signal-as-stop", ["step_scheduler.preemption_signal=SEGV"], ["step_scheduler.preemption_signal", "SIGSEGV", "not a stop request"]),
    ("line-break-in-sbatch-option", ['slurm.sbatch_extra=["--mem=1G\\nrm -rf x"]'], ["an #SBATCH option may not contain a line break"]),
    ("missing-config-file", ["{missing}"], ["config file", "cannot read it"]),
    ("unknown-kind", ["{kind=pbs}"], ["argument kind: invalid choice: 'pbs'"]),
    ("output-is-a-directory", ["{output-dir}"], ["cannot write", "Is a directory"]),
]


@pytest.mark.parametrize("extra,expected", [pytest.param(a, e, id=i) for i, a, e in TEMPLATE_ARGS])
def test_bad_template_input_exits_2_naming_the_key_and_renders_nothing(tmp_path, capsys, extra, expected):
    config = tmp_path / "train.yaml"
    config.write_text(
        textwrap.dedent("""\
        step_scheduler:
          preemption_signal: USR1
        slurm:
          script: train.py
        """)
    )
    kind, path, options = "slurm", str(config), []
    for item in extra:
        if item == "{missing}":
            path = str(tmp_path / "missing.yaml")
        elif item == "{kind=pbs}":
            kind = "pbs"
        elif item == "{output-dir}":
            options = ["-o", str(tmp_path)]
        else:
            options.append(item)
    code = cli.main(["template", kind, path, *options])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    for part in expected:
        assert part in captured.err, captured.err
    assert "#SBATCH" not in captured.out
