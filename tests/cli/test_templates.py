"""Rendering Slurm batch scripts: golden files, shell syntax, the shipped templates, errors.

No Slurm needed: ``render_slurm`` is a pure function of the configuration, so each render is
compared byte for byte with ``tests/golden/<name>.sub``. After an intended change to the
templates, regenerate with ``UPDATE_GOLDEN=1 pytest tests/cli/test_templates.py`` and review the diff.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from resilience import cli
from resilience.config import ConfigError, config_from_dict, load_config
from resilience.slurm.render import SLURM_SIGNALS, render_slurm

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[1] / "golden"
TEMPLATES = REPO / "templates"

BASE = {
    "step_scheduler": {"preemption_signal": ["SIGUSR1", "SIGTERM"]},
    "checkpoint": {"checkpoint_dir": "/scratch/run1/checkpoints"},
    "slurm": {
        "script": "train.py",
        "script_args": ["--config", "{config}"],
        "python": "/opt/venv/bin/python",
        "job_name": "llm-pretrain",
        "partition": "gpu",
        "nodes": 1,
        "nproc_per_node": 4,
        "cpus_per_task": 8,
        "time": "04:00:00",
        "signal_lead_s": 300,
        "max_restarts": 5,
        "output": "logs/%x-%j.out",
        "sbatch_extra": ["--account=abc123", "--mem=64G"],
        "setup": ["module load cuda/12.4", "source /opt/venv/bin/activate"],
    },
}


def _variant(**slurm) -> dict:
    data = copy.deepcopy(BASE)
    data["slurm"].update(slurm)
    return data


# name -> configuration; each renders to tests/golden/<name>.sub
CASES = {
    "single": _variant(),
    "multinode": _variant(nodes=4, nproc_per_node=8, cpus_per_task=4),
    "array": _variant(output="logs/%x-%A_%a.out", sbatch_extra=["--array=0-9%2"], setup=[]),
    "srun": _variant(launcher="srun", nodes=2),
    "torchrun": _variant(launcher="torchrun"),
    "torchrun-multinode": _variant(launcher="torchrun", nodes=2),
    "resubmit": _variant(requeue="resubmit", partition=None, cpus_per_task=None, sbatch_extra=[]),
}
CONFIG_PATH = "configs/pretrain.yaml"


def _render(name: str) -> str:
    return render_slurm(config_from_dict(CASES[name]), config_path=CONFIG_PATH)


@pytest.mark.parametrize("name", sorted(CASES))
def test_render_equals_golden_file(name: str) -> None:
    """Every launcher / node count / requeue mode renders exactly the reviewed script."""
    text = _render(name)
    path = GOLDEN / f"{name}.sub"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"render of {name!r} differs from {path}; UPDATE_GOLDEN=1 to accept"


DIGITS = REPO / "examples" / "digits"


def _shipped() -> dict[Path, str]:
    """Every shipped .sub -> the render it must equal (paths as the READMEs' commands give them).

    ``templates/`` holds the reference scripts: the defaults, one node and two. The digits example's
    scripts, rendered from its own YAML, live beside it.
    """
    digits = DIGITS / "digits.yaml"
    return {
        TEMPLATES / "slurm.sub": render_slurm(load_config(None), config_path=None),
        TEMPLATES / "slurm-multinode.sub": render_slurm(load_config(None, ["slurm.nodes=2"]), config_path=None),
        DIGITS / "slurm.sub": render_slurm(load_config(digits), config_path="examples/digits/digits.yaml"),
        DIGITS / "slurm-multinode.sub": render_slurm(load_config(digits, ["slurm.nodes=2"]), config_path="examples/digits/digits.yaml"),
    }


def test_shipped_scripts_are_the_current_renders() -> None:
    """templates/slurm*.sub (the defaults) and examples/digits/slurm*.sub never drift from what `resilience template slurm` prints."""
    for path, text in _shipped().items():
        if os.environ.get("UPDATE_GOLDEN") == "1":
            path.write_text(text)
        assert path.read_text() == text, f"{path} is stale: render it again (see templates/README.md)"


def test_the_cli_renders_the_defaults_without_a_yaml(tmp_path: Path, capsys) -> None:
    """`resilience template slurm [slurm.nodes=2]` with no YAML prints templates/slurm*.sub exactly."""
    from resilience import cli

    assert cli.main(["template", "slurm"]) == 0
    assert capsys.readouterr().out == (TEMPLATES / "slurm.sub").read_text()
    assert cli.main(["template", "slurm", "slurm.nodes=2", "-o", str(tmp_path / "m.sub")]) == 0
    assert (tmp_path / "m.sub").read_text() == (TEMPLATES / "slurm-multinode.sub").read_text()
    # Without a YAML, training overrides and script_args still reach the ranks (was: a TypeError).
    assert cli.main(["template", "slurm", "step_scheduler.max_steps=5", "slurm.script_args=[--lr, 1]", "slurm.time=12:00:00"]) == 0
    out = capsys.readouterr().out
    assert "train.py --lr 1 step_scheduler.max_steps=5 " in out and "#SBATCH --time=12:00:00\n" in out


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_every_render_is_valid_bash(tmp_path: Path) -> None:
    """`bash -n` accepts every golden render and both shipped templates."""
    scripts = {f"{name}.sub": _render(name) for name in CASES}
    scripts.update({str(path.relative_to(REPO)).replace("/", "_"): text for path, text in _shipped().items()})
    for name, text in scripts.items():
        path = tmp_path / name
        path.write_text(text)
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{name}: {proc.stderr}"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_every_render_passes_shellcheck_warnings(tmp_path: Path) -> None:
    """No shellcheck warnings or errors (its infos on deliberate word splitting are allowed)."""
    for name in CASES:
        path = tmp_path / f"{name}.sub"
        path.write_text(_render(name))
        proc = subprocess.run(["shellcheck", "-S", "warning", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{name}:\n{proc.stdout}"


def test_signal_line_and_trap_come_from_preemption_signal() -> None:
    """--signal=B:<SIG>@<lead> and the shell's trap both use the first preemption signal."""
    for spec, name in [("SIGUSR2", "USR2"), (["term", "usr1"], "TERM"), (10, "USR1"), ("SIGXCPU", "XCPU")]:
        data = _variant(signal_lead_s=123, **({"launcher": "srun"} if name == "XCPU" else {}))  # our launcher forwards no XCPU
        data["step_scheduler"]["preemption_signal"] = spec
        text = render_slurm(config_from_dict(data), config_path="c.yaml")
        assert f"#SBATCH --signal=B:{name}@123\n" in text
        assert f"\nrs_sig={name}\n" in text
        assert len(re.findall(r"^#SBATCH --signal=", text, re.M)) == 1


def test_sbatch_lines_carry_the_slurm_section() -> None:
    text = _render("single")
    sbatch = re.findall(r"^#SBATCH (.*)$", text, re.M)
    assert sbatch == [
        "--job-name=llm-pretrain",
        "--partition=gpu",
        "--nodes=1",
        "--ntasks-per-node=4",
        "--cpus-per-task=8",
        "--time=04:00:00",
        "--signal=B:USR1@300",
        "--requeue",
        "--open-mode=append",
        "--output=logs/%x-%j.out",
        "--account=abc123",
        "--mem=64G",
    ]
    assert "train.py --config configs/pretrain.yaml" in text  # {config} replaced by the path
    assert "\nrs_max_restarts=5\n" in text
    assert "trap " in text and "CONT" not in re.findall(r"^trap .*$", text, re.M)[0]


def test_trap_is_installed_before_anything_is_launched() -> None:
    """The trap line precedes the setup lines and every launch (srun, python, torchrun)."""
    for name in CASES:
        lines = _render(name).splitlines()
        trap = next(i for i, line in enumerate(lines) if line.startswith("trap "))
        first_run = next(i for i, line in enumerate(lines) if line.startswith(("srun", "/opt/venv/bin/python", "module load", "mkdir")))
        assert trap < first_run, name


@pytest.mark.parametrize(
    "spec, fragment",
    [
        (None, "null"),
        ("SIGSEGV", "SIGSEGV"),
        ("SIGCONT", "SIGCONT"),
        ("SIGPIPE", "SIGPIPE"),
        (["SIGWINCH", "SIGUSR1"], "SIGWINCH"),
    ],
)
def test_unusable_preemption_signal_is_a_config_error_naming_the_key(spec, fragment: str) -> None:
    data = _variant()
    data["step_scheduler"]["preemption_signal"] = spec
    with pytest.raises(ConfigError) as info:
        render_slurm(config_from_dict(data), config_path="c.yaml")
    message = str(info.value)
    assert "step_scheduler.preemption_signal" in message and fragment in message
    if spec is not None:
        assert "SIGUSR1" in message  # lists what is accepted


def test_a_signal_our_launcher_does_not_forward_is_refused_with_it_and_accepted_with_srun() -> None:
    """The batch shell hands the stop signal to resilience run, which forwards USR1/USR2/TERM/INT/HUP/QUIT
    only: SIGALRM would never reach the ranks (the job ran to its end)."""
    data = _variant()
    data["step_scheduler"]["preemption_signal"] = "SIGALRM"
    data.setdefault("slurm", {})["launcher"] = "resilience"
    with pytest.raises(ConfigError, match=r"preemption_signal: SIGALRM with slurm.launcher: resilience.*SIGUSR1"):
        render_slurm(config_from_dict(data), config_path="c.yaml")
    data["slurm"]["launcher"] = "srun"
    assert "--signal=B:ALRM@" in render_slurm(config_from_dict(data), config_path="c.yaml")


def test_every_accepted_name_is_one_sbatch_takes() -> None:
    """The accepted list stays inside Slurm 22.05's --signal names and excludes CONT/KILL/STOP."""
    slurm_names = {"HUP", "INT", "QUIT", "ABRT", "KILL", "ALRM", "TERM", "USR1", "USR2", "URG", "CONT", "STOP", "TSTP", "TTIN", "TTOU", "XCPU"}
    assert set(SLURM_SIGNALS) <= slurm_names
    assert not {"CONT", "KILL", "STOP"} & set(SLURM_SIGNALS)


def test_sbatch_option_with_a_line_break_is_rejected() -> None:
    with pytest.raises(ConfigError, match="line break"):
        render_slurm(config_from_dict(_variant(sbatch_extra=["--mem=1G\nrm -rf /"])), config_path="c.yaml")


def test_cli_prints_the_render_and_passes_training_overrides_to_the_ranks(tmp_path: Path, capsys) -> None:
    """`resilience template slurm CFG k=v`: slurm.* overrides shape the script, the others reach
    every rank's command line, so the training reads the values the script was rendered with."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CASES["single"]))
    code = cli.main(["template", "slurm", str(cfg), "slurm.nodes=2", "step_scheduler.preemption_signal=SIGUSR2", "checkpoint.checkpoint_dir=/tmp/x y"])
    out = capsys.readouterr().out
    assert code == 0
    assert "#SBATCH --nodes=2\n" in out and "#SBATCH --signal=B:USR2@300\n" in out
    assert f"train.py --config {cfg} step_scheduler.preemption_signal=SIGUSR2 'checkpoint.checkpoint_dir=/tmp/x y'" in out
    assert "slurm.nodes" not in out


def test_cli_reports_a_bad_config_with_exit_code_2(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CASES["single"]))
    assert cli.main(["template", "slurm", str(cfg), "step_scheduler.preemption_signal=null"]) == 2
    assert "step_scheduler.preemption_signal" in capsys.readouterr().err
    assert cli.main(["template", "slurm", str(cfg), "slurm.launcher=mpirun"]) == 2
    assert "slurm.launcher" in capsys.readouterr().err


def test_cli_output_file(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CASES["single"]))
    out = tmp_path / "job.sub"
    assert cli.main(["template", "slurm", str(cfg), "-o", str(out)]) == 0
    assert out.read_text() == render_slurm(load_config(cfg), config_path=str(cfg))


def test_cli_accepts_overrides_after_the_output_option(tmp_path: Path, capsys) -> None:
    """`resilience template slurm CFG -o FILE k=v`: positionals may follow options (intermixed)."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CASES["single"]))
    after, before = tmp_path / "after.sub", tmp_path / "before.sub"
    overrides = ["slurm.nodes=2", "step_scheduler.max_steps=7"]
    assert cli.main(["template", "slurm", str(cfg), "-o", str(after), *overrides]) == 0
    assert cli.main(["template", "slurm", "-o", str(before), str(cfg), *overrides]) == 0
    text = after.read_text()
    assert text == before.read_text()
    assert "#SBATCH --nodes=2\n" in text and f"--config {cfg} step_scheduler.max_steps=7" in text
    assert cli.main(["status", str(tmp_path), "--bogus"]) == 2, "other commands still refuse unknown options"
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# The rendered script's behaviour without Slurm: bash runs it with the variables Slurm would set,
# `scontrol` is a stub that records its arguments, and the ranks are a small Python program (no
# torch import, so each test takes seconds) that behaves like resilient_loop() towards signals:
# handler first, then the launcher's ready marker (resilience.stop.handshake), then the stop file.

FAKE_RANK = r"""
import os, signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda *a: got.append(a[0]))
if os.environ.get("RESILIENCE_READY_DIR"):
    open(os.path.join(os.environ["RESILIENCE_READY_DIR"], "rank_%s" % os.environ["RANK"]), "w").close()
stopped_before = os.path.exists(os.environ["RESILIENCE_STOP_FILE"])
if stopped_before and os.environ.get("RESILIENCE_READY_DIR"):  # as resilient_loop(): the launcher drops its held signal
    open(os.path.join(os.environ["RESILIENCE_READY_DIR"], "rank_%s.stop_taken" % os.environ["RANK"]), "w").close()
open(os.path.join(os.environ["FAKE_DIR"], "ready%s" % os.environ["RANK"]), "w").close()
deadline = time.monotonic() + 60
while not (got or stopped_before) and time.monotonic() < deadline:
    time.sleep(0.02)
time.sleep(float(os.environ.get("FAKE_STOP_S", "0")))  # its stop: a save, say
print("fake rank %s: signal=%s stop_file=%s" % (os.environ["RANK"], bool(got), stopped_before), flush=True)
sys.exit(int(os.environ["FAKE_EXIT"]))
"""


def _run_script(
    tmp_path: Path,
    *,
    env: dict,
    max_restarts: int = 3,
    signal_when: str | None = "ready",
    prelaunch_s: str | None = None,
    launcher: str = "resilience",
    program: str = FAKE_RANK,
    **slurm,
):
    """Render for the fake rank (``program``, which creates FAKE_DIR/ready<RANK> once started),
    run it under bash, optionally send USR1; return (rc, log, scontrol calls). ``slurm``: more
    ``slurm:`` keys. The checkpoint directory is tmp_path/ck."""
    import signal as _signal
    import sys
    import time

    assert signal_when in (None, "trap", "ready", "trap+ready"), signal_when
    rank = tmp_path / "rank.py"
    rank.write_text(program)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol-calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    data = _variant(script=str(rank), script_args=[], python=sys.executable, nproc_per_node=2, max_restarts=max_restarts, setup=[], launcher=launcher, **slurm)
    data["checkpoint"]["checkpoint_dir"] = str(tmp_path / "ck")
    script = tmp_path / "job.sub"
    script.write_text(render_slurm(config_from_dict(data), config_path="unused.yaml"))
    log = tmp_path / "log"
    full_env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURMD_NODENAME": "fake",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "FAKE_DIR": str(tmp_path),
        **env,
    }
    if prelaunch_s:
        full_env["RESILIENCE_TEST_PRELAUNCH_SLEEP"] = prelaunch_s
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", str(script)], env=full_env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
        try:
            deadline = time.monotonic() + 60
            if signal_when in ("trap", "trap+ready"):
                while "trap installed" not in log.read_text():
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                proc.send_signal(_signal.SIGUSR1)
            if signal_when in ("ready", "trap+ready"):
                while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
                    assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
                    time.sleep(0.02)
                proc.send_signal(_signal.SIGUSR1)
            rc = proc.wait(timeout=60)
        finally:
            proc.kill()
            proc.wait()
    text = log.read_text()
    pids = [int(line.split()[-1]) for f in (tmp_path / ".resilience").glob("*.pids") for line in f.read_text().splitlines()]
    assert len(pids) == 3 and not any(Path(f"/proc/{pid}").exists() and "State:\tZ" not in Path(f"/proc/{pid}/status").read_text() for pid in pids), text
    return rc, text, (calls.read_text().splitlines() if calls.exists() else [])


@pytest.mark.timeout(90)
def test_script_forwards_the_signal_and_requeues_an_array_task_by_its_array_id(tmp_path: Path) -> None:
    rc, log, calls = _run_script(tmp_path, env={"SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3", "FAKE_EXIT": "75"})
    assert rc == 75, log
    assert calls == ["requeue 77_3"], log
    assert re.search(r"^resilience: SIGUSR1 \(received at [\d.]+\) forwarded to resilience run", log, re.M), log
    assert log.count("signal=True stop_file=False") == 2, log
    assert "resilience: trap installed" in log.splitlines()[0]


@pytest.mark.timeout(90)
def test_script_records_a_signal_before_launch_in_the_stop_file(tmp_path: Path) -> None:
    rc, log, calls = _run_script(tmp_path, env={"FAKE_EXIT": "75"}, signal_when="trap", prelaunch_s="1")
    assert rc == 75, log
    assert calls == ["requeue 4242"], log
    assert "came before the launch" in log
    assert log.count("signal=False stop_file=True") == 2, log  # no rank was signalled: all read the file
    assert not list((tmp_path / ".resilience").glob("*.stop"))


@pytest.mark.timeout(90)
def test_ranks_that_took_the_stop_from_the_stop_file_get_no_signal_from_the_launcher(tmp_path: Path) -> None:
    """A signal before the launch now reaches resilience run once it runs, and a later one (Slurm's
    time-limit warning after a preemption's) reaches it too: a rank that found the stop file when
    it got ready is already stopping, and a signal could land after its loop put the default
    disposition back, killing it (it was sent to every ready rank)."""
    rc, log, calls = _run_script(tmp_path, env={"FAKE_EXIT": "75", "FAKE_STOP_S": "3"}, signal_when="trap+ready", prelaunch_s="1")
    assert rc == 75 and calls == ["requeue 4242"], log
    assert log.count("signal=False stop_file=True") == 2, log
    assert "ranks [0, 1] took the stop from the stop file already: SIGUSR1 not sent to them" in log, log


@pytest.mark.timeout(90)
def test_script_at_the_restart_limit_exits_77_without_requeue(tmp_path: Path) -> None:
    rc, log, calls = _run_script(tmp_path, env={"SLURM_RESTART_COUNT": "2", "FAKE_EXIT": "75"}, max_restarts=2)
    assert rc == 77, log
    assert calls == [], log
    assert "attempt 3 of job 4242 (restart 2, at most 2)" in log


@pytest.mark.timeout(90)
@pytest.mark.parametrize("code", [0, 3, 76])
def test_script_passes_other_exit_codes_through_without_requeue(tmp_path: Path, code: int) -> None:
    rc, log, calls = _run_script(tmp_path, env={"FAKE_EXIT": str(code)})
    assert rc == code, log
    assert calls == [], log


# A program without resilient_loop() (a Hugging Face Trainer script): no ready marker, no stop file
# read; NO_HANDLER never handles USR1, OWN_HANDLER has a handler of its own that exits 75.
# Each would otherwise train FAKE_TRAIN_S to its end and exit 0.
NO_HANDLER = r"""
import os, sys, time
open(os.path.join(os.environ["FAKE_DIR"], "ready%s" % os.environ["RANK"]), "w").close()
time.sleep(float(os.environ["FAKE_TRAIN_S"]))
print("fake rank %s: trained to the end" % os.environ["RANK"], flush=True)
"""
OWN_HANDLER = r"""
import os, signal, sys, time
def stop(*_):
    print("fake rank %s: own handler" % os.environ["RANK"], flush=True)
    os._exit(75)
signal.signal(signal.SIGUSR1, stop)
open(os.path.join(os.environ["FAKE_DIR"], "ready%s" % os.environ["RANK"]), "w").close()
time.sleep(float(os.environ["FAKE_TRAIN_S"]))
print("fake rank %s: trained to the end" % os.environ["RANK"], flush=True)
"""


@pytest.mark.timeout(90)
def test_script_passes_the_signal_to_resilience_run_which_delivers_it_after_the_hold_to_ranks_that_never_handle_it(tmp_path: Path) -> None:
    """Issue 23 item 2: the script waited for every rank to handle USR1 before passing it to the
    launcher, so a program without resilient_loop() never got it, trained to its end and exited 0.
    Now the launcher gets it at once and delivers it after slurm.signal_hold_timeout; the ranks die
    of it, the launcher exits 75 and the script requeues; the delivery is recorded for status."""
    from resilience.launch.held_stops import read_record

    rc, log, calls = _run_script(tmp_path, env={"FAKE_TRAIN_S": "40"}, program=NO_HANDLER, signal_hold_timeout=2)
    assert rc == 75 and calls == ["requeue 4242"], log
    assert re.search(r"^resilience: SIGUSR1 \(received at [\d.]+\) forwarded to resilience run \(pid \d+\)", log, re.M), log
    assert "ranks [0, 1] never became ready" in log and "trained to the end" not in log, log
    record = read_record(tmp_path / "ck")
    assert record is not None and record["ranks"] == [0, 1] and record["signals"] == ["SIGUSR1"] and record["exit_code"] == 75, record
    assert 2 <= record["held_s"] < 10, record


@pytest.mark.timeout(90)
def test_script_passes_a_signal_from_before_the_launch_to_resilience_run_for_a_program_with_its_own_handler(tmp_path: Path) -> None:
    """A signal before the launch used to be left to the stop file, which a program without
    resilient_loop() never reads: it trained to its end. Now it reaches the launcher once that
    runs, and the program's own handler (exit 75) as soon as it is installed."""
    rc, log, calls = _run_script(tmp_path, env={"FAKE_TRAIN_S": "40"}, program=OWN_HANDLER, signal_when="trap", prelaunch_s="1")
    assert rc == 75 and calls == ["requeue 4242"], log
    assert "came before the launch" in log and "resilience run is not running here yet: passed on once it is" in log, log
    assert re.search(r"^resilience: SIGUSR1 \(received at [\d.]+\) forwarded to resilience run \(pid \d+\)", log, re.M), log
    assert log.count("own handler") == 2 and "trained to the end" not in log, log


@pytest.mark.timeout(120)
def test_script_with_torchrun_signals_the_workers_not_the_agent_and_keeps_their_exit_code(tmp_path: Path) -> None:
    """torchrun's agent would die of SIGUSR1 and reports any worker failure as 1: the script
    signals the agent's children and requeues on the ranks' own 75 (recorded by its shim)."""
    rc, log, calls = _run_script(tmp_path, env={"FAKE_EXIT": "75"}, launcher="torchrun")
    assert rc == 75, log
    assert calls == ["requeue 4242"], log
    assert re.search(r"^resilience: SIGUSR1 \(received at [\d.]+\) forwarded to torchrun's workers \d+ \d+", log, re.M), log
    assert log.count("signal=True stop_file=False") == 2, log
    assert "resilience: torchrun exited with 1; every rank exited with 75" in log


def test_a_config_without_a_slurm_section_renders_defaults_with_a_warning(tmp_path: Path, capsys) -> None:
    bare = tmp_path / "train.yaml"
    bare.write_text("step_scheduler:\n  num_epochs: 2\n")
    assert cli.main(["template", "slurm", str(bare)]) == 0
    captured = capsys.readouterr()
    assert "#!/bin/bash" in captured.out
    assert "has no slurm: section" in captured.err and f"script_args: [--config, {bare}]" in captured.err
    with_section = tmp_path / "with.yaml"
    with_section.write_text("slurm:\n  script: train.py\n")
    assert cli.main(["template", "slurm", str(with_section)]) == 0
    err = capsys.readouterr().err
    assert "no slurm: section" not in err
    # ... but its script_args do not pass the YAML: the training would never read it
    assert f"does not pass {with_section} to the training" in err and 'script_args: [--config, "{config}"]' in err
    passing = tmp_path / "passing.yaml"
    passing.write_text('slurm:\n  script: train.py\n  script_args: [--config, "{config}"]\n')
    assert cli.main(["template", "slurm", str(passing)]) == 0
    assert "does not pass" not in capsys.readouterr().err


def test_in_job_restarts_and_the_progress_timeout_reach_resilience_run() -> None:
    text = render_slurm(config_from_dict(_variant(in_job_restarts=2, progress_timeout=900)), config_path=CONFIG_PATH)
    assert "-m resilience run --nproc-per-node 4 --max-restarts 2 --progress-timeout 900 --master-port" in text
    multi = render_slurm(config_from_dict(_variant(nodes=2, progress_timeout=120.5)), config_path=CONFIG_PATH)
    assert "--nproc-per-node 4 --progress-timeout 120.5 --master-addr" in multi
    # several nodes: every node's launcher shares the attempt's fault file, and restarts through it
    assert '--fault-file "$prefix.faults"' in multi and '"$rs_prefix".faults' in multi
    restarting = render_slurm(config_from_dict(_variant(nodes=2, in_job_restarts=1)), config_path=CONFIG_PATH)
    assert "--nproc-per-node 4 --max-restarts 1 --master-addr" in restarting
    assert "--max-restarts" not in _render("single") and "--progress-timeout" not in _render("multinode")  # defaults: as before
    held = render_slurm(config_from_dict(_variant(nodes=2, signal_hold_timeout=30)), config_path=CONFIG_PATH)
    assert "--nproc-per-node 4 --signal-hold-timeout 30 --master-addr" in held
    assert "--signal-hold-timeout inf --master-port" in render_slurm(config_from_dict(_variant(signal_hold_timeout="inf")), config_path=CONFIG_PATH)
    assert not re.search(r"--signal-hold-timeout (\d|inf)", _render("single"))  # null: the launcher's 60 s
    # the status record goes to the YAML's checkpoint directory, also through srun's quoting
    spaced = render_slurm(config_from_dict({**_variant(nodes=2), "checkpoint": {"checkpoint_dir": "/x/my ck"}}), config_path=CONFIG_PATH)
    assert """--checkpoint-dir "$ckpt" "$@"' \\\n    "$rs_prefix" /opt/venv/bin/python '/x/my ck' train.py""" in spaced
    assert "--checkpoint-dir /scratch/run1/checkpoints train.py" in _render("single")


@pytest.mark.parametrize(
    "slurm, fragment",
    [
        ({"in_job_restarts": -1}, "slurm.in_job_restarts"),
        ({"progress_timeout": "soon"}, "slurm.progress_timeout: expected 'auto' or a number of seconds > 0"),
        ({"progress_timeout": 0}, "slurm.progress_timeout"),
        ({"in_job_restarts": 1, "launcher": "srun"}, "need slurm.launcher: resilience"),
        ({"signal_hold_timeout": -1}, "slurm.signal_hold_timeout: expected a number of seconds >= 0, inf or null"),
        ({"signal_hold_timeout": "soon"}, "slurm.signal_hold_timeout: expected"),
        ({"signal_hold_timeout": 300}, "slurm.signal_hold_timeout: 300 s is not shorter than slurm.signal_lead_s (300 s)"),
        ({"signal_hold_timeout": 5, "launcher": "torchrun"}, "slurm.signal_hold_timeout needs slurm.launcher: resilience"),
    ],
)
def test_a_watchdog_setting_resilience_run_cannot_take_is_a_config_error(slurm: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        config_from_dict(_variant(**slurm))


def test_cli_warns_when_the_training_script_does_not_exist_here(tmp_path: Path, capsys, monkeypatch) -> None:
    """Found by a newcomer: a mistyped slurm.script rendered silently and failed only in the job."""
    monkeypatch.chdir(tmp_path)
    yaml_path = tmp_path / "train.yaml"
    yaml_path.write_text('slurm:\n  script: nope.py\n  script_args: [--config, "{config}"]\n')
    assert cli.main(["template", "slurm", str(yaml_path)]) == 0
    assert "slurm.script nope.py does not exist here" in capsys.readouterr().err
    (tmp_path / "nope.py").write_text("")
    assert cli.main(["template", "slurm", str(yaml_path)]) == 0
    assert "does not exist" not in capsys.readouterr().err
