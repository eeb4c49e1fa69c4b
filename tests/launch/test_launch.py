"""`resilience run` / `resilience.launch`: real ranks, real signals, real pid files."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path

import pytest

from resilience.cli import main as cli_main
from resilience.launch import combine_exit_codes, launch, slurm_master_port

PY = sys.executable

ENV_WORKER = """
import json, os, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
        "MASTER_PORT", "RESILIENCE_LAUNCHER_PID", "EXTRA"]
seen = {key: os.environ.get(key) for key in keys}
seen["argv"] = sys.argv[2:]
with open(os.path.join(sys.argv[1], "env%s.json" % os.environ["LOCAL_RANK"]), "w") as f:
    json.dump(seen, f)
"""

# Records USR1 in its handler (and nothing else), says when the handler is installed, then:
# "exit75": exits 75 once USR1 arrived; "wait-go": keeps running until the file `go` exists.
USR1_WORKER = """
import os, signal, sys, time
out, mode, rank = sys.argv[1], sys.argv[2], os.environ["RANK"]
got = []
time.sleep(float(os.environ.get("DELAY_HANDLER_S", "0")))  # start slowly, like torch imports
signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
# the handshake (resilience.stop.handshake): handler installed -> mark ready -> read the stop file
open(os.path.join(os.environ["RESILIENCE_READY_DIR"], "rank_" + rank), "w").close()
if os.path.exists(os.environ["RESILIENCE_STOP_FILE"]):
    open(os.path.join(out, "stopfile%s" % rank), "w").close()
with open(os.path.join(out, "ready%s" % rank), "w") as f:
    f.write(str(os.getpid()))
deadline = time.monotonic() + 30
while not got and time.monotonic() < deadline:
    time.sleep(0.01)
if not got:
    sys.exit(3)
with open(os.path.join(out, "got%s" % rank), "w") as f:
    f.write(str(got))
if mode == "exit75":
    sys.exit(75)
while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(0)
"""

# No handlers of its own (or SIGTERM ignored with "ignore-term"): says it is up, then sleeps.
SLEEP_WORKER = """
import os, signal, sys, time
if sys.argv[2:] == ["ignore-term"]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(os.environ["RESILIENCE_READY_DIR"], "rank_" + os.environ["RANK"]), "w").close()
with open(os.path.join(sys.argv[1], "ready%s" % os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
time.sleep(60)
sys.exit(5)
"""

# Rank 1 crashes (exit 1) once rank 0 is up; rank 0 hangs (optionally ignoring SIGTERM).
CRASH_HANG_WORKER = """
import os, signal, sys, time
out, ignore_term = sys.argv[1], sys.argv[2] == "ignore-term"
if os.environ["RANK"] == "0":
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(os.path.join(out, "ready0"), "w").close()
    time.sleep(60)
    sys.exit(0)
deadline = time.monotonic() + 20
while not os.path.exists(os.path.join(out, "ready0")) and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(1)
"""

CODES_WORKER = """
import os, sys
sys.exit(int(sys.argv[1 + int(os.environ["RANK"])]))
"""

GLOO_WORKER = """
import sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
ok = value.item() == 3.0 and dist.get_world_size() == 2
dist.destroy_process_group()
sys.exit(0 if ok else 4)
"""


def write_worker(tmp_path: Path, source: str, name: str = "worker.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def wait_for(paths: list[Path], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        if time.monotonic() > deadline:
            missing = [str(path) for path in paths if not path.exists()]
            pytest.fail(f"timed out waiting for {missing}")
        time.sleep(0.02)


def is_alive(pid: int) -> bool:
    """True for a running process; a zombie (exited, not reaped) counts as dead."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "\nState:\tZ" not in status


def read_pid_file(path: Path) -> dict[str, int]:
    pids = {}
    for line in path.read_text().splitlines():
        *name, pid = line.split()
        pids[" ".join(name)] = int(pid)
    return pids


@pytest.fixture
def cli(tmp_path):
    """Start `python -m resilience run ...` in its own session (no terminal, own group)."""
    started: list[subprocess.Popen] = []

    def start(*args: str, env: dict | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(
            [PY, "-m", "resilience", "run", *args],
            cwd=tmp_path,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:  # a failed test must not leave its launcher or ranks behind
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def finish(proc: subprocess.Popen, timeout: float = 20.0) -> tuple[int, str]:
    _, stderr = proc.communicate(timeout=timeout)
    return proc.returncode, stderr


@pytest.mark.parametrize(
    "codes, expected",
    [
        ([0], 0),
        ([0, 0], 0),
        ([75, 75], 75),
        ([76, 76, 76], 76),
        ([2, 2], 2),
        ([1, 1], 1),
        ([-15, -15], 143),  # all killed by SIGTERM: the shell's 128 + N
        ([-9], 137),
        ([0, 1], 1),
        ([75, 0], 1),  # a partial preemption is a failure, never a requeue
        ([75, -9], 1),
        ([-15, -9], 1),
        ([0, 0, 3], 1),
    ],
)
def test_combine_exit_codes_table(codes, expected):
    assert combine_exit_codes(codes) == expected


def test_combine_exit_codes_rejects_an_empty_group():
    with pytest.raises(ValueError, match="one exit code per rank"):
        combine_exit_codes([])


def test_slurm_master_port_is_stable_in_range_and_moves_on_restart():
    assert slurm_master_port("1234") == slurm_master_port(1234, None) == 32340
    assert slurm_master_port("1234", "2") == 32342
    assert slurm_master_port("1234", "1") != slurm_master_port("1234", "2")
    assert slurm_master_port("1234") != slurm_master_port("1235")
    ports = {slurm_master_port(job, n) for job in range(0, 10**7, 997) for n in range(12)}
    assert min(ports) >= 20000 and max(ports) < 60000
    with pytest.raises(ValueError, match="SLURM_JOB_ID"):
        slurm_master_port("12_3")
    with pytest.raises(ValueError, match="SLURM_RESTART_COUNT"):
        slurm_master_port("12", "-1")


def test_launch_rejects_bad_arguments_by_name():
    with pytest.raises(ValueError, match="nproc_per_node"):
        launch([PY, "-c", "pass"], 0)
    with pytest.raises(ValueError, match="node_rank"):
        launch([PY, "-c", "pass"], 1, node_rank=2, nnodes=2, master_port=29500)
    with pytest.raises(ValueError, match="master_port is required"):
        launch([PY, "-c", "pass"], 1, nnodes=2, env={"SLURM_JOB_ID": ""})
    with pytest.raises(ValueError, match="cmd"):
        launch("python train.py", 1)  # type: ignore[arg-type]


@pytest.mark.multiproc
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "kwargs, ranks, world, group_rank, addr, port",
    [
        ({"env": {"SLURM_JOB_ID": ""}}, [0, 1], 2, 0, "127.0.0.1", None),
        (
            {"node_rank": 1, "nnodes": 2, "master_addr": "127.0.0.2", "master_port": 29555, "env": {"EXTRA": "x"}},
            [2, 3],
            4,
            1,
            "127.0.0.2",
            29555,
        ),
        ({"env": {"SLURM_JOB_ID": "1234", "SLURM_RESTART_COUNT": "2"}}, [0, 1], 2, 0, "127.0.0.1", 32342),
    ],
    ids=["single-node-free-port", "second-node", "slurm-derived-port"],
)
def test_each_rank_sees_its_rank_world_and_rendezvous_env(tmp_path, kwargs, ranks, world, group_rank, addr, port):
    worker = write_worker(tmp_path, ENV_WORKER)
    with launch([PY, worker, str(tmp_path), "a", "--b"], 2, **kwargs) as group:
        assert group.wait(timeout=20) == 0
    seen = [json.loads((tmp_path / f"env{local}.json").read_text()) for local in (0, 1)]
    assert [int(s["RANK"]) for s in seen] == ranks
    assert [int(s["LOCAL_RANK"]) for s in seen] == [0, 1]
    for s in seen:
        assert int(s["WORLD_SIZE"]) == world
        assert int(s["LOCAL_WORLD_SIZE"]) == 2
        assert int(s["GROUP_RANK"]) == group_rank
        assert s["MASTER_ADDR"] == addr
        assert int(s["RESILIENCE_LAUNCHER_PID"]) == os.getpid()
        assert s["argv"] == ["a", "--b"]
    assert seen[0]["MASTER_PORT"] == seen[1]["MASTER_PORT"]
    if port is None:
        assert 1 <= int(seen[0]["MASTER_PORT"]) <= 65535
    else:
        assert int(seen[0]["MASTER_PORT"]) == port
    assert seen[0]["EXTRA"] == kwargs.get("env", {}).get("EXTRA")


@pytest.mark.multiproc
@pytest.mark.timeout(30)
def test_leaving_the_rank_group_kills_and_reaps_every_rank(tmp_path):
    worker = write_worker(tmp_path, SLEEP_WORKER)
    with pytest.raises(RuntimeError, match="boom"):
        with launch([PY, worker, str(tmp_path), "ignore-term"], 2, kill_grace_s=0.5) as group:
            wait_for([tmp_path / "ready0", tmp_path / "ready1"])
            with pytest.raises(subprocess.TimeoutExpired):
                group.wait(timeout=0.2)  # a timeout leaves the ranks running
            assert group.live_ranks() == [0, 1]
            raise RuntimeError("boom")
    assert [proc.returncode for proc in group.procs] == [-signal.SIGKILL] * 2
    assert not any(is_alive(pid) for pid in group.pids)


@pytest.mark.multiproc
@pytest.mark.timeout(30)
def test_failure_grace_ends_the_ranks_left_after_one_is_killed(tmp_path):
    worker = write_worker(tmp_path, SLEEP_WORKER)
    events: list[str] = []
    with launch([PY, worker, str(tmp_path)], 2, failure_grace_s=0.3, log=events.append) as group:
        wait_for([tmp_path / "ready0", tmp_path / "ready1"])
        assert group.send_signal(signal.SIGKILL, ranks=[1]) == [1]
        started = time.monotonic()
        assert group.wait(timeout=10) == 1
        assert time.monotonic() - started < 5
    assert [proc.returncode for proc in group.procs] == [-signal.SIGTERM, -signal.SIGKILL]
    assert any("failure grace" in event for event in events)


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_two_rank_gloo_all_reduce_exits_zero(tmp_path, cli):
    worker = write_worker(tmp_path, GLOO_WORKER)
    rc, stderr = finish(cli("--nproc-per-node", "2", worker, env={"SLURM_JOB_ID": ""}), 50)
    assert rc == 0, stderr


@pytest.mark.multiproc
@pytest.mark.timeout(30)
def test_module_mode_runs_the_module_and_passes_launcher_like_args_through(tmp_path, cli):
    write_worker(tmp_path, ENV_WORKER, name="rankmod.py")
    rc, stderr = finish(cli("--nproc-per-node", "2", "-m", "rankmod", str(tmp_path), "--nproc-per-node", "7"))
    assert rc == 0, stderr
    for local in (0, 1):
        seen = json.loads((tmp_path / f"env{local}.json").read_text())
        assert seen["argv"] == ["--nproc-per-node", "7"]
        assert seen["WORLD_SIZE"] == "2"


@pytest.mark.multiproc
@pytest.mark.timeout(30)
def test_usr1_to_the_launcher_reaches_every_rank_and_their_code_is_the_exit_code(tmp_path, cli):
    worker = write_worker(tmp_path, USR1_WORKER)
    pid_file = tmp_path / "pids"
    launcher = cli("--nproc-per-node", "2", worker, str(tmp_path), "exit75", env={"RESILIENCE_PID_FILE": str(pid_file)})
    wait_for([tmp_path / "ready0", tmp_path / "ready1", pid_file])
    os.kill(launcher.pid, signal.SIGUSR1)
    rc, stderr = finish(launcher)
    assert rc == 75, stderr  # the ranks' PREEMPTED, not 138 (launcher killed by USR1)
    assert (tmp_path / "got0").exists() and (tmp_path / "got1").exists()
    assert "forwarded SIGUSR1 to ranks [0, 1]" in stderr
    pids = read_pid_file(pid_file)
    assert pids["launcher"] == launcher.pid
    assert [pids["rank 0"], pids["rank 1"]] == [int((tmp_path / f"ready{rank}").read_text()) for rank in (0, 1)]
    assert not any(is_alive(pid) for pid in pids.values())


@pytest.mark.multiproc
@pytest.mark.timeout(30)
def test_usr1_before_the_ranks_installed_handlers_is_held_not_fatal(tmp_path, cli):
    """A signal that arrives while ranks still import torch must not kill them (rc 138): the
    launcher records the stop, holds the signal until each rank marks itself ready."""
    worker = write_worker(tmp_path, USR1_WORKER)
    pid_file = tmp_path / "pids"
    launcher = cli("--nproc-per-node", "2", worker, str(tmp_path), "exit75", env={"RESILIENCE_PID_FILE": str(pid_file), "DELAY_HANDLER_S": "1.5"})
    wait_for([pid_file])
    os.kill(launcher.pid, signal.SIGUSR1)
    rc, stderr = finish(launcher)
    assert rc == 75, stderr
    assert "are not ready yet" in stderr
    # each rank found the recorded stop when it got ready, and got the held signal too
    assert (tmp_path / "stopfile0").exists() and (tmp_path / "stopfile1").exists()
    assert (tmp_path / "got0").exists() and (tmp_path / "got1").exists()


@pytest.mark.multiproc
@pytest.mark.timeout(30)
def test_a_stop_signal_to_the_whole_group_before_the_ranks_are_ready_exits_75_not_143(tmp_path, cli):
    """Slurm (and ``kill -- -PGID``) signals every process of the step: ranks still importing torch die
    of it before their handlers exist. Nothing was trained since LATEST: a stop before the first step
    (75, requeue), not a failure (143, which the templates never requeue)."""
    worker = write_worker(tmp_path, USR1_WORKER)
    pid_file = tmp_path / "pids"
    launcher = cli("--nproc-per-node", "2", worker, str(tmp_path), "exit75", env={"RESILIENCE_PID_FILE": str(pid_file), "DELAY_HANDLER_S": "5"})
    wait_for([pid_file])
    os.killpg(launcher.pid, signal.SIGUSR1)
    rc, stderr = finish(launcher)
    assert rc == 75, stderr
    assert "died of SIGUSR1 before installing their handlers" in stderr and "stopped before the first step" in stderr
    assert not (tmp_path / "ready0").exists() and not (tmp_path / "ready1").exists()


@pytest.mark.multiproc
@pytest.mark.timeout(30)
def test_launcher_survives_usr1_and_waits_for_its_ranks(tmp_path, cli):
    worker = write_worker(tmp_path, USR1_WORKER)
    launcher = cli("--nproc-per-node", "2", worker, str(tmp_path), "wait-go")
    wait_for([tmp_path / "ready0", tmp_path / "ready1"])
    os.kill(launcher.pid, signal.SIGUSR1)
    wait_for([tmp_path / "got0", tmp_path / "got1"])
    time.sleep(0.3)
    assert launcher.poll() is None, "the launcher must outlive USR1 while its ranks run"
    (tmp_path / "go").touch()
    rc, stderr = finish(launcher)
    assert rc == 0, stderr


@pytest.mark.multiproc
@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR2, signal.SIGHUP], ids=lambda s: s.name)
def test_other_signals_are_forwarded_and_death_by_signal_exits_128_plus_n(tmp_path, cli, sig):
    worker = write_worker(tmp_path, SLEEP_WORKER)
    launcher = cli("--nproc-per-node", "2", worker, str(tmp_path))
    wait_for([tmp_path / "ready0", tmp_path / "ready1"])
    os.kill(launcher.pid, sig)
    rc, stderr = finish(launcher)
    assert rc == 128 + sig, stderr
    assert f"forwarded {sig.name} to ranks [0, 1]" in stderr


@pytest.mark.multiproc
@pytest.mark.timeout(30)
def test_ctrl_c_at_a_terminal_reaches_each_rank_once_not_forwarded_again(tmp_path):
    """The terminal signals the whole foreground group; a second SIGINT could interrupt cleanup."""
    worker = write_worker(tmp_path, SLEEP_WORKER)
    master, slave = os.openpty()

    def take_terminal() -> None:  # in the child, after setsid: make the pty our terminal
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    try:
        launcher = subprocess.Popen(
            [PY, "-m", "resilience", "run", "--nproc-per-node", "2", worker, str(tmp_path)],
            stdin=slave,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=take_terminal,
        )
        try:
            wait_for([tmp_path / "ready0", tmp_path / "ready1"])
            os.write(master, b"\x03")  # Ctrl-C
            rc, stderr = finish(launcher)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.communicate()
    finally:
        os.close(master)
        os.close(slave)
    assert rc == 128 + signal.SIGINT, stderr
    assert "SIGINT from the terminal already reached the ranks; not forwarded" in stderr


@pytest.mark.multiproc
@pytest.mark.timeout(30)
@pytest.mark.parametrize("codes", [[0, 3], [75, 0], [75, 75]])
def test_the_group_code_is_the_ranks_code_only_when_they_agree(tmp_path, codes):
    worker = write_worker(tmp_path, CODES_WORKER)
    with launch([PY, worker, *map(str, codes)], 2, env={"SLURM_JOB_ID": ""}) as group:
        code = group.wait(timeout=20)
    assert [proc.returncode for proc in group.procs] == codes
    assert code == (codes[0] if codes[0] == codes[1] else 1)


@pytest.mark.multiproc
@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["dies-on-term", "ignore-term"])
def test_crash_with_a_hung_rank_kills_it_after_failure_grace_and_exits_1(tmp_path, cli, mode):
    worker = write_worker(tmp_path, CRASH_HANG_WORKER)
    pid_file = tmp_path / "pids"
    started = time.monotonic()
    launcher = cli("--nproc-per-node", "2", "--failure-grace", "0.5", "--kill-grace", "0.5", "--pid-file", str(pid_file), worker, str(tmp_path), mode)
    rc, stderr = finish(launcher)
    elapsed = time.monotonic() - started
    assert rc == 1, stderr
    assert elapsed < 10, f"the hung rank (sleeping 60 s) was not stopped: {elapsed:.1f} s"
    assert "failure grace of 0.5 s expired; sent SIGTERM to ranks [0]" in stderr
    assert ("SIGKILL" in stderr) == (mode == "ignore-term"), stderr
    pids = read_pid_file(pid_file)
    assert set(pids) == {"launcher", "rank 0", "rank 1"}
    assert not any(is_alive(pid) for pid in pids.values())


@pytest.mark.multiproc
@pytest.mark.timeout(30)
def test_cli_main_returns_the_code_and_restores_signal_dispositions(tmp_path):
    worker = write_worker(tmp_path, CODES_WORKER)
    watched = [signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP]
    before = {sig: signal.getsignal(sig) for sig in watched}
    assert cli_main(["run", "--nproc-per-node", "2", worker, "77", "77"]) == 77
    assert {sig: signal.getsignal(sig) for sig in watched} == before
    previous_wakeup_fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(previous_wakeup_fd)
    assert previous_wakeup_fd == -1  # the launcher's wakeup socket is gone
    assert cli_main(["run", "--nproc-per-node", "2"]) == 2  # usage error, no exception
    assert cli_main(["--help"]) == 0


@pytest.mark.multiproc
@pytest.mark.timeout(30)
def test_a_program_that_cannot_start_is_a_config_error(tmp_path, cli):
    rc, stderr = finish(cli("--nproc-per-node", "2", "--no-python", str(tmp_path / "missing")))
    assert rc == 2
    assert "No such file" in stderr


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_a_stop_signal_the_ranks_do_not_handle_is_sent_as_one_they_do(tmp_path, cli):
    """Slurm sends USR1 but the run's preemption_signal is TERM only: the launcher must not kill
    the ranks with USR1; it sends TERM, which they handle, and they stop cleanly (75)."""
    tiny = Path(__file__).resolve().parents[1] / "helpers" / "tiny_train.py"
    ckpt = tmp_path / "ck"
    launcher = cli(
        "--nproc-per-node",
        "2",
        str(tiny),
        str(ckpt),
        "step_scheduler.num_epochs=10",
        "step_scheduler.preemption_signal=TERM",
        env={"SLEEP_PER_STEP_S": "0.02", "OMP_NUM_THREADS": "1"},
    )
    log = ckpt / "training.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 10):
        time.sleep(0.05)
    os.kill(launcher.pid, signal.SIGUSR1)
    rc, stderr = finish(launcher, timeout=60)
    assert rc == 75, stderr[-3000:]
    assert "does not handle SIGUSR1" in stderr and "sending SIGTERM, which it does" in stderr


def test_dash_n_is_short_for_nproc_per_node() -> None:
    import argparse

    from resilience.cli.run import add_arguments

    args = add_arguments(argparse.ArgumentParser()).parse_args(["-n", "3", "train.py"])
    assert args.nproc_per_node == 3


# -- temp directories ---------------------------------------------------------------------------


def _ready_dirs(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("resilience-ranks-*"))


@pytest.mark.timeout(60)
def test_a_sigkilled_launchers_temp_dir_is_removed_by_the_next_start(tmp_path, cli):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    worker = write_worker(tmp_path, SLEEP_WORKER)
    first = cli("-n", "1", "--pid-file", str(tmp_path / "pids"), worker, str(tmp_path), env={"TMPDIR": str(tmp)})
    wait_for([tmp_path / "ready0", tmp_path / "pids"])
    rank = read_pid_file(tmp_path / "pids")["rank 0"]
    (stale,) = _ready_dirs(tmp)
    os.kill(first.pid, signal.SIGKILL)  # the launcher only: nothing can clean up after it
    first.wait()
    os.kill(rank, signal.SIGKILL)
    assert stale.exists()
    # A directory whose recorded launcher pid now runs another program (reused pid) goes too,
    # one whose launcher runs stays, and one without a record (being created) is left alone.
    reused = tmp / "resilience-ranks-reused"
    reused.mkdir()
    (reused / "launcher").write_text(f"{os.getpid()} 12345.0\n")
    import psutil

    live = tmp / "resilience-ranks-live"
    live.mkdir()
    (live / "launcher").write_text(f"{os.getpid()} {psutil.Process().create_time()!r}\n")
    unknown = tmp / "resilience-ranks-unknown"
    unknown.mkdir()

    second = cli("-n", "1", write_worker(tmp_path, CODES_WORKER, name="codes.py"), "0", env={"TMPDIR": str(tmp)})
    assert second.wait(timeout=30) == 0, second.stderr.read()
    assert _ready_dirs(tmp) == [live, unknown]


@pytest.mark.timeout(60)
def test_ranks_that_crash_leave_no_temp_dir(tmp_path, cli):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    worker = write_worker(
        tmp_path,
        """
        import os, signal, sys
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(1)
    """,
    )
    proc = cli("-n", "2", worker, env={"TMPDIR": str(tmp)})
    assert proc.wait(timeout=30) == 1, proc.stderr.read()
    assert _ready_dirs(tmp) == []


# -- a stop signal for ranks that never get ready; what the operator is told ------------------

# A Trainer-like program: two gloo ranks that train for 30 s without resilient_loop() and without
# a handler of their own, so they never become ready for a stop signal. With HANDLER_EXIT, rank 0
# has a SIGTERM handler of its own that exits with it, and no collectives run (a rank leaving
# mid-all_reduce would fail its peer).
NO_LOOP_WORKER = """
import os, signal, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
out, rank = sys.argv[1], dist.get_rank()
handler_exit = os.environ.get("HANDLER_EXIT")
if handler_exit is not None and rank == 0:
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(int(handler_exit)))
open(os.path.join(out, "up%d" % rank), "w").close()
ends = time.monotonic() + 30
while time.monotonic() < ends:
    if handler_exit is None:
        dist.all_reduce(torch.ones(1))
    time.sleep(0.05)
open(os.path.join(out, "done%d" % rank), "w").close()
dist.destroy_process_group()
"""
TINY = Path(__file__).resolve().parents[1] / "helpers" / "tiny_train.py"


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_a_stop_signal_held_for_ranks_that_never_get_ready_is_delivered_after_the_hold_and_status_shows_it(tmp_path, cli, capsys):
    """USR1 for ranks of a program without resilient_loop() was held forever: they trained to their end,
    exited 0, and the preemption had no effect. After --signal-hold-timeout it is delivered (the default
    action ends them), a warning names the ranks, and `resilience status` shows what happened."""
    import argparse

    from resilience.cli.run import add_arguments
    from resilience.launch.held_stops import DEFAULT_HOLD_TIMEOUT_S

    assert add_arguments(argparse.ArgumentParser()).parse_args(["-n", "1", "x.py"]).signal_hold_timeout == DEFAULT_HOLD_TIMEOUT_S < 300
    ck = tmp_path / "ck"
    worker = write_worker(tmp_path, NO_LOOP_WORKER)
    launcher = cli("-n", "2", "--signal-hold-timeout", "1", "--checkpoint-dir", str(ck), worker, str(tmp_path), env={"OMP_NUM_THREADS": "1"})
    wait_for([tmp_path / "up0", tmp_path / "up1"], timeout=40)
    os.kill(launcher.pid, signal.SIGUSR1)
    signalled = time.monotonic()
    rc, stderr = finish(launcher)
    assert time.monotonic() - signalled < 15, stderr
    assert rc == 75, stderr
    assert "SIGUSR1: ranks [0, 1] are not ready yet" in stderr
    assert "warning: ranks [0, 1] never became ready" in stderr and "(--signal-hold-timeout): delivering it now" in stderr, stderr
    assert not list(tmp_path.glob("done*")), "the ranks trained on to their end: the stop had no effect"

    assert cli_main(["status", str(ck), "--json"]) == 0
    held = json.loads(capsys.readouterr().out)["held_stop"]
    assert held["signals"] == ["SIGUSR1"] and held["ranks"] == [0, 1] and held["exit_codes"] == [-10, -10] and held["exit_code"] == 75
    assert 1 <= held["held_s"] < 10
    assert cli_main(["status", str(ck)]) == 0
    assert "Stop signal held by resilience run: SIGUSR1 held" in capsys.readouterr().out


@pytest.mark.multiproc
@pytest.mark.timeout(60)
@pytest.mark.parametrize("handler_exit", [75, 0])
def test_a_rank_stopping_in_its_own_handler_while_the_other_dies_of_the_signal_after_the_hold_is_a_preemption(tmp_path, cli, handler_exit):
    """TERM to the launcher: rank 0 (its own handler) gets it at once and exits 75 or 0, rank 1 (no
    handler) gets it after the hold and dies of it. [75, -15] and [0, -15] were a failure (exit 1, no
    requeue) although docs/stopping.md promises exit 75 then."""
    worker = write_worker(tmp_path, NO_LOOP_WORKER)
    env = {"OMP_NUM_THREADS": "1", "HANDLER_EXIT": str(handler_exit)}
    launcher = cli("-n", "2", "--signal-hold-timeout", "1", worker, str(tmp_path), env=env)
    wait_for([tmp_path / "up0", tmp_path / "up1"], timeout=40)
    os.kill(launcher.pid, signal.SIGTERM)
    rc, stderr = finish(launcher)
    assert "warning: ranks [1] never became ready" in stderr, stderr
    assert f"exited with [{handler_exit}, -15]" in stderr and rc == 75, stderr


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_the_summary_names_the_rank_that_failed_first_and_why_when_the_launcher_sees_every_exit_at_once(tmp_path, cli):
    """Rank 1 raises (as on running out of memory); rank 0 fails in its collective because rank 1 left.
    A launcher that sees both exits in one look (a loaded node: here it is stopped meanwhile) blamed
    rank 0, the first of equal codes; the ranks' failure notes say which failed first, and why."""
    pids = tmp_path / "pids"
    env = {"RAISE_AT_STEP": "8", "RAISE_RANK": "1", "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": ""}
    launcher = cli("-n", "2", "--pid-file", str(pids), str(TINY), str(tmp_path / "ck"), env=env)
    wait_for([pids])
    os.kill(launcher.pid, signal.SIGSTOP)
    try:
        ranks = [pid for name, pid in read_pid_file(pids).items() if name.startswith("rank")]
        deadline = time.monotonic() + 60
        while any(is_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.kill(launcher.pid, signal.SIGCONT)
    rc, stderr = finish(launcher, timeout=30)
    assert rc == 1, stderr
    summary = "rank 1 exited with code 1 (RuntimeError: injected exception in step 8 on rank 1); ranks exited with [1, 1]; exit code 1"
    assert summary in stderr, stderr


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_a_stall_message_and_the_stack_headers_name_the_step_each_rank_last_finished(tmp_path, cli):
    """Steps of a few ms are reported every 0.5 s: the message said "last reported step: 20" while the
    ranks were in step 30. Rank 1 hangs in step 30, rank 0 waits for it in step 31: the watchdog's
    line and each rank's stack header name exactly those steps (each rank's step field)."""
    env = {"FAULTS": "hang@30", "FAULT_RANK": "1", "FAULT_DIR": str(tmp_path), "SLEEP_PER_STEP_S": "0.02", "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": ""}
    launcher = cli("-n", "2", "--progress-timeout", "4", "--kill-grace", "1", str(TINY), str(tmp_path / "ck"), env=env)
    rc, stderr = finish(launcher, timeout=80)
    assert rc == 75, stderr
    in_step = {0: 31, 1: 30}
    stall = re.search(r"watchdog: rank (\d) \(pid \d+\) made no progress for [\d.]+ s in step (\d+) \(step (\d+) was its last finished\)", stderr)
    assert stall is not None, stderr
    rank = int(stall.group(1))  # the one silent longest: either may be
    assert (int(stall.group(2)), int(stall.group(3))) == (in_step[rank], in_step[rank] - 1), stderr
    for rank, step in in_step.items():
        header = rf"rank {rank} \(pid \d+; in step {step} \(step {step - 1} was its last finished\), last report [\d.]+ s ago\): its Python stacks follow"
        assert re.search(header, stderr), stderr


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_status_and_the_stop_message_tell_a_start_that_saved_from_one_preempted_before_saving(tmp_path, cli, capsys):
    """A start that saved steps 5 and 10 and was then preempted was shown as "preempted cleanly before
    saving anything new"; a stop before the first step after a resume said "checkpoint published"."""
    ck = tmp_path / "ck"
    env = {"SLEEP_PER_STEP_S": "0.05", "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": ""}
    args = ("-n", "2", "--pid-file", str(tmp_path / "pids"), str(TINY), str(ck), "step_scheduler.ckpt_every_steps=5", "step_scheduler.num_epochs=10")
    first = cli(*args, env=env)
    deadline = time.monotonic() + 60
    while not ((ck / "LATEST").is_symlink() and int(os.readlink(ck / "LATEST").rsplit("_", 1)[1]) >= 10) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGUSR1)
    rc, stderr = finish(first, timeout=60)
    assert rc == 75, stderr
    assert "checkpoint published" in stderr
    latest = os.readlink(ck / "LATEST")
    assert cli_main(["status", str(ck), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["restart_guard"] is None  # a new checkpoint: nothing counted against it
    assert cli_main(["status", str(ck)]) == 0
    assert "preempted cleanly before saving anything new" not in capsys.readouterr().out

    (tmp_path / "pids").unlink()
    second = cli(*args, env=env)
    wait_for([tmp_path / "pids"])
    os.kill(second.pid, signal.SIGUSR1)  # the ranks are starting: held, they read the stop file when ready
    rc, stderr = finish(second, timeout=60)
    assert rc == 75, stderr
    assert "stop before the first step" in stderr and f"nothing new to save ({latest} holds this state)" in stderr, stderr
    assert "checkpoint published" not in stderr
    assert cli_main(["status", str(ck)]) == 0
    assert f"starts in a row from {latest}: 1 (failed: 0, limit 3; preempted cleanly before saving anything new: 1" in capsys.readouterr().out
