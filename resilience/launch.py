"""Local multi-rank launcher (``resilience run``): start ranks, forward signals, combine codes.

Why not ``torchrun``: Slurm delivers the preemption warning (``#SBATCH --signal=B:USR1@300``)
to the batch shell, which must pass it on to the training ranks. torchrun's agent (torch
2.13.0) dies on SIGUSR1 (rc 138) and takes its workers with it; with
``--signals-to-handle=...,SIGUSR1`` it forwards, but then exits 1 even when every worker
exits 0. This launcher records SIGUSR1, SIGUSR2, SIGTERM (and the terminal's SIGINT,
SIGHUP, SIGQUIT), forwards each one to every live rank, waits for the ranks, and exits with
their combined code (:func:`combine_exit_codes`), so a rank's ``75`` (``ExitCode.PREEMPTED``)
reaches the batch script unchanged.

Each rank gets the environment variables that ``torch.distributed`` (``env://``) and torchrun
users expect:

=========================  ==========================================================
variable                   value
=========================  ==========================================================
``RANK``                   ``node_rank * nproc_per_node + local_rank``
``LOCAL_RANK``             index of the rank on this node, ``0 .. nproc_per_node-1``
``WORLD_SIZE``             ``nnodes * nproc_per_node``
``LOCAL_WORLD_SIZE``       ``nproc_per_node``
``GROUP_RANK``             ``node_rank`` (torchrun's name)
``MASTER_ADDR``            ``master_addr`` (default ``127.0.0.1``)
``MASTER_PORT``            see :func:`resolve_master_port`
``RESILIENCE_LAUNCHER_PID``  the launcher's pid
=========================  ==========================================================

Ranks stay in the launcher's process group (no ``setsid``), so a terminal's Ctrl-C and
Slurm's process tracking treat them like any child; the launcher still forwards signals
itself because Slurm's ``B:`` signals and ``scancel --batch`` reach the batch shell only.
"""

from __future__ import annotations

import argparse
import collections
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType

from resilience.exit_codes import ExitCode
from resilience.handshake import READY_DIR_ENV, STOP_FILE_ENV, ready_marker, request_stop, stop_taken_marker

#: Signals the ``run`` command records and forwards to every live rank. USR1/USR2/TERM are
#: what Slurm sends (``--signal``, preemption, time limit, ``scancel``); INT, HUP and QUIT are
#: the terminal's, forwarded rather than left to kill the launcher and orphan its ranks
#: (torchrun handles the same last three).
FORWARDED_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
)
#: Signals that request a preemption stop: recorded in the stop file and held for ranks that
#: have not installed their handlers yet (see :meth:`RankGroup.request_stop`).
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)

# Keyboard signals: a terminal sends them to its whole foreground process group.
_KEYBOARD_SIGNALS = frozenset({signal.SIGINT, signal.SIGQUIT})

#: Seconds between two looks at the ranks while waiting (also the signal-forwarding latency
#: bound when no wakeup fd is in use).
POLL_INTERVAL_S = 0.05

#: Derived ports lie in ``[PORT_BASE, PORT_BASE + PORT_SPAN)``. Part of it overlaps Linux's
#: default ephemeral range (32768-60999), where an outgoing connection may hold the port: the
#: rendezvous then fails to bind, the run fails, and the next restart gets the next port.
PORT_BASE = 20000
PORT_SPAN = 40000
_PORTS_PER_JOB = 10

PID_FILE_ENV = "RESILIENCE_PID_FILE"

Log = Callable[[str], None]


def _stderr_log(message: str) -> None:
    print(f"resilience run: {message}", file=sys.stderr, flush=True)


def _describe(code: int) -> str:
    """``-9`` -> ``"signal SIGKILL"``, ``3`` -> ``"code 3"`` (Popen's returncode convention)."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _catches(pid: int, sig: int) -> bool | None:
    """Whether process ``pid`` has a handler for ``sig`` now (bit ``sig - 1`` of ``SigCgt`` in
    ``/proc/PID/status``, Linux); ``None`` when that cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def combine_exit_codes(codes: Sequence[int]) -> int:
    """Reduce the ranks' ``Popen.returncode`` values to the launcher's exit code.

    ``codes`` holds one ``int`` per rank, as ``subprocess.Popen.returncode`` reports it:
    ``>= 0`` is an exit status, ``-N`` means "killed by signal N".

    ======================================  ============  ======================================
    ranks' codes                            result        why
    ======================================  ============  ======================================
    all equal ``c >= 0`` (``[75, 75]``)     ``c``         the ranks agree: ``0`` done, ``75``
                                                          preempted, ``76``/``77`` stop, ...
    all ``-N``, same ``N`` (``[-15, -15]``)  ``128 + N``   the shell convention for "killed by
                                                          signal N" (``143`` for SIGTERM), what
                                                          the batch script would see running one
                                                          rank itself; never ``75``, so a
                                                          failure and never requeued
    anything else (``[0, 1]``, ``[75, 0]``,  ``1``         the ranks disagree: ``FAILED``. A
    ``[75, -9]``, ``[1, -15]``)                           partial preemption (some ranks ``75``)
                                                          is a failure, not a resumable stop.
    ======================================  ============  ======================================

    Raises ``ValueError`` for an empty ``codes`` (a group has at least one rank).
    """
    codes = list(codes)
    if not codes:
        raise ValueError("combine_exit_codes: codes must hold one exit code per rank, got []")
    first = codes[0]
    if all(code == first for code in codes):
        return 128 - first if first < 0 else first
    return int(ExitCode.FAILED)


def slurm_master_port(job_id: str | int, restart_count: str | int | None = None) -> int:
    """Rendezvous port for one run of a Slurm job: the same on every node, new on each restart.

    ``port = 20000 + (job_id mod 4000) * 10 + (restart_count mod 10)``, always in
    ``20000..59999``. Every node of a job computes the same value from ``SLURM_JOB_ID`` and
    ``SLURM_RESTART_COUNT`` (unset on a job's first run: ``None`` or ``""`` counts as 0), so no
    port exchange is needed. Consecutive job ids get blocks 10 ports apart, so jobs sharing a
    node do not collide unless their ids differ by a multiple of 4000. The restart count moves
    the port because a requeued job restarts on the same node seconds later, while the old
    rendezvous socket may still linger.

    Raises ``ValueError`` naming ``SLURM_JOB_ID``/``SLURM_RESTART_COUNT`` when either is not a
    non-negative integer.
    """
    job = _non_negative_int("SLURM_JOB_ID", job_id)
    restart = 0 if restart_count in (None, "") else _non_negative_int(
        "SLURM_RESTART_COUNT", restart_count
    )
    blocks = PORT_SPAN // _PORTS_PER_JOB
    return PORT_BASE + (job % blocks) * _PORTS_PER_JOB + restart % _PORTS_PER_JOB


def _non_negative_int(name: str, value: str | int) -> int:
    # Plain ASCII digits only: int() would also take "1_000" or " 12".
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def _free_port() -> int:
    """A port the kernel reports free right now (it can be taken before a rank binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def resolve_master_port(
    master_port: int | None, env: Mapping[str, str], nnodes: int = 1
) -> int:
    """Pick ``MASTER_PORT``: the given one, else Slurm-derived, else a free local port.

    - ``master_port`` given: used as is (``1..65535``, else ``ValueError``).
    - ``SLURM_JOB_ID`` in ``env``: :func:`slurm_master_port` of it and ``SLURM_RESTART_COUNT``.
    - otherwise, one node: a port that is free on this machine now.
    - otherwise (several nodes outside Slurm): ``ValueError``, since the nodes could not
      agree on a free port; pass ``master_port``.
    """
    if master_port is not None:
        if isinstance(master_port, bool) or not isinstance(master_port, int) or not (
            1 <= master_port <= 65535
        ):
            raise ValueError(f"master_port must be an int in 1..65535, got {master_port!r}")
        return master_port
    if env.get("SLURM_JOB_ID"):
        return slurm_master_port(env["SLURM_JOB_ID"], env.get("SLURM_RESTART_COUNT"))
    if nnodes > 1:
        raise ValueError(
            "master_port is required when nnodes > 1 outside Slurm (no SLURM_JOB_ID to derive "
            "it from): every node must use the same port"
        )
    return _free_port()


class RankGroup:
    """The ranks of one node, started by :func:`launch`; a context manager that reaps them all.

    Attributes:
        procs: one ``subprocess.Popen`` per rank; index = local rank.
        ranks: the global rank of each entry of ``procs``.
        cmd: the command every rank runs.
        failure_grace_s: seconds the other ranks may keep running after one rank exits
            non-zero (they may be finishing a collective) before they get SIGTERM.
        kill_grace_s: seconds between that SIGTERM (or :meth:`terminate`'s) and SIGKILL.

    Leaving the ``with`` block terminates (SIGTERM, then SIGKILL after ``kill_grace_s``) and
    reaps every rank still running, so none outlives the launcher.
    """

    def __init__(
        self,
        procs: Sequence[subprocess.Popen],
        ranks: Sequence[int],
        cmd: Sequence[str],
        *,
        failure_grace_s: float = 30.0,
        kill_grace_s: float = 5.0,
        log: Log | None = None,
        ready_dir: str | None = None,
        stop_file: str | None = None,
        ready_timeout_s: float = 30.0,
    ) -> None:
        self.ready_dir = ready_dir
        self.stop_file = stop_file
        self.ready_timeout_s = ready_timeout_s
        self._started_at = time.monotonic()
        self._held: dict[int, list[int]] = {}  # local rank -> stop signals held until it is ready
        self.procs = list(procs)
        self.ranks = list(ranks)
        self.cmd = list(cmd)
        self.failure_grace_s = failure_grace_s
        self.kill_grace_s = kill_grace_s
        self._log = log or (lambda message: None)
        self._failed_at: float | None = None
        self._term_sent_at: float | None = None
        self._kill_sent = False

    @property
    def pids(self) -> list[int]:
        """Process ids, index = local rank."""
        return [proc.pid for proc in self.procs]

    @property
    def returncodes(self) -> list[int | None]:
        """Each rank's ``Popen.returncode`` after a non-blocking poll (``None``: running)."""
        return [proc.poll() for proc in self.procs]

    def live_ranks(self) -> list[int]:
        """Local ranks still running."""
        return [local for local, code in enumerate(self.returncodes) if code is None]

    def send_signal(self, sig: int, ranks: Sequence[int] | None = None) -> list[int]:
        """Send ``sig`` to the given local ranks (default: all) that are still running.

        Returns the local ranks signalled. Ranks that already exited are skipped, never
        signalled (their pid may be reused). Raises ``ValueError`` for a local rank outside
        ``0 .. len(procs)-1``.
        """
        targets = range(len(self.procs)) if ranks is None else list(ranks)
        for local in targets:
            if not 0 <= local < len(self.procs):
                raise ValueError(
                    f"ranks: local rank {local} is out of range 0..{len(self.procs) - 1}"
                )
        sent = []
        for local in targets:
            proc = self.procs[local]
            if proc.poll() is not None:
                continue
            try:
                proc.send_signal(sig)
            except ProcessLookupError:  # exited between poll and kill
                continue
            sent.append(local)
        return sent

    def is_ready(self, local: int, sig: int | None = None) -> bool:
        """True when a stop signal may be sent to local rank ``local`` without killing it: it has
        installed its handlers (its ready marker exists; see :mod:`resilience.handshake`), or it
        has a handler for ``sig`` now (``SigCgt`` of ``/proc/PID/status``, as the Slurm templates
        check; a program with handlers of its own). A rank that does neither is not ready,
        however long it takes: a model that builds for minutes must not be killed by the signal
        (the stop waits in the stop file). Only where ``/proc`` cannot be read does
        ``ready_timeout_s`` after the start count as ready, so such a program still gets its signals."""
        if self.ready_dir is None or ready_marker(self.ready_dir, self.ranks[local]).exists():
            return True
        catches = _catches(self.procs[local].pid, sig) if sig is not None else None
        if catches is not None:
            return catches
        return time.monotonic() - self._started_at >= self.ready_timeout_s

    def request_stop(self, sig: int) -> tuple[list[int], list[int]]:
        """Record a stop in the stop file, then send ``sig`` to the ready ranks; hold it for the
        others until they are ready (a rank without its handler would die of it) — they read the
        stop file when they get ready. A held signal is dropped, not sent, for a rank that says
        it took the stop from the file (:func:`resilience.handshake.stop_taken_marker`).
        Returns (local ranks signalled, local ranks held)."""
        if self.stop_file is not None:
            try:
                request_stop(self.stop_file)
            except OSError as error:
                self._log(f"cannot record the stop in {self.stop_file}: {error}")
        live = self.live_ranks()
        ready = [local for local in live if self.is_ready(local, sig)]
        held = [local for local in live if local not in ready]
        for local in held:
            self._held.setdefault(local, []).append(sig)
        return self.send_signal(sig, ready) if ready else [], held

    def _release_held(self) -> None:
        for local in list(self._held):
            if self.procs[local].poll() is not None:
                del self._held[local]
            elif self.ready_dir is not None and stop_taken_marker(self.ready_dir, self.ranks[local]).exists():
                # It read the stop file when it got ready and stops for it: the held signal could
                # reach it after its loop ended, with the default disposition back, and kill it.
                del self._held[local]
            elif all(self.is_ready(local, sig) for sig in self._held[local]):
                for sig in self._held.pop(local):
                    self.send_signal(sig, [local])

    def poll(self) -> int | None:
        """Non-blocking: the group exit code once every rank has exited, else ``None``.

        Also drives the failure policy: the first time a rank is seen with a non-zero code
        while others run, a ``failure_grace_s`` timer starts; when it expires the live ranks
        get SIGTERM, and ``kill_grace_s`` later SIGKILL, so a crash never leaves the group
        hanging in a collective forever.
        """
        if self._held:
            self._release_held()
        codes = self.returncodes
        if None not in codes:
            return combine_exit_codes(codes)  # type: ignore[arg-type]
        now = time.monotonic()
        if self._failed_at is None:
            failed = [(local, code) for local, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                self._failed_at = now
                local, code = failed[0]
                self._log(
                    f"rank {self.ranks[local]} exited with {_describe(code)}; waiting up to "
                    f"{self.failure_grace_s:g} s for the other ranks"
                )
        elif self._term_sent_at is None:
            if now - self._failed_at >= self.failure_grace_s:
                sent = self.send_signal(signal.SIGTERM)
                self._term_sent_at = now
                self._log(
                    f"failure grace of {self.failure_grace_s:g} s expired; sent SIGTERM to "
                    f"ranks {self._global(sent)}"
                )
        elif not self._kill_sent and now - self._term_sent_at >= self.kill_grace_s:
            sent = self.send_signal(signal.SIGKILL)
            self._kill_sent = True
            self._log(
                f"ranks {self._global(sent)} still running {self.kill_grace_s:g} s after "
                f"SIGTERM; sent SIGKILL"
            )
        return None

    def wait(self, timeout: float | None = None) -> int:
        """Block until every rank has exited; return :func:`combine_exit_codes` of their codes.

        ``timeout`` is in seconds (``None``: no limit); when it passes first,
        ``subprocess.TimeoutExpired`` is raised and the ranks keep running. The failure grace
        of :meth:`poll` applies while waiting.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None:
                return code
            pause = POLL_INTERVAL_S
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise subprocess.TimeoutExpired(self.cmd, timeout)  # type: ignore[arg-type]
                pause = min(pause, remaining)
            time.sleep(pause)

    def terminate(self, grace_s: float | None = None) -> int:
        """SIGTERM every live rank, SIGKILL those left after ``grace_s`` seconds, reap all.

        ``grace_s`` defaults to ``kill_grace_s``. Returns the group exit code (ranks ended by
        the SIGTERM count as killed by signal 15, see :func:`combine_exit_codes`).
        """
        grace_s = self.kill_grace_s if grace_s is None else grace_s
        self.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if self.send_signal(signal.SIGKILL):
            for proc in self.procs:
                proc.wait()
        return combine_exit_codes([proc.wait() for proc in self.procs])

    def close(self) -> None:
        """Terminate (see :meth:`terminate`) and reap every rank still running; idempotent."""
        live = self.live_ranks()
        if live:
            self._log(f"stopping ranks {self._global(live)} still running at launcher exit")
            self.terminate()
        for proc in self.procs:
            proc.wait()
        if self.ready_dir is not None:
            shutil.rmtree(self.ready_dir, ignore_errors=True)

    def write_pid_file(self, path: str | os.PathLike[str]) -> None:
        """Write ``launcher <pid>`` then ``rank <global rank> <pid>`` lines to ``path``.

        The file is replaced atomically (temp file + ``os.replace``), so a reader never sees
        half of it. Tests and batch templates read it to prove no rank outlives its job.
        """
        lines = [f"launcher {os.getpid()}"]
        lines += [f"rank {rank} {proc.pid}" for rank, proc in zip(self.ranks, self.procs)]
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".pids.", dir=directory)
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write("\n".join(lines) + "\n")
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    def _global(self, local_ranks: Sequence[int]) -> list[int]:
        return [self.ranks[local] for local in local_ranks]

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def launch(
    cmd: Sequence[str],
    nproc_per_node: int,
    *,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    env: Mapping[str, str] | None = None,
    node_rank: int = 0,
    nnodes: int = 1,
    failure_grace_s: float = 30.0,
    kill_grace_s: float = 5.0,
    log: Log | None = None,
) -> RankGroup:
    """Start ``nproc_per_node`` processes running ``cmd``, one per local rank.

    Args:
        cmd: the full command, e.g. ``[sys.executable, "train.py", "--lr", "0.1"]``.
        nproc_per_node: ranks on this node (``>= 1``).
        master_addr: ``MASTER_ADDR`` for every rank (the rendezvous host).
        master_port: ``MASTER_PORT``; ``None`` picks one with :func:`resolve_master_port`.
        env: variables added to (overriding) ``os.environ`` for every rank; the per-rank
            variables of the module docstring are set last and win.
        node_rank: this node's index, ``0 .. nnodes-1``.
        nnodes: number of nodes, each running its own launcher.
        failure_grace_s: see :class:`RankGroup` (seconds).
        kill_grace_s: see :class:`RankGroup` (seconds).
        log: called with one line per notable event (failure grace, kills); default silent.

    Ranks inherit stdin/stdout/stderr and the launcher's process group. Returns the
    :class:`RankGroup`; use it as a context manager so no rank outlives the caller.

    Raises:
        ValueError: a bad argument (named in the message), or no way to pick a port.
        OSError: ``cmd[0]`` cannot be executed; ranks already started are killed first.
    """
    if isinstance(cmd, (str, bytes)) or not cmd or not all(isinstance(a, str) for a in cmd):
        raise ValueError(f"cmd must be a non-empty list of str, got {cmd!r}")
    _check_int("nproc_per_node", nproc_per_node, 1)
    _check_int("nnodes", nnodes, 1)
    _check_int("node_rank", node_rank, 0)
    if node_rank >= nnodes:
        raise ValueError(f"node_rank must be in 0..nnodes-1 = 0..{nnodes - 1}, got {node_rank}")
    failure_grace_s = _check_seconds("failure_grace_s", failure_grace_s)
    kill_grace_s = _check_seconds("kill_grace_s", kill_grace_s)

    base = dict(os.environ)
    base.update(env or {})
    port = resolve_master_port(master_port, base, nnodes)
    ranks = [node_rank * nproc_per_node + local for local in range(nproc_per_node)]
    # Handshake files (resilience.handshake): a batch script's stop file wins over our own.
    ready_dir = tempfile.mkdtemp(prefix="resilience-ranks-")
    stop_file = base.get(STOP_FILE_ENV) or os.path.join(ready_dir, "stop")
    procs: list[subprocess.Popen] = []
    try:
        for local, rank in enumerate(ranks):
            rank_env = dict(base)
            rank_env.update(
                RANK=str(rank),
                LOCAL_RANK=str(local),
                WORLD_SIZE=str(nnodes * nproc_per_node),
                LOCAL_WORLD_SIZE=str(nproc_per_node),
                GROUP_RANK=str(node_rank),
                MASTER_ADDR=master_addr,
                MASTER_PORT=str(port),
                RESILIENCE_LAUNCHER_PID=str(os.getpid()),
            )
            rank_env[READY_DIR_ENV] = ready_dir
            rank_env[STOP_FILE_ENV] = stop_file
            procs.append(subprocess.Popen(list(cmd), env=rank_env))
    except BaseException:
        for proc in procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(ready_dir, ignore_errors=True)
        raise
    return RankGroup(
        procs,
        ranks,
        cmd,
        failure_grace_s=failure_grace_s,
        kill_grace_s=kill_grace_s,
        log=log,
        ready_dir=ready_dir,
        stop_file=stop_file,
    )


class _RecordedSignals:
    """Scoped handlers that only record signal numbers; :meth:`take` waits for and drains them.

    Not :class:`resilience.signals.SignalRecorder`: that one chains to the previous Python
    handler (SIGINT's raises ``KeyboardInterrupt``) and has no wakeup; the launcher must
    replace every disposition, and forward at once.

    A handler appends to a deque and returns. ``signal.set_wakeup_fd`` makes the C-level
    handler write a byte to a socket, so :meth:`take` wakes at once instead of at the next
    poll. Leaving the ``with`` block restores the previous handlers and wakeup fd. Must be
    entered from the main thread (``signal.signal``'s rule; ``ValueError`` otherwise).
    """

    def __init__(self, signals: Sequence[int]) -> None:
        self._signals = list(signals)
        self._pending: collections.deque[int] = collections.deque()
        self._previous: dict[int, object] = {}
        self._previous_wakeup_fd = -1
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None

    def _record(self, signum: int, frame: object) -> None:
        self._pending.append(signum)

    def __enter__(self) -> _RecordedSignals:
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        try:
            self._previous_wakeup_fd = signal.set_wakeup_fd(
                self._writer.fileno(), warn_on_full_buffer=False
            )
            for signum in self._signals:
                self._previous[signum] = signal.signal(signum, self._record)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def take(self, timeout: float) -> list[int]:
        """Signals recorded so far, oldest first; waits up to ``timeout`` seconds for one."""
        if not self._pending and self._reader is not None:
            select.select([self._reader], [], [], timeout)
        if self._reader is not None:
            try:
                while self._reader.recv(512):
                    pass
            except BlockingIOError:
                pass
        taken = []
        while self._pending:
            taken.append(self._pending.popleft())
        return taken

    def __exit__(self, *exc_info: object) -> None:
        for signum, previous in reversed(list(self._previous.items())):
            signal.signal(signum, previous)  # type: ignore[arg-type]
        self._previous.clear()
        if self._writer is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            self._writer.close()
            self._writer = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def _terminal_already_delivered(signum: int) -> bool:
    """True for SIGINT/SIGQUIT while we are the terminal's foreground process group.

    Ctrl-C (Ctrl-backslash) at a terminal sends SIGINT (SIGQUIT) to the whole foreground
    process group, ranks included (they share our group). Forwarding it again would hit each
    rank twice, e.g. a second ``KeyboardInterrupt`` in the middle of the first one's cleanup.
    A ``kill -INT`` while we are in the foreground is then not forwarded either (the log
    says so); without a controlling terminal (Slurm, nohup, setsid) every one is forwarded.
    """
    if signum not in _KEYBOARD_SIGNALS:
        return False
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:  # no controlling terminal: the SIGINT came from kill/scancel
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``run`` command's options to ``parser`` (used by ``resilience run``)."""
    parser.add_argument(
        "--nproc-per-node", "--nproc_per_node", type=int, required=True, metavar="N",
        help="ranks to start on this node",
    )
    parser.add_argument("--nnodes", type=int, default=1, metavar="N",
                        help="number of nodes, one launcher each (default 1)")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0, metavar="R",
                        help="this node's index, 0..nnodes-1 (default 0)")
    parser.add_argument("--master-addr", "--master_addr", default="127.0.0.1", metavar="HOST",
                        help="rendezvous host, MASTER_ADDR (default 127.0.0.1)")
    parser.add_argument(
        "--master-port", "--master_port", type=int, default=None, metavar="P",
        help="rendezvous port, MASTER_PORT (default: derived from SLURM_JOB_ID and "
        "SLURM_RESTART_COUNT inside Slurm, else a free local port)",
    )
    parser.add_argument(
        "--failure-grace", type=float, default=30.0, metavar="S",
        help="seconds the other ranks may run after one exits non-zero, before SIGTERM "
        "(default 30)",
    )
    parser.add_argument("--kill-grace", type=float, default=5.0, metavar="S",
                        help="seconds between SIGTERM and SIGKILL (default 5)")
    parser.add_argument(
        "--pid-file", default=None, metavar="PATH",
        help=f"write 'launcher <pid>' and 'rank <r> <pid>' lines here (default: ${PID_FILE_ENV})",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("-m", "--module", action="store_true",
                      help="run the target as a Python module, like python -m")
    mode.add_argument("--no-python", action="store_true",
                      help="run the target as an executable, not with this Python")
    parser.add_argument("script", metavar="script.py|module|program",
                        help="what each rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...",
                        help="arguments passed to every rank")
    return parser


def _rank_command(args: argparse.Namespace) -> list[str]:
    # -u like torchrun: ranks' output reaches the Slurm log as it happens.
    if args.module:
        return [sys.executable, "-u", "-m", args.script, *args.script_args]
    if args.no_python:
        return [args.script, *args.script_args]
    return [sys.executable, "-u", args.script, *args.script_args]


def run(args: argparse.Namespace) -> int:
    """Run parsed ``resilience run`` arguments (see :func:`add_arguments`); return the exit code.

    Installs record-only handlers for :data:`FORWARDED_SIGNALS` before starting the ranks,
    forwards each recorded signal to every live rank from this (main) thread, logging one
    line per signal to stderr, waits for the ranks and returns :func:`combine_exit_codes` of
    their codes. Returns ``ExitCode.CONFIG_ERROR`` (2) for bad arguments or a program that
    cannot be started. Handlers are restored before returning.
    """
    pid_file = args.pid_file or os.environ.get(PID_FILE_ENV)
    cmd = _rank_command(args)
    with _RecordedSignals(FORWARDED_SIGNALS) as recorded:
        try:
            group = launch(
                cmd,
                args.nproc_per_node,
                master_addr=args.master_addr,
                master_port=args.master_port,
                node_rank=args.node_rank,
                nnodes=args.nnodes,
                failure_grace_s=args.failure_grace,
                kill_grace_s=args.kill_grace,
                log=_stderr_log,
            )
        except (ValueError, OSError) as error:
            _stderr_log(f"error: {error}")
            return int(ExitCode.CONFIG_ERROR)
        with group:
            if pid_file:
                try:
                    group.write_pid_file(pid_file)
                except OSError as error:
                    _stderr_log(f"error: cannot write the pid file {pid_file!r}: {error}")
                    return int(ExitCode.CONFIG_ERROR)  # leaving `with group` stops the ranks
            code = None
            while code is None:
                for signum in recorded.take(POLL_INTERVAL_S):
                    _forward(group, signum)
                code = group.poll()
        codes = [proc.returncode for proc in group.procs]
    _stderr_log(f"ranks exited with {codes}; exit code {code}")
    return code


def _forward(group: RankGroup, signum: int) -> None:
    name = signal.Signals(signum).name
    if _terminal_already_delivered(signum):
        _stderr_log(f"{name} from the terminal already reached the ranks; not forwarded")
        return
    if signum in STOP_SIGNALS:
        sent, held = group.request_stop(signum)
        if held:
            _stderr_log(f"{name}: ranks {[group.ranks[local] for local in held]} are not ready yet; "
                        "recorded a pending stop and holding the signal for them")
    else:
        sent = group.send_signal(signum)
    if sent:
        _stderr_log(f"forwarded {name} to ranks {[group.ranks[local] for local in sent]}")
    else:
        _stderr_log(f"received {name}; no rank left running to forward it to")


def main(argv: Sequence[str] | None = None) -> int:
    """``resilience run`` on its own: parse ``argv`` (default ``sys.argv[1:]``) and :func:`run`."""
    parser = add_arguments(
        argparse.ArgumentParser(
            prog="resilience run",
            description="Start local ranks, forward signals to them, exit with their code.",
        )
    )
    return run(parser.parse_args(argv))
