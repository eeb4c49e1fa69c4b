"""A throwaway local Slurm cluster for tests: start it with slurm/up.sh, stop it with slurm/down.sh.

Not a conftest: import what you need, e.g. in conftest.py
``from slurm_cluster import slurm_cluster, slurm_cluster_2nodes`` (both session-scoped fixtures).

The cluster is real (munged, slurmctld, one or two slurmd on this host) and needs root; Debian's
packages are installed on first use. Where that is impossible the fixtures skip the test,
except under ``CI=true``, where a missing cluster is a failure.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SLURM_SCRIPTS = REPO_ROOT / "slurm"

# up.sh exit status meaning "this machine cannot run a cluster" (not root, packages missing and
# not installable) as opposed to 1, "the bring-up itself failed".
_UP_RC_UNAVAILABLE = 3

# Job states after which a job will not run again by itself (Slurm `squeue(1)` JOB STATE CODES).
TERMINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)


class ClusterUnavailable(RuntimeError):
    """This machine cannot run a local cluster (not root, no apt-get, package install failed)."""


class ClusterStartError(RuntimeError):
    """slurm/up.sh could run here but the cluster did not come up; a bug, not an environment gap."""


class SlurmCommandError(subprocess.CalledProcessError):
    """A Slurm client command exited non-zero; str() includes its stdout and stderr."""

    def __str__(self) -> str:
        return f"{shlex.join(map(str, self.cmd))} exited {self.returncode}\nstdout: {self.stdout!r}\nstderr: {self.stderr!r}"


def wait_for(predicate: Callable[[], object], timeout: float, what: str, detail: Callable[[], str] = lambda: "", poll: float = 0.1) -> object:
    """Poll ``predicate`` every ``poll`` s until it returns something true, and return that.

    Raises TimeoutError naming ``what`` (and ``detail()``, e.g. a log) after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout} s\n{detail()}")
        time.sleep(poll)


def parse_exports(text: str, base_env: dict[str, str] | None = None) -> dict[str, str]:
    """Parse up.sh's stdout (``export NAME=VALUE`` lines) into a dict.

    Values are shell-unquoted; ``$PATH`` / ``${PATH}`` inside a value expand to base_env's PATH
    (default os.environ), the only expansion up.sh emits. Raises ValueError on any other line,
    since up.sh promises to print nothing else on stdout.
    """
    base = dict(os.environ if base_env is None else base_env)
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        words = shlex.split(line)
        if len(words) != 2 or words[0] != "export" or "=" not in words[1]:
            raise ValueError(f"unexpected line in slurm/up.sh output: {line!r}")
        name, value = words[1].split("=", 1)
        path = base.get("PATH", "")
        out[name] = value.replace("${PATH}", path).replace("$PATH", path)
    return out


def pid_alive(pid: int) -> bool:
    """True when pid is a live process; a zombie (already exited, not yet reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    m = re.search(r"^State:\s+(\S)", status, re.M)
    return bool(m) and m.group(1) not in ("Z", "X")


def parse_scontrol_record(line: str) -> dict[str, str]:
    """Parse one ``scontrol show ... -o`` line (``Key=Value`` fields) into a dict.

    Fields are split at whitespace followed by ``Key=``, so values may hold spaces or '='
    (``TRES=cpu=1,node=1``); keys contain letters, digits, '_', ':' and '/' (``ReqB:S:C:T``).
    """
    fields = re.split(r"\s+(?=[A-Za-z][\w:/]*=)", line.strip())
    out: dict[str, str] = {}
    for f in fields:
        if "=" in f:
            k, v = f.split("=", 1)
            out[k] = v
    return out


class SlurmCluster:
    """A running local cluster started by slurm/up.sh.

    Attributes:
        dir: the cluster's state directory (slurm.conf, logs, pid files, bin/sacct).
        nodes: node names, ``["localhost"]`` or ``["n1", "n2"]``.
        env: environment for subprocesses: os.environ at start plus SLURM_CONF,
            RESILIENCE_SLURM_DIR, RESILIENCE_SLURM_NODES and PATH with dir/bin first.
    """

    def __init__(self, env: dict[str, str]):
        try:
            self.dir = Path(env["RESILIENCE_SLURM_DIR"])
            self.conf = Path(env["SLURM_CONF"])
            self.nodes = env["RESILIENCE_SLURM_NODES"].split(",")
        except KeyError as e:
            raise ClusterStartError(f"slurm/up.sh did not export {e.args[0]}") from None
        self.env = env
        self._stopped = False

    def __repr__(self) -> str:
        return f"SlurmCluster(dir={str(self.dir)!r}, nodes={self.nodes!r})"

    def run(self, args: Iterable[str], *, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """subprocess.run a Slurm client command (``["squeue", "-h"]``) with this cluster's env.

        Output is captured as text unless overridden in kw. Raises SlurmCommandError when
        check and the exit status is non-zero, subprocess.TimeoutExpired after timeout seconds.
        """
        args = [str(a) for a in args]
        kw.setdefault("env", self.env)
        kw.setdefault("text", True)
        if "stdout" not in kw and "stderr" not in kw:
            kw.setdefault("capture_output", True)
        proc = subprocess.run(args, timeout=timeout, **kw)
        if check and proc.returncode != 0:
            raise SlurmCommandError(proc.returncode, args, proc.stdout, proc.stderr)
        return proc

    def sbatch(
        self,
        script_path: str | os.PathLike,
        *sbatch_args: str,
        script_args: Iterable[str] = (),
        **kw,
    ) -> str:
        """Submit a batch script; return its job id (a string, as Slurm ids may be ``12_3``).

        sbatch_args are sbatch options placed before the script (``"-o", out, "--requeue"``);
        script_args follow the script. kw goes to run() (e.g. cwd). Raises SlurmCommandError
        when sbatch refuses the job.
        """
        proc = self.run(["sbatch", "--parsable", *sbatch_args, str(script_path), *script_args], **kw)
        # --parsable prints "jobid" or "jobid;cluster".
        job_id = proc.stdout.strip().split(";", 1)[0]
        if not job_id:
            raise SlurmCommandError(proc.returncode, proc.args, proc.stdout, proc.stderr)
        return job_id

    def job_info(self, job_id: str | int) -> dict[str, str]:
        """``scontrol show job -o JOB`` as a dict (``JobState``, ``Restarts``, ``ExitCode``, ...).

        slurmctld forgets a job MinJobAge=60 s after it ends; then the job's last record in the
        job completion log (log/jobcomp.txt, same ``Key=Value`` form, fewer keys: no
        ``Restarts``) stands in, so a caller that polls late still sees how the job ended.
        Returns {} when neither knows the job.
        """
        proc = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        if proc.returncode == 0 and proc.stdout.strip():
            return parse_scontrol_record(proc.stdout.splitlines()[0])
        return self.completion_record(job_id)

    def completion_record(self, job_id: str | int) -> dict[str, str]:
        """The job's last line in log/jobcomp.txt (written as each run of it ends) as a dict; {}
        when there is none."""
        try:
            lines = (self.dir / "log" / "jobcomp.txt").read_text().splitlines()
        except FileNotFoundError:
            return {}
        prefix = f"JobId={job_id} "
        ended = [line for line in lines if line.startswith(prefix)]
        return parse_scontrol_record(ended[-1]) if ended else {}

    def wait_state(
        self,
        job_id: str | int,
        states: str | Iterable[str],
        timeout: float = 30,
        *,
        poll_s: float = 0.2,
    ) -> dict[str, str]:
        """Poll until the job's JobState is one of states; return its job_info().

        Raises TimeoutError after timeout seconds, and RuntimeError as soon as the job reaches a
        terminal state (TERMINAL_STATES) that is not wanted, so a failed job fails fast. Both
        messages carry the last job_info().
        """
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while True:
            info = self.job_info(job_id)
            state = info.get("JobState", "")
            if state in wanted:
                return info
            if state in TERMINAL_STATES:
                raise RuntimeError(f"job {job_id} ended {state}, wanted {sorted(wanted)}: {info}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} not in {sorted(wanted)} after {timeout} s (state {state or 'unknown'}): {info}")
            time.sleep(poll_s)

    def daemon_pids(self) -> dict[str, int]:
        """PIDs of this cluster's daemons from their pid files: ``munged``, ``slurmctld``,
        ``slurmd-<node>``. A daemon without a readable pid file is left out."""
        files = {
            "munged": self.dir / "munge" / "munged.pid",
            "slurmctld": self.dir / "run" / "slurmctld.pid",
        }
        for n in self.nodes:
            files[f"slurmd-{n}"] = self.dir / "run" / f"slurmd-{n}.pid"
        out: dict[str, int] = {}
        for name, f in files.items():
            try:
                out[name] = int(f.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass
        return out

    def stop(self, keep: bool = False, timeout: float = 60) -> None:
        """Cancel all jobs and stop the daemons (slurm/down.sh); delete dir unless keep.

        Idempotent. Raises RuntimeError when down.sh reports a daemon that survived SIGKILL.
        """
        if self._stopped:
            return
        cmd = ["bash", str(SLURM_SCRIPTS / "down.sh"), *(["--keep"] if keep else []), str(self.dir)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        self._stopped = True
        if proc.returncode != 0:
            raise RuntimeError(f"slurm/down.sh {self.dir} exited {proc.returncode}: {proc.stderr}")


def start_cluster(nodes: int = 1, dir: str | os.PathLike | None = None, timeout: float = 300) -> SlurmCluster:
    """Start a local cluster with slurm/up.sh and return it; the caller must stop() it.

    nodes: 1 (node ``localhost``) or 2 (``n1``, ``n2``). dir: state directory (default: fresh
    temp dir). timeout: seconds for up.sh, which may first apt-get install the packages.
    Raises ValueError for other node counts, ClusterUnavailable when this machine cannot run a
    cluster (not root, no apt-get, install failed), ClusterStartError when the bring-up failed.
    """
    if nodes not in (1, 2):
        raise ValueError(f"nodes must be 1 or 2, got {nodes!r}")
    if os.name != "posix" or os.geteuid() != 0:
        raise ClusterUnavailable("a local Slurm cluster needs root (slurm/up.sh)")
    cmd = ["bash", str(SLURM_SCRIPTS / "up.sh"), "--nodes", str(nodes)]
    if dir is not None:
        cmd += ["--dir", str(dir)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise ClusterUnavailable(f"cannot run slurm/up.sh: {e}") from None
    except subprocess.TimeoutExpired as e:
        raise ClusterStartError(f"slurm/up.sh took over {timeout} s; stderr: {e.stderr!r}") from e
    if proc.returncode == _UP_RC_UNAVAILABLE:
        raise ClusterUnavailable(f"slurm/up.sh: cannot run a cluster here: {proc.stderr.strip()}")
    if proc.returncode != 0:
        raise ClusterStartError(f"slurm/up.sh exited {proc.returncode}:\n{proc.stderr}")
    try:
        env = parse_exports(proc.stdout)
    except ValueError as e:
        # The daemons are running: stop them before failing, if the directory can be found.
        m = re.search(r"^export RESILIENCE_SLURM_DIR=(\S+)$", proc.stdout, re.M)
        if m:
            subprocess.run(
                ["bash", str(SLURM_SCRIPTS / "down.sh"), shlex.split(m.group(1))[0]],
                capture_output=True,
                timeout=60,
            )
        raise ClusterStartError(str(e)) from None
    return SlurmCluster({**os.environ, **env})


def cluster_or_skip(nodes: int = 1) -> SlurmCluster:
    """start_cluster(nodes), or pytest.skip when this machine cannot run a cluster.

    With env CI=true a missing cluster fails the test instead (CI must run the Slurm tests).
    A bring-up failure on a capable machine (ClusterStartError) always fails.
    """
    try:
        return start_cluster(nodes)
    except ClusterUnavailable as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but no local Slurm cluster: {e}")
        pytest.skip(f"no local Slurm cluster: {e}")
    except ClusterStartError as e:
        pytest.fail(f"local Slurm cluster failed to start: {e}")


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A one-node cluster (node ``localhost``, CPUs=8, partitions debug/high) for the session."""
    cluster = cluster_or_skip(1)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def slurm_cluster_2nodes() -> Iterator[SlurmCluster]:
    """A two-node cluster (``n1``, ``n2`` at 127.0.1.1/2, CPUs=8 each) for the session."""
    cluster = cluster_or_skip(2)
    try:
        yield cluster
    finally:
        cluster.stop()
