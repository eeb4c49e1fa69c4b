"""The rendered batch templates on a real local Slurm cluster, running the digits example.

Each scenario submits `resilience template slurm examples/digits/digits.yaml ...` with sbatch and checks
what users rely on: a stop signal (Slurm's own time-limit warning, ``scancel --batch``, real
partition preemption) makes both ranks save the same step, the job requeues itself, resumes and
finishes with weights bitwise equal to an uninterrupted run; array tasks requeue as
``<array job id>_<task id>``; the restart limit ends the job with 77; a job stopped before every
first step ends with 76 (the requeue-loop guard); no worker outlives its job;
on two nodes the signal is forwarded on the batch node only and the agreement stops the other.
A rank SIGKILLed mid-run (issue 16): with ``slurm.in_job_restarts`` the ranks restart in the job
(one node; and on two nodes both nodes' ranks together); without, both nodes' launchers end at
once and the job requeues; each completes exactly.

Jobs are slow to start on this 2-core machine and Slurm's time-limit check runs every 30 s, so
the scenarios run concurrently: a module fixture starts every scenario the selected tests need
(in threads, one job each), and each test waits for its own and asserts. The one-node scenarios
use the ``slurm_cluster`` fixture (8 CPUs advertised: four 2-CPU jobs fit); the two-node ones,
the preemption scenario and the one-node killed-rank job (on n2) use ``slurm_cluster_2nodes`` (see
``scenario_preempt`` for why the preemption there hits our job only). The two clusters share this machine's ports and number their
jobs alike, while the rendezvous port derives from the job id: the two-node cluster's job ids are
first moved 100 past the one-node cluster's (``sbatch --test-only`` uses up an id).

The time-limit scenario makes its job's warning due while the ranks train, 2 s before one of
Slurm's 30 s checks (see ``scenario_timelimit``). Everything else runs its Python at niceness
NICE so that the jobs whose timing matters start as fast as they can.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import runs  # examples/digits/runs.py (conftest puts it on sys.path)
from resilience import ExitCode, cli
from slurm_cluster import TERMINAL_STATES, SlurmCluster, pid_alive, wait_for

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
DIGITS_YAML = REPO / "examples" / "digits" / "digits.yaml"
TRAIN = REPO / "examples" / "digits" / "train.py"

E_SHORT = 15  # epochs of 22 steps: 3-6 s of training for 2 ranks on an idle 2-core machine
TICK_S = 30.0  # Slurm checks time limits and sends --signal warnings every 30 s (22.05)
FIRST_SIGNAL_STEPS = 20  # steps logged before a test sends its signal
NICE = 10  # CPU niceness of everything but the time-limit job, whose warning time is fixed
# Not anchored: two ranks print to one log and print() writes the text and the newline apart.
STEP_RE = re.compile(r"rank (\d+): preempted, saved step (\d+)")


# --------------------------------------------------------------------------------------------
# Helpers


def _steps_logged(ckpt_dir: Path) -> int:
    path = ckpt_dir / "training.jsonl"
    try:
        return path.read_text().count("\n")
    except FileNotFoundError:
        return 0


@dataclasses.dataclass
class Job:
    """One submitted template job: its id, directory (cwd, logs, checkpoints) and cluster."""

    cluster: SlurmCluster
    id: str
    dir: Path
    ckpt: Path

    def log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.dir.glob("out-*.txt")))

    def wait_log(self, pattern: str, timeout: float) -> re.Match:
        return wait_for(lambda: re.search(pattern, self.log(), re.M), timeout, f"/{pattern}/ in the log of job {self.id}", self.log)

    def wait_steps(self, n: int, timeout: float) -> int:
        return wait_for(lambda: _steps_logged(self.ckpt) >= n and _steps_logged(self.ckpt), timeout, f"{n} steps of job {self.id}", self.log)

    def scancel_usr1(self) -> None:
        self.cluster.run(["scancel", "--batch", "--signal=USR1", self.id])

    def wait_end(self, state: str = "COMPLETED", timeout: float = 150) -> dict:
        """Wait for the job's final state; then check at once which recorded pids still run."""
        try:
            info = self.cluster.wait_state(self.id, state, timeout=timeout)
        except (RuntimeError, TimeoutError) as error:
            raise AssertionError(f"{error}\n--- log of job {self.id}:\n{self.log()}") from None
        self.leftovers = leftover_workers(self.dir)
        self.info = info  # Slurm forgets a finished job after MinJobAge (60 s)
        return info


def _python_wrapper(path: Path, prefix: str) -> Path:
    path.write_text(f'#!/bin/sh\nexec {prefix} {sys.executable} "$@"\n')
    path.chmod(0o755)
    return path


def nice_python(directory: Path) -> Path:
    """A python that runs at niceness NICE (for the ranks of jobs whose timing is not critical)."""
    return _python_wrapper(directory / "nice-python", f"nice -n {NICE}")


def render(directory: Path, *overrides: str, output: str = "out-%j.txt", python: Path | None = None) -> Path:
    """`resilience template slurm examples/digits/digits.yaml` with this job's paths; returns the script.
    The job's python is ``python``, default :func:`nice_python`."""
    path = directory / "job.sub"
    python = python or nice_python(directory)
    code = cli.main(
        [
            "template",
            "slurm",
            str(DIGITS_YAML),
            f"slurm.python={python}",
            f"slurm.script={TRAIN}",
            f"slurm.output={directory / output}",
            f"checkpoint.checkpoint_dir={directory / 'ck'}",
            *overrides,
            "-o",
            str(path),
        ]
    )
    assert code == 0
    return path


def submit(
    cluster: SlurmCluster,
    directory: Path,
    *overrides: str,
    env: dict | None = None,
    output: str = "out-%j.txt",
    python: Path | None = None,
) -> Job:
    """Render into ``directory`` (see :func:`render`) and sbatch from there (the submit dir)."""
    directory.mkdir(parents=True, exist_ok=True)
    script = render(directory, *overrides, output=output, python=python)
    kw = {"cwd": directory}
    if env:
        kw["env"] = {**cluster.env, **env}
    return Job(cluster, cluster.sbatch(script, **kw), directory, directory / "ck")


def recorded_pids(directory: Path) -> list[int]:
    """Every pid the template's attempts recorded (last field of each line of .resilience/*.pids)."""
    pids = []
    for path in sorted((directory / ".resilience").glob("*.pids")):
        for line in path.read_text().splitlines():
            if line.split():
                pids.append(int(line.split()[-1]))
    return pids


def leftover_workers(directory: Path) -> list[int]:
    """Recorded pids still running as a process of one of this directory's jobs (pid_max is
    32768 here: a recycled pid belongs to someone else and has no such environment)."""
    marker = f"RESILIENCE_STOP_FILE={directory / '.resilience'}/".encode()
    alive = []
    for pid in recorded_pids(directory):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if pid_alive(pid) and marker in environ:
            alive.append(pid)
    return alive


def attempts(log: str) -> list[str]:
    """The log split at each attempt banner: element i is attempt i+1's part."""
    parts = re.split(r"^resilience: attempt \d+ of job", log, flags=re.M)
    return parts[1:]


def saved_steps(text: str) -> dict[int, int]:
    """rank -> step from 'rank R: preempted, saved step S' lines."""
    return {int(r): int(s) for r, s in STEP_RE.findall(text)}


def assert_exact(job: Job, reference: Path) -> None:
    comparison = runs.compare(job.ckpt, reference)
    assert comparison.identical, f"job {job.id} vs uninterrupted run: {comparison}\n{job.log()}"


# --------------------------------------------------------------------------------------------
# Scenarios: each runs in its own thread and returns its Job (or raises)


def _reference(c: Campaign, name: str, epochs: int) -> Path:
    """An uninterrupted local 2-rank run (examples/digits/runs.py), at low CPU priority."""
    ref = c.root / name
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import runs; "
        "r = runs.run(Path(sys.argv[2]), 2, overrides=[sys.argv[3]], timeout=240); "
        "sys.exit(0 if r.codes == [0, 0] else 1)"
    )
    proc = subprocess.run(
        ["nice", "-n", str(NICE), sys.executable, "-c", code, str(TRAIN.parent), str(ref), f"step_scheduler.num_epochs={epochs}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ref


def scenario_ref_short(c: Campaign) -> Path:
    return _reference(c, "ref_short", E_SHORT)


def _start_epoch(info: dict) -> float:
    """StartTime of ``scontrol show job`` (local time, 1 s resolution) as a Unix time.

    Raises AssertionError naming the job's record when it has none (``Unknown``: the job is
    pending again, e.g. requeued after its ranks were killed)."""
    try:
        return time.mktime(time.strptime(info.get("StartTime", ""), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        raise AssertionError(f"the job has no StartTime; is it still running? {info}") from None


PROBE_TRIES = 3


def scenario_check_probe(c: Campaign) -> float:
    """``time.monotonic()`` of one of Slurm's warning checks: a job with --time=1
    --signal=B:USR1@50 gets its signal at the first check after it starts.

    A probe that ends without the line (once in CI no line came in 60 s; a check a few ms after
    the start can beat the trap and kill the shell) is submitted again, up to PROBE_TRIES
    times; the error names each try's state and output."""
    tries = []
    for attempt in range(PROBE_TRIES):
        d = c.root / f"check-probe-{attempt}"
        d.mkdir()
        probe = d / "probe.sh"
        probe.write_text(
            "#!/bin/bash\n"
            "trap 'got=1; echo \"usr1 $EPOCHREALTIME\"' USR1\n"
            "got=0\n"
            'echo "started $EPOCHREALTIME"\n'
            "sleep 45 &\n"
            "while [ $got -eq 0 ] && kill -0 $! 2>/dev/null; do wait $!; done\n"
            "kill $! 2>/dev/null\n"
        )
        out = d / "probe.out"
        job = c.cluster1.sbatch(probe, "--time=1", "--signal=B:USR1@50", "-o", str(out), "-c", "1", cwd=d)
        c.track(c.cluster1, job)

        def warned_or_ended(job=job, out=out):
            match = out.exists() and re.search(r"^usr1 ([\d.]+)$", out.read_text(), re.M)
            if match:
                return match
            return c.cluster1.job_info(job).get("JobState") in TERMINAL_STATES and "ended"

        try:
            result = wait_for(warned_or_ended, 75, "the probe's warning or its end")
        except TimeoutError:
            result = "timed out"
        if isinstance(result, re.Match):
            return float(result.group(1)) - time.time() + time.monotonic()  # same machine, same clock
        text = out.read_text() if out.exists() else "(no output file)"
        tries.append(f"probe job {job} {result}: {c.cluster1.job_info(job)}\n{text}")
    raise AssertionError("no probe got Slurm's time-limit warning:\n" + "\n".join(tries))


def _signal_ranks(job: Job, sig: int) -> None:
    for path in (job.dir / ".resilience").glob(f"{job.id}.0.*.pids"):
        for line in path.read_text().splitlines():
            if line.startswith("rank "):
                try:
                    os.kill(int(line.split()[-1]), sig)
                except ProcessLookupError:
                    pass


def _kill_rank(job: Job, rank: int) -> int:
    """SIGKILL global rank ``rank`` of the job's first attempt (from its node's pid file); its pid."""
    for path in (job.dir / ".resilience").glob(f"{job.id}.0.*.pids"):
        for line in path.read_text().splitlines():
            if line.startswith(f"rank {rank} "):
                os.kill(int(line.split()[-1]), signal.SIGKILL)
                return int(line.split()[-1])
    raise AssertionError(f"rank {rank} of job {job.id} is in no pid file\n{job.log()}")


# A rank killed mid-run: checkpoints every 10 steps, so the restart resumes from one.
KILL_AFTER_STEPS = 25
EVERY_10 = "step_scheduler.ckpt_every_steps=10"


def _killed_mid_run(job: Job, rank: int) -> Job:
    # These jobs start last and may wait for CPUs that the other scenarios hold.
    job.wait_log(r"^resilience: trap installed", 200)
    job.killed_at_step = job.wait_steps(KILL_AFTER_STEPS, 120)
    job.killed_pid = _kill_rank(job, rank)
    job.killed_at = time.time()
    job.wait_end(timeout=150)
    return job


def scenario_kill_in_job(c: Campaign) -> Job:
    """slurm.in_job_restarts=2, a one-node job: rank 1 SIGKILLed mid-run; the launcher restarts both
    ranks in the job (no requeue) and they finish from LATEST. On the two-node cluster's n2, in
    partition high: the one-node cluster's CPUs are taken by the timing-sensitive scenarios and
    their requeued attempts, and n2 runs nothing that preempts or is preempted."""
    overrides = ("slurm.partition=high", "slurm.sbatch_extra=[--nodelist=n2]", "slurm.in_job_restarts=2")
    return _killed_mid_run(c.submit2("kill_in_job", f"step_scheduler.num_epochs={E_SHORT}", EVERY_10, *overrides), 1)


def scenario_timelimit(c: Campaign) -> Job:
    """Slurm's own time-limit warning, arriving while the ranks train.

    A warning is due once end - now <= N + 30 s (N = signal_lead_s) and is sent at the next of
    Slurm's checks, which come every TICK_S (a probe job locates one). The job starts with
    --time=10 --signal=B:USR1@100, not due for minutes. Once its ranks train, the test pauses
    them (SIGSTOP: no CPU spent waiting), 2 s before a check cuts the time limit so the warning
    is due, and continues them once the warning is in: it arrives mid-training, and the ranks
    take it at their next step. Then the limit goes back to 10 min, so the requeued job runs to
    the end. The pause can outlast the watchdog's default step limit (60 s: a probe submitted
    again alone adds 75 s), and the watchdog rightly takes stopped ranks for hung ones (in CI it
    killed them and the job went back to pending), so this job's limit is 600 s.
    """
    lead_s = 100
    job = c.submit1(
        "timelimit",
        f"step_scheduler.num_epochs={E_SHORT}",
        "slurm.time='10'",
        f"slurm.signal_lead_s={lead_s}",
        "slurm.progress_timeout=600",
        python=Path(sys.executable),
    )
    job.wait_log(r"^resilience: trap installed", 60)
    job.wait_steps(FIRST_SIGNAL_STEPS, 120)
    _signal_ranks(job, signal.SIGSTOP)
    job.paused_at_step = _steps_logged(job.ckpt)
    check = c.result("check_probe", timeout=PROBE_TRIES * 80)
    while check - time.monotonic() < 4:
        check += TICK_S
    time.sleep(max(0.0, check - 2 - time.monotonic()))
    elapsed = time.time() - _start_epoch(job.cluster.job_info(job.id))
    minutes = int((elapsed + lead_s + 30) // 60)  # end - now lands in (lead_s + 30 - 60, lead_s + 30]
    job.cluster.run(["scontrol", "update", f"JobId={job.id}", f"TimeLimit={minutes}"])
    job.limit_cut_at = time.time()
    # The ranks stay paused until the warning is in: the rest of this short training takes only
    # a second or two, and a check that came a few seconds late once let it finish first (exit
    # 0, nothing to requeue). Paused, they keep their handlers; the forwarded USR1 waits for them.
    job.wait_log(r"^resilience: SIGUSR1 \(?received at", TICK_S + 10)
    _signal_ranks(job, signal.SIGCONT)
    job.cluster.run(["scontrol", "update", f"JobId={job.id}", "TimeLimit=10"])
    job.wait_end(timeout=150)
    return job


def scenario_scancel(c: Campaign) -> Job:
    job = c.submit1("scancel", f"step_scheduler.num_epochs={E_SHORT}")
    job.wait_log(r"^resilience: trap installed", 60)
    job.signalled_at_step = job.wait_steps(FIRST_SIGNAL_STEPS, 90)
    job.scancel_usr1()
    job.wait_end(timeout=150)
    return job


def scenario_array(c: Campaign) -> Job:
    """Two array tasks of one rank each, each in its own directory (slurm.setup cds there);
    only task 1 is signalled."""
    job = c.submit1(
        "array",
        f"step_scheduler.num_epochs={E_SHORT}",
        "slurm.nproc_per_node=1",
        "slurm.sbatch_extra=[--array=0-1]",
        """slurm.setup=['mkdir -p "task$SLURM_ARRAY_TASK_ID" && cd "task$SLURM_ARRAY_TASK_ID"']""",
        "checkpoint.checkpoint_dir=ck",
        output="out-%A_%a.txt",
    )
    job.ckpt = job.dir / "task1" / "ck"
    job.wait_log(r"^resilience: attempt 1 of job \d+_1 ", 60)
    job.signalled_at_step = job.wait_steps(FIRST_SIGNAL_STEPS, 90)
    job.cluster.run(["scancel", "--batch", "--signal=USR1", f"{job.id}_1"])
    job.task_info = {}
    for task in (0, 1):
        try:
            job.task_info[task] = job.cluster.wait_state(f"{job.id}_{task}", "COMPLETED", timeout=150)
        except (RuntimeError, TimeoutError) as error:
            raise AssertionError(f"{error}\n{job.log()}") from None
    job.leftovers = leftover_workers(job.dir)
    return job


def scenario_limit(c: Campaign) -> Job:
    """max_restarts=1: the first stop requeues, the second ends the job with 77."""
    job = c.submit1("limit", f"step_scheduler.num_epochs={E_SHORT}", "slurm.max_restarts=1")
    job.wait_log(r"^resilience: trap installed", 60)
    job.wait_steps(FIRST_SIGNAL_STEPS, 90)
    job.scancel_usr1()
    job.wait_log(r"^resilience: attempt 2 of job", 90)
    first_stop = max(saved_steps(attempts(job.log())[0]).values())
    job.wait_steps(first_stop + 10, 90)
    job.scancel_usr1()
    job.info = job.wait_end("FAILED", timeout=120)
    # Still FAILED, with one restart, after Slurm's requeue delay (cred_expire + 1 s) has passed.
    time.sleep(8)
    job.info_later = job.cluster.job_info(job.id)
    return job


def _next_job_id(cluster: SlurmCluster) -> int:
    out = cluster.run(["scontrol", "show", "config"]).stdout
    return int(re.search(r"^NEXT_JOB_ID\s*=\s*(\d+)", out, re.M).group(1))


def scenario_id_gap(c: Campaign) -> None:
    """Move the two-node cluster's job ids 100 past the one-node cluster's (see the docstring)."""
    if c.cluster1 is None:
        return
    missing = _next_job_id(c.cluster1) + 100 - _next_job_id(c.cluster2)
    for _ in range(max(0, missing)):
        c.cluster2.run(["sbatch", "--test-only", "--wrap=true"], check=False)
    assert _next_job_id(c.cluster2) >= _next_job_id(c.cluster1) + 50


# The two-node jobs run in partition high, which nothing preempts (see scenario_preempt).
def scenario_mn_scancel(c: Campaign) -> Job:
    job = c.submit2("mn_scancel", f"step_scheduler.num_epochs={E_SHORT}", "slurm.nodes=2", "slurm.nproc_per_node=1", "slurm.partition=high")
    job.wait_log(r"^resilience: trap installed", 60)
    job.signalled_at_step = job.wait_steps(FIRST_SIGNAL_STEPS, 90)
    job.scancel_usr1()
    job.wait_end(timeout=150)
    return job


def scenario_mn_prelaunch(c: Campaign) -> Job:
    job = c.submit2(
        "mn_prelaunch",
        f"step_scheduler.num_epochs={E_SHORT}",
        "slurm.nodes=2",
        "slurm.nproc_per_node=1",
        "slurm.partition=high",
        env={"RESILIENCE_TEST_PRELAUNCH_SLEEP": "4"},
    )
    job.wait_log(r"^resilience: trap installed", 60)
    job.scancel_usr1()
    job.wait_end(timeout=150)
    return job


def scenario_mn_kill_in_job(c: Campaign) -> Job:
    """Two nodes, slurm.in_job_restarts=1: the rank on n2 SIGKILLed mid-run; both nodes' launchers
    restart their ranks together (the shared fault file), no requeue."""
    overrides = ("slurm.nodes=2", "slurm.nproc_per_node=1", "slurm.partition=high", "slurm.in_job_restarts=1")
    c.after("preempt")
    return _killed_mid_run(c.submit2("mn_kill_in_job", f"step_scheduler.num_epochs={E_SHORT}", EVERY_10, *overrides), 1)


def scenario_mn_kill_requeue(c: Campaign) -> Job:
    """Two nodes, no in-job restarts: the rank on n2 SIGKILLed mid-run; both launchers exit 75 at
    once and the batch script requeues the whole job."""
    overrides = ("slurm.nodes=2", "slurm.nproc_per_node=1", "slurm.partition=high")
    c.after("preempt")
    return _killed_mid_run(c.submit2("mn_kill_requeue", f"step_scheduler.num_epochs={E_SHORT}", EVERY_10, *overrides), 1)


def scenario_guard(c: Campaign) -> Job:
    """checkpoint.max_preemptions_without_progress=1: each attempt holds its launch 5 s
    (RESILIENCE_TEST_PRELAUNCH_SLEEP); USR1 then stops it before the ranks' first step (no
    checkpoint), the job requeues, and the next start trips the guard (exit 76, not requeued).
    On n2 in partition high, beside kill_in_job: mostly waiting, it needs no CPU of the one-node
    cluster's timing-sensitive jobs. The stop is held for the ranks (slurm.signal_hold_timeout)
    longer than a loaded machine takes to start them, so they always stop through the stop file
    at their first step, which the guard counts, and are never ended by the held signal."""
    overrides = (
        "slurm.partition=high",
        "slurm.sbatch_extra=[--nodelist=n2]",
        "slurm.signal_hold_timeout=240",
        "checkpoint.max_preemptions_without_progress=1",
        "slurm.max_restarts=5",
    )
    job = c.submit2("guard", *overrides, env={"RESILIENCE_TEST_PRELAUNCH_SLEEP": "5"})
    job.wait_log(r"^resilience: trap installed", 90)
    job.scancel_usr1()
    job.info = job.wait_end(state="FAILED", timeout=200)
    return job


HOLD_S = 5  # scenario_held_stop's slurm.signal_hold_timeout
# A first attempt "trains" 60 s (longer than its test may take); a requeued one (SLURM_RESTART_COUNT
# set) finishes at once. No torch, no resilient_loop(): it never handles SIGUSR1 nor reads the stop file.
NO_LOOP_PROGRAM = """
import os, sys, time
attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
open(os.path.join(sys.argv[1], "started.%d" % attempt), "w").close()
if attempt == 0:
    time.sleep(60)
    print("no-loop rank: trained to the end", flush=True)
else:
    print("no-loop rank: attempt %d finished" % (attempt + 1), flush=True)
"""


def scenario_held_stop(c: Campaign) -> Job:
    """A program without resilient_loop() under the rendered template (issue 23 item 2):
    ``scancel --batch --signal=USR1`` once it runs; the launcher holds the signal HOLD_S s, delivers
    it (the default action ends the rank), exits 75 and the script requeues; the second attempt
    finishes. On n2 in partition high (one CPU, no torch: nearly idle)."""
    d = c.root / "held_stop"
    d.mkdir()
    program, config, script = d / "no_loop.py", d / "job.yaml", d / "job.sub"
    program.write_text(NO_LOOP_PROGRAM)
    config.write_text(
        "step_scheduler:\n"
        "  preemption_signal: SIGUSR1\n"
        "checkpoint:\n"
        f"  checkpoint_dir: {d / 'ck'}\n"
        "slurm:\n"
        f"  script: {program}\n"
        f"  script_args: [{d}]\n"
        f"  python: {sys.executable}\n"
        "  partition: high\n"
        "  sbatch_extra: [--nodelist=n2]\n"
        "  cpus_per_task: 1\n"
        "  time: '10'\n"
        "  signal_lead_s: 60\n"
        f"  signal_hold_timeout: {HOLD_S}\n"
        f"  output: {d}/out-%j.txt\n"
    )
    assert cli.main(["template", "slurm", str(config), "-o", str(script)]) == 0
    c.futures["id_gap"].result(timeout=120)
    job = Job(c.cluster2, c.cluster2.sbatch(script, cwd=d), d, d / "ck")
    c.track(job.cluster, job.id)
    wait_for(lambda: (d / "started.0").exists() and "trap installed" in job.log(), 120, "the rank's start", job.log)
    job.scancel_usr1()
    job.info = job.wait_end(timeout=150)
    return job


def scenario_preempt(c: Campaign) -> Job:
    """Ours in partition debug on node n1, holding 6 of its 8 CPUs; then a job in partition high
    (higher PriorityTier) asking for 4 CPUs there. The two-node jobs running meanwhile hold at
    most 2 CPUs of n1 and, being in partition high themselves, cannot be preempted: the new
    job can only start by preempting ours, and preempting ours is always enough. (The killed-rank
    two-node scenarios would be two more jobs in partition high there: they start after this one.)"""
    job = c.submit2(
        "preempt",
        f"step_scheduler.num_epochs={E_SHORT}",
        "slurm.partition=debug",
        "slurm.cpus_per_task=3",
        "slurm.sbatch_extra=[--nodelist=n1]",
    )
    job.wait_log(r"^resilience: trap installed", 60)
    job.signalled_at_step = job.wait_steps(FIRST_SIGNAL_STEPS, 90)
    job.preemptor = job.cluster.sbatch("--wrap=sleep 1", "-p", "high", "-w", "n1", "-c", "4", "-o", str(job.dir / "high.out"), cwd=job.dir)
    c.track(job.cluster, job.preemptor)
    job.wait_end(timeout=150)
    job.preemptor_info = job.cluster.wait_state(job.preemptor, "COMPLETED", timeout=30)
    return job


SCENARIOS: dict[str, Callable[[Campaign], object]] = {  # started in this order
    "id_gap": scenario_id_gap,
    "check_probe": scenario_check_probe,
    "ref_short": scenario_ref_short,
    "timelimit": scenario_timelimit,
    "scancel": scenario_scancel,
    "array": scenario_array,
    "limit": scenario_limit,
    "mn_scancel": scenario_mn_scancel,
    "mn_prelaunch": scenario_mn_prelaunch,
    "preempt": scenario_preempt,
    "kill_in_job": scenario_kill_in_job,
    "mn_kill_in_job": scenario_mn_kill_in_job,
    "mn_kill_requeue": scenario_mn_kill_requeue,
    "guard": scenario_guard,
    "held_stop": scenario_held_stop,
}
ONE_NODE = {"check_probe", "timelimit", "scancel", "array", "limit"}
TWO_NODES = {"mn_scancel", "mn_prelaunch", "preempt", "kill_in_job", "mn_kill_in_job", "mn_kill_requeue", "guard", "held_stop"}


class Campaign:
    """The scenarios of the selected tests, running concurrently; see the module docstring."""

    def __init__(self, root: Path, cluster1: SlurmCluster | None, cluster2: SlurmCluster | None):
        self.root = root
        self.cluster1 = cluster1
        self.cluster2 = cluster2
        self.futures: dict[str, concurrent.futures.Future] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(SCENARIOS))
        self._jobs: list[tuple[SlurmCluster, str]] = []
        self._lock = threading.Lock()
        self.started_at = time.monotonic()

    def start(self, names: set[str]) -> None:
        for name in sorted(names, key=list(SCENARIOS).index):
            self.futures[name] = self._pool.submit(SCENARIOS[name], self)

    def result(self, name: str, timeout: float = 280):
        return self.futures[name].result(timeout=timeout)

    def after(self, name: str) -> None:
        """Wait until scenario ``name`` has ended, when it runs in this campaign (its errors are its
        own test's to report)."""
        if name in self.futures:
            concurrent.futures.wait([self.futures[name]], timeout=280)

    def track(self, cluster: SlurmCluster, job_id: str) -> None:
        with self._lock:
            self._jobs.append((cluster, job_id))

    def _submit(self, cluster: SlurmCluster, name: str, *overrides: str, **kw) -> Job:
        job = submit(cluster, self.root / name, *overrides, **kw)
        self.track(cluster, job.id)
        return job

    def submit1(self, name: str, *overrides: str, **kw) -> Job:
        return self._submit(self.cluster1, name, *overrides, **kw)

    def submit2(self, name: str, *overrides: str, **kw) -> Job:
        self.futures["id_gap"].result(timeout=120)
        return self._submit(self.cluster2, name, *overrides, **kw)

    def close(self) -> None:
        for cluster, job_id in self._jobs:  # anything still queued or running after a failure
            cluster.run(["scancel", job_id], check=False)
        self._pool.shutdown(wait=True, cancel_futures=True)


# test name -> scenarios it needs
NEEDS = {
    "test_time_limit_warning_stops_both_ranks_at_one_step_requeues_and_resumes_exactly": {"timelimit", "check_probe", "ref_short"},
    "test_scancel_batch_usr1_requeues_and_resumes_exactly": {"scancel", "ref_short"},
    "test_scheduler_preemption_saves_requeues_and_completes_exactly": {"preempt", "ref_short"},
    "test_array_task_requeues_itself_as_array_job_id_underscore_task_id": {"array"},
    "test_restart_limit_ends_the_job_with_77_without_requeue": {"limit"},
    "test_no_worker_outlives_its_job": {"scancel"},
    "test_multinode_signal_reaches_batch_node_launcher_only_and_both_nodes_stop_at_one_step": {"mn_scancel", "ref_short"},
    "test_multinode_signal_before_launch_is_not_lost": {"mn_prelaunch", "ref_short"},
    "test_in_job_restart_a_killed_rank_restarts_in_the_job_without_requeue_and_completes_exactly": {"kill_in_job", "ref_short"},
    "test_multinode_in_job_restart_a_rank_killed_on_the_second_node_restarts_both_nodes_together_and_completes_exactly": {
        "mn_kill_in_job",
        "ref_short",
    },
    "test_multinode_a_rank_killed_on_the_second_node_ends_both_nodes_at_once_requeues_and_completes_exactly": {"mn_kill_requeue", "ref_short"},
    "test_a_job_that_makes_no_progress_stops_requeueing_with_76": {"guard"},
    "test_a_program_without_resilient_loop_gets_the_held_signal_after_the_hold_and_the_job_requeues": {"held_stop"},
}


@pytest.fixture(scope="module")
def campaign(request, tmp_path_factory):
    selected = {item.name for item in request.session.items if item.module is sys.modules[__name__]}
    names = set().union(*(NEEDS.get(name, set()) for name in selected))
    cluster1 = request.getfixturevalue("slurm_cluster") if names & ONE_NODE else None
    cluster2 = request.getfixturevalue("slurm_cluster_2nodes") if names & TWO_NODES else None
    camp = Campaign(tmp_path_factory.mktemp("slurm-e2e"), cluster1, cluster2)
    camp.start(names | ({"id_gap"} if cluster2 else set()))
    try:
        yield camp
    finally:
        camp.close()
        print(f"\nslurm e2e scenarios took {time.monotonic() - camp.started_at:.1f} s in all")


# --------------------------------------------------------------------------------------------
# Tests


@pytest.mark.timeout(480)  # a probe submitted again (scenario_check_probe) can add 160 s
def test_time_limit_warning_stops_both_ranks_at_one_step_requeues_and_resumes_exactly(campaign: Campaign) -> None:
    """Slurm's own time-limit warning (--signal=B:USR1@100, due once the time limit is cut while
    the ranks train) reaches the batch shell and is forwarded; both ranks save the same step, the
    job requeues itself, resumes and ends with the weights of an uninterrupted run."""
    job = campaign.result("timelimit", timeout=440)
    log = job.log()
    parts = attempts(log)
    interrupted = [part for part in parts if "preempted (exit 75); requeueing" in part]
    assert interrupted and len(parts) == len(interrupted) + 1, log
    for part in interrupted:
        assert re.search(r"^resilience: SIGUSR1 \(?received at [\d.]+", part, re.M), log
        steps = saved_steps(part)
        assert sorted(steps) == [0, 1] and steps[0] == steps[1], log
    stops = [saved_steps(part)[0] for part in interrupted]
    first = float(re.search(r"received at ([\d.]+)", parts[0]).group(1))
    print(
        f"\ntime-limit warning {first - job.limit_cut_at:.1f} s after the limit was cut; ranks paused at "
        f"step {job.paused_at_step}, saved step {stops[0]}" + " (paused until it came)"
    )
    assert len(interrupted) == 1 and int(job.info["Restarts"]) == 1, log
    assert re.search(r"^resilience: SIGUSR1 \(received at [\d.]+\) forwarded to resilience run", parts[0], re.M), log
    assert stops[0] >= job.paused_at_step >= FIRST_SIGNAL_STEPS  # the warning came while the ranks trained
    assert "training done; exit 0" in parts[-1]
    assert_exact(job, campaign.result("ref_short"))


@pytest.mark.timeout(300)
def test_scancel_batch_usr1_requeues_and_resumes_exactly(campaign: Campaign) -> None:
    """`scancel --batch --signal=USR1 J` while training: forwarded to the launcher, both ranks save
    the same step, one requeue, then training finishes exactly as an uninterrupted run."""
    job = campaign.result("scancel")
    log = job.log()
    first, second = attempts(log)
    assert re.search(r"^resilience: SIGUSR1 \(received at [\d.]+\) forwarded to resilience run \(pid \d+\)", first, re.M), log
    steps = saved_steps(first)
    assert sorted(steps) == [0, 1] and len(set(steps.values())) == 1, log
    assert steps[0] >= job.signalled_at_step
    assert f"requeueing {job.id} (restart 1 " in first
    assert job.info["Restarts"] == "1"
    assert "training done; exit 0" in second
    assert_exact(job, campaign.result("ref_short"))


@pytest.mark.timeout(300)
def test_scheduler_preemption_saves_requeues_and_completes_exactly(campaign: Campaign) -> None:
    """A job in the higher-priority partition needing the whole node preempts ours: Slurm sends our
    --signal (preempt_send_user_signal), we save, requeue, and later complete exactly."""
    job = campaign.result("preempt")
    log = job.log()
    first = attempts(log)[0]
    assert re.search(r"^resilience: SIGUSR1 \(received at [\d.]+\) forwarded", first, re.M), log
    steps = saved_steps(first)
    assert sorted(steps) == [0, 1] and len(set(steps.values())) == 1, log
    assert int(job.info["Restarts"]) >= 1
    assert job.preemptor_info["JobState"] == "COMPLETED"
    assert "training done; exit 0" in attempts(log)[-1]
    assert_exact(job, campaign.result("ref_short"))


@pytest.mark.timeout(300)
def test_array_task_requeues_itself_as_array_job_id_underscore_task_id(campaign: Campaign) -> None:
    """Only the signalled task is requeued, under its `<array job id>_<task id>`; it then ends
    bitwise equal to the task that ran uninterrupted."""
    job = campaign.result("array")
    task1 = (job.dir / f"out-{job.id}_1.txt").read_text()
    assert f"requeueing {job.id}_1 (restart 1 " in task1, task1
    assert f"attempt 2 of job {job.id}_1 " in task1
    assert job.task_info[1]["Restarts"] == "1"
    assert job.task_info[0]["Restarts"] == "0"
    assert "requeueing" not in (job.dir / f"out-{job.id}_0.txt").read_text()
    comparison = runs.compare(job.dir / "task1" / "ck", job.dir / "task0" / "ck")
    assert comparison.identical, comparison


@pytest.mark.timeout(300)
def test_restart_limit_ends_the_job_with_77_without_requeue(campaign: Campaign) -> None:
    """max_restarts=1: the first stop requeues; the second exits 77 and the job stays ended."""
    job = campaign.result("limit")
    log = job.log()
    assert len(attempts(log)) == 2, log
    assert "restart limit (1) is reached: not requeued; exit 77" in attempts(log)[1]
    for info in (job.info, job.info_later):
        assert info["JobState"] == "FAILED", info
        assert info["ExitCode"] == "77:0", info
        assert info["Restarts"] == "1", info


@pytest.mark.timeout(300)
def test_no_worker_outlives_its_job(campaign: Campaign) -> None:
    """Every launcher and rank pid recorded by any finished scenario is gone when its job ends."""
    checked = 0
    for name, future in campaign.futures.items():
        if name.startswith("ref_") or name in ("id_gap", "check_probe"):
            continue
        job = future.result(timeout=280)
        pids = recorded_pids(job.dir)
        assert pids, f"{name}: no pids recorded"
        assert job.leftovers == [], f"{name}: still running when the job ended: {job.leftovers}"
        checked += len(pids)
    assert checked >= 4


@pytest.mark.timeout(300)
def test_multinode_signal_reaches_batch_node_launcher_only_and_both_nodes_stop_at_one_step(campaign: Campaign) -> None:
    """2 nodes x 1 rank: the batch shell (node n1) forwards to n1's launcher only; n2's rank stops
    at the same step through the agreement; the job restarts on both nodes and ends exactly."""
    job = campaign.result("mn_scancel")
    log = job.log()
    first, second = attempts(log)
    assert re.search(r"^resilience: SIGUSR1 \(received at [\d.]+\) forwarded to resilience run on n1 \(pid \d+\)", first, re.M), log
    assert "resilience run: forwarded SIGUSR1 to ranks [0]" in first
    assert "forwarded SIGUSR1 to ranks [1]" not in log  # n2's launcher never got a signal
    steps = saved_steps(first)
    assert sorted(steps) == [0, 1] and steps[0] == steps[1], log
    for attempt in (0, 1):
        for node in ("n1", "n2"):
            assert (job.dir / ".resilience" / f"{job.id}.{attempt}.{node}.pids").exists(), (attempt, node)
    assert "training done; exit 0" in second
    assert_exact(job, campaign.result("ref_short"))


@pytest.mark.timeout(300)
def test_multinode_signal_before_launch_is_not_lost(campaign: Campaign) -> None:
    """A signal that reaches the batch shell before any rank exists is recorded in the stop file;
    the ranks read it when they start, stop at their first agreed step, and the job requeues."""
    job = campaign.result("mn_prelaunch")
    log = job.log()
    first, second = attempts(log)
    assert re.search(r"^resilience: SIGUSR1 came before the launch", first, re.M), log
    steps = saved_steps(first)
    assert sorted(steps) == [0, 1] and steps[0] == steps[1] <= 2, log
    assert "training done; exit 0" in second
    assert not list((job.dir / ".resilience").glob("*.stop"))  # removed at each attempt's end
    assert_exact(job, campaign.result("ref_short"))


def _restarted_in_job(job: Job) -> str:
    """The log of a job whose ranks restarted in the job: one attempt, no requeue, done."""
    log = job.log()
    assert len(attempts(log)) == 1 and "requeueing" not in log, log
    assert job.info["Restarts"] == "0", job.info
    assert "training done; exit 0" in log, log
    assert job.leftovers == [], job.leftovers
    return log


@pytest.mark.timeout(300)
def test_in_job_restart_a_killed_rank_restarts_in_the_job_without_requeue_and_completes_exactly(campaign: Campaign) -> None:
    """slurm.in_job_restarts=2: rank 1 SIGKILLed mid-run is restarted by the launcher, with rank 0,
    from LATEST, in the same job (same SLURM_RESTART_COUNT), and the job ends exactly."""
    job = campaign.result("kill_in_job")
    log = _restarted_in_job(job)
    assert "rank 1 exited with signal SIGKILL; restarting every local rank from LATEST (in-job restart 1 of 2)" in log, log
    assert "in-job restart 2 of 2" not in log
    assert_exact(job, campaign.result("ref_short"))


@pytest.mark.timeout(300)
def test_multinode_in_job_restart_a_rank_killed_on_the_second_node_restarts_both_nodes_together_and_completes_exactly(
    campaign: Campaign,
) -> None:
    """2 nodes x 1 rank, slurm.in_job_restarts=1: the rank on n2 SIGKILLed mid-run; n2's launcher
    records it in the attempt's fault file, n1's launcher ends its rank (or sees it fail) and both
    restart their ranks together, without a requeue; the job ends exactly."""
    job = campaign.result("mn_kill_in_job")
    log = _restarted_in_job(job)
    assert "rank 1 exited with signal SIGKILL; restarting every local rank from LATEST (in-job restart 1 of 1)" in log, log
    assert log.count("restarting every local rank from LATEST (in-job restart 1 of 1)") == 2, log  # both nodes
    assert "fault 0 1 1 rank 1 exited with signal SIGKILL" in (job.dir / ".resilience" / f"{job.id}.0.faults").read_text()
    assert_exact(job, campaign.result("ref_short"))


@pytest.mark.timeout(300)
def test_multinode_a_rank_killed_on_the_second_node_ends_both_nodes_at_once_requeues_and_completes_exactly(campaign: Campaign) -> None:
    """2 nodes x 1 rank, no in-job restarts: the rank on n2 SIGKILLed mid-run; n2's launcher exits
    75, n1's ends its rank at once through the fault file (no collective timeout) and exits 75 too;
    the batch script requeues the whole job, which resumes and ends exactly."""
    job = campaign.result("mn_kill_requeue")
    log = job.log()
    first, second = attempts(log)
    assert "rank 1 exited with signal SIGKILL; no in-job restarts (--max-restarts 0)" in first, log
    assert "node 1's launcher: rank 1 exited with signal SIGKILL" in first, log  # n1's launcher counts n2's kill
    assert first.count("exit code 75 (requeue") == 2, log
    # both launchers ended within seconds of the kill (the ranks' collective timeout is 600 s here)
    ended = float(re.search(r"^resilience: srun of resilience run on 2 nodes .* exited with 75 at ([\d.]+)", first, re.M).group(1))
    print(f"\nn2's rank SIGKILLed after step {job.killed_at_step}; srun of both launchers ended {ended - job.killed_at:.1f} s later")
    assert ended - job.killed_at < 20, ended - job.killed_at
    assert f"requeueing {job.id} (restart 1 " in first
    assert job.info["Restarts"] == "1"
    assert "training done; exit 0" in second
    assert job.leftovers == [], job.leftovers
    assert_exact(job, campaign.result("ref_short"))


@pytest.mark.timeout(300)
def test_a_job_that_makes_no_progress_stops_requeueing_with_76(campaign: Campaign) -> None:
    """The requeue-loop guard (checkpoint.max_preemptions_without_progress, clean preemptions
    bounded apart from failed starts): a job that keeps being stopped before it can save anything
    new ends with NO_PROGRESS (76) instead of requeueing forever."""
    job = campaign.result("guard")
    log = job.log()
    assert job.info.get("ExitCode", "").startswith(f"{int(ExitCode.NO_PROGRESS)}:"), (job.info, log)
    assert job.info.get("Restarts") == "1", job.info
    assert len(attempts(log)) == 2, log
    assert "NO_PROGRESS" in log and "not requeued" in log
    assert not list(job.ckpt.glob("epoch_*")), "no attempt saved a checkpoint"


@pytest.mark.timeout(300)
def test_a_program_without_resilient_loop_gets_the_held_signal_after_the_hold_and_the_job_requeues(campaign: Campaign, capsys) -> None:
    """The batch shell used to wait for every rank to handle the signal before passing it to
    ``resilience run``: the rank trained to its end and the job completed without ever being
    stopped. Now the launcher gets it at once, holds it HOLD_S s, delivers it, exits 75 and the
    script requeues; ``resilience status`` shows the delivery."""
    job = campaign.result("held_stop")
    text = job.log()
    assert "trained to the end" not in text, text
    assert "forwarded to resilience run (pid" in text, text
    assert "warning: ranks [0] never became ready" in text and f"in the {HOLD_S} s the stop was held" in text, text
    assert "preempted (exit 75); requeueing" in text and "attempt 2 finished" in text and "training done; exit 0" in text, text
    assert job.info["Restarts"] == "1", job.info
    pids = recorded_pids(job.dir)
    assert pids and not [pid for pid in pids if pid_alive(pid) and f"SLURM_JOB_ID={job.id}".encode() in _environ(pid)], text
    capsys.readouterr()
    assert cli.main(["status", str(job.ckpt)]) == 0
    status = capsys.readouterr().out
    assert f"Stop signal held by resilience run: SIGUSR1 held {HOLD_S}" in status and "ranks [0]" in status, status


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""
