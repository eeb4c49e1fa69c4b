"""DataLoader workers and preemption signals sent to the whole process group (Slurm's way).

Two ranks under ``resilience run`` in a session of their own, each with a DataLoader of 2 worker
processes (``tests/helpers/worker_train.py``), paused in step 3 while the test signals either the
whole process group (launcher, ranks and every worker, as slurmstepd does) or one rank. The ranks
must save one agreed step of the first epoch, exit 75, and a resumed run must end bitwise equal to an uninterrupted one; the
user's ``worker_init_fn`` still runs in each worker, and no worker outlives its rank.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilience import ExitCode
from resilience.checkpoint.storage.manifest import all_files, validate
from resilience.state.worker_signals import ShieldedWorkerInit, shield_dataloader_workers
from runs import compare, latest_name
from slurm_cluster import pid_alive
from worker_runs import TOTAL_STEPS, finish, launch_run, run_to_end, worker_env

pytestmark = pytest.mark.multiproc
PAUSE_STEP = 3


def _worker_pids(events: Path) -> list[int]:
    return [int(p.name.split("_")[2]) for p in events.glob("worker_*")]


def _rank_pid(pid_file: Path, rank: int) -> int:
    for line in pid_file.read_text().splitlines():
        kind, *rest = line.split()
        if kind == "rank" and int(rest[0]) == rank:
            return int(rest[1])
    raise AssertionError(f"no rank {rank} in {pid_file}")


def _assert_no_worker_left(events: Path, out: str) -> None:
    deadline = time.monotonic() + 15
    while [pid for pid in _worker_pids(events) if pid_alive(pid)]:
        assert time.monotonic() < deadline, f"workers still running: {[p for p in _worker_pids(events) if pid_alive(p)]}\n{out}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One uninterrupted run: the data order comes from the sampler in the rank, so every loader
    kind, with or without persistent workers, must train exactly like it."""
    root = tmp_path_factory.mktemp("reference")
    code, out = run_to_end(root / "ck", root / "events", worker_env("plain", False))
    assert code == ExitCode.DONE, out
    return root / "ck"


# (loader kind, persistent workers, signal, to the group or to rank 1). SIGTERM to the group is
# the case that lost the checkpoint: every loader configuration; the others spread over them.
CASES = [
    ("plain", False, "TERM", "group"),
    ("plain", True, "TERM", "group"),
    ("stateful", False, "TERM", "group"),
    ("stateful", True, "TERM", "group"),
    ("plain", False, "USR1", "group"),
    ("stateful", True, "USR1", "group"),
    ("plain", True, "TERM", "rank"),
    ("stateful", False, "USR1", "rank"),
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("loader,persistent,sig,target", CASES, ids=["-".join([c[0], "persistent" if c[1] else "transient", c[2], c[3]]) for c in CASES])
def test_a_signal_to_the_process_group_with_dataloader_workers_saves_the_agreed_step_and_resumes_exactly(tmp_path, reference, loader, persistent, sig, target):
    ckpt, events, pid_file = tmp_path / "ck", tmp_path / "events", tmp_path / "pids"
    proc = launch_run(ckpt, events, worker_env(loader, persistent, PAUSE_AT_STEP=str(PAUSE_STEP)), pid_file)
    try:
        deadline = time.monotonic() + 90
        while not all((events / f"paused_{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, finish(proc)[1]
            time.sleep(0.02)
        assert len(_worker_pids(events)) == 4, "each rank's 2 workers ran the user's worker_init_fn"
        signum = signal.Signals[f"SIG{sig}"]
        if target == "group":
            os.killpg(proc.pid, signum)  # launcher, ranks and their workers, as slurmstepd signals a step
        else:
            os.kill(_rank_pid(pid_file, 1), signum)
        time.sleep(0.3)  # the signal is in before the ranks go on
        (events / "release").touch()
        code, out = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == ExitCode.PREEMPTED, out
    assert "killed by signal" not in out, out
    assert out.count(f"exit {int(ExitCode.PREEMPTED)}") == 2, out
    manifest = validate(ckpt / latest_name(ckpt))
    # The agreement is non-blocking: the stop lands at the step it completes in, the same on every rank.
    assert PAUSE_STEP <= manifest["meta"]["global_step"] < TOTAL_STEPS // 2 and manifest["meta"]["reason"] == "preemption", manifest["meta"]
    assert {f"rank_state/rank_{r:05d}.safetensors" for r in (0, 1)} <= set(all_files(ckpt / latest_name(ckpt), manifest))
    _assert_no_worker_left(events, out)

    resumed_events = tmp_path / "events2"
    code, out = run_to_end(ckpt, resumed_events, worker_env(loader, persistent))
    assert code == ExitCode.DONE, out
    _assert_no_worker_left(resumed_events, out)
    result = compare(ckpt, reference)
    assert result.identical and result.steps == TOTAL_STEPS, result.detail


@pytest.mark.timeout(120)
def test_a_launcher_killed_with_sigkill_takes_its_ranks_and_their_workers_with_it(tmp_path):
    """Found by a newcomer: ``kill -9`` of the launcher left both ranks training, reparented to
    PID 1, beside the next start's ranks. Each rank now asks the kernel for SIGKILL when its
    launcher ends (PR_SET_PDEATHSIG), and its shielded workers end with it."""
    ckpt, events, pid_file = tmp_path / "ck", tmp_path / "events", tmp_path / "pids"
    events.mkdir()
    proc = launch_run(ckpt, events, worker_env("plain", True, PAUSE_AT_STEP=str(PAUSE_STEP)), pid_file)
    try:
        deadline = time.monotonic() + 90
        while not all((events / f"paused_{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, finish(proc)[1]
            time.sleep(0.02)
        ranks = [_rank_pid(pid_file, r) for r in (0, 1)]
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone
        proc.wait()
        deadline = time.monotonic() + 10
        while [pid for pid in ranks if pid_alive(pid)]:
            assert time.monotonic() < deadline, f"ranks {[p for p in ranks if pid_alive(p)]} outlived their launcher"
            time.sleep(0.05)
        _assert_no_worker_left(events, "")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        else:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group on a failure
            except ProcessLookupError:
                pass


def test_a_rank_whose_launcher_is_gone_refuses_to_train_and_one_under_a_wrapper_is_left_alone():
    from resilience.env_names import LAUNCHER_PID_ENV
    from resilience.parent_death import die_with_launcher

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names no process now
    with pytest.raises(RuntimeError, match=rf"the launcher \(pid {gone.pid}, RESILIENCE_LAUNCHER_PID\) has exited"):
        die_with_launcher({LAUNCHER_PID_ENV: str(gone.pid)})
    assert die_with_launcher({LAUNCHER_PID_ENV: str(os.getpid())}) is False  # alive, but not our parent: a wrapper
    assert die_with_launcher({}) is False  # not started by resilience run


def _user_init(worker_id: int) -> None:
    pass


def test_shielding_composes_the_users_worker_init_fn_once_and_leaves_loaders_without_workers_alone():
    """The composed worker_init_fn pickles (spawn workers), keeps the user's function, and a second
    loop over the same loader replaces the shield instead of stacking another one."""
    import torch
    from torch.utils.data import DataLoader

    loader = DataLoader(list(range(8)), num_workers=2, worker_init_fn=_user_init)
    assert shield_dataloader_workers(loader, [signal.SIGTERM])
    assert shield_dataloader_workers(loader, [signal.SIGUSR1, signal.SIGTERM])
    assert isinstance(loader.worker_init_fn, ShieldedWorkerInit) and loader.worker_init_fn.user_fn is _user_init
    assert loader.worker_init_fn.signals == (signal.SIGUSR1, signal.SIGTERM)
    assert pickle.loads(pickle.dumps(loader.worker_init_fn)).user_fn is _user_init
    plain = DataLoader(list(range(8)))
    assert not shield_dataloader_workers(plain, [signal.SIGTERM]) and plain.worker_init_fn is None
    assert not shield_dataloader_workers([torch.zeros(1)], [signal.SIGTERM])
    assert not shield_dataloader_workers(loader.__class__(list(range(8)), num_workers=2), [])


@pytest.mark.timeout(60)
def test_a_shielded_worker_ignores_others_signals_and_exits_on_its_parents_sigterm():
    """torch's rule kept: a SIGTERM from the worker's parent (multiprocessing's terminate() at the
    rank's exit) still ends it; the same signal from anyone else does not."""
    code = r"""
import os, signal, sys, time
from torch.utils.data import DataLoader
from resilience.state.worker_signals import shield_dataloader_workers

class Slow:
    def __len__(self): return 1000
    def __getitem__(self, i):
        return os.getpid()

loader = DataLoader(Slow(), num_workers=1, persistent_workers=True, batch_size=None)
shield_dataloader_workers(loader, [signal.SIGTERM, signal.SIGUSR1])
it = iter(loader)
worker = next(it)
print("worker", worker, flush=True)
sys.stdin.readline()                       # the test sends its signals now
assert next(it) == worker, "the worker survived"
os.kill(worker, signal.SIGTERM)            # from the parent: torch's rule, exit 0
deadline = time.monotonic() + 10
while True:
    pid, status = os.waitpid(worker, os.WNOHANG)
    if pid:
        print("worker exit", os.waitstatus_to_exitcode(status), flush=True)
        break
    assert time.monotonic() < deadline, "the worker ignored its parent's SIGTERM"
    time.sleep(0.05)
os._exit(0)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        worker = int(proc.stdout.readline().split()[1])
        os.kill(worker, signal.SIGTERM)
        os.kill(worker, signal.SIGUSR1)
        time.sleep(0.5)
        assert pid_alive(worker)
        proc.stdin.write("\n")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "worker exit 0" in out, out


def test_persistent_workers_started_before_the_loop_get_a_warning(caplog):
    """Workers forked before the shield was set never ran it: say so instead of failing later."""
    from torch.utils.data import DataLoader

    loader = DataLoader(list(range(4)), num_workers=1, persistent_workers=True)
    list(loader)  # the persistent workers now exist
    with caplog.at_level("WARNING", logger="resilience"):
        assert shield_dataloader_workers(loader, [signal.SIGTERM])
    assert "persistent workers were started before resilient_loop()" in caplog.text and "SIGTERM" in caplog.text
    fresh = DataLoader(list(range(4)), num_workers=1, persistent_workers=True)
    caplog.clear()
    with caplog.at_level("WARNING", logger="resilience"):
        shield_dataloader_workers(fresh, [signal.SIGTERM])
    assert not caplog.text


@pytest.mark.timeout(60)
def test_a_shielded_worker_still_ends_when_its_rank_is_killed():
    """torch's watchdog (the worker polls its parent pid) is untouched by the shield."""
    code = r"""
import os, signal, time
from torch.utils.data import DataLoader
from resilience.state.worker_signals import shield_dataloader_workers
loader = DataLoader(list(range(1000)), num_workers=1, persistent_workers=True, batch_size=None,
                    worker_init_fn=lambda i: None)
shield_dataloader_workers(loader, [signal.SIGTERM])
it = iter(loader)
next(it)
print("workers", *[p.pid for p in it._workers], flush=True)
time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(proc.stdout.readline().split()[1])
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 20
        while pid_alive(worker):
            assert time.monotonic() < deadline, "the worker outlived its killed parent"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
