"""One node's running ranks: stop requests held until a rank is ready (:mod:`~resilience.launch.held_stops`),
the failure grace, reaping."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from types import TracebackType

from resilience.exit_codes import ExitCode
from resilience.launch.exit_status import combine_exit_codes, describe_code
from resilience.launch.held_stops import DEFAULT_HOLD_TIMEOUT_S, catches
from resilience.progress import progress_file, read_report
from resilience.stop.handshake import ready_marker, request_stop, stop_taken_marker

#: Seconds between two looks at the ranks while waiting (also the signal-forwarding latency
#: bound when no wakeup fd is in use).
POLL_INTERVAL_S = 0.05

Log = Callable[[str], None]
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
"""Signals that ask the ranks to stop (Slurm's ``--signal`` choices and scancel's default)."""
_ORDERLY_STOPS = (ExitCode.PREEMPTED, ExitCode.NO_PROGRESS, ExitCode.RESTART_LIMIT)


class RankGroup:
    """The ranks of one node, started by :func:`launch`; a context manager that reaps them all.

    Attributes:
        procs: one ``subprocess.Popen`` per rank; index = local rank.
        ranks: the global rank of each entry of ``procs``.
        cmd: the command every rank runs.
        failure_grace_s: seconds the other ranks may keep running after one rank exits
            non-zero (they may be finishing a collective) before they get SIGTERM.
        kill_grace_s: seconds between that SIGTERM (or :meth:`terminate`'s) and SIGKILL.
        hold_timeout_s: seconds a stop signal is held for a rank that is not ready (see
            :meth:`request_stop`) before it is sent anyway (:data:`DEFAULT_HOLD_TIMEOUT_S`).

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
        hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S,
    ) -> None:
        self.ready_dir = ready_dir
        self.stop_file = stop_file
        self.ready_timeout_s = ready_timeout_s
        self._started_at = time.monotonic()
        self._held: dict[int, list[int]] = {}  # local rank -> stop signals held until it is ready
        self._held_ever: dict[int, set[int]] = {}  # local rank -> every stop signal it was not ready for
        self.hold_timeout_s = hold_timeout_s
        self._held_at: dict[int, float] = {}  # local rank -> when its first held signal came
        self.delivered_after_hold: list[dict] = []
        """One entry per delivery after the hold timeout: ``signals`` (names), ``ranks`` (global),
        ``held_s`` (seconds held), ``at`` (Unix time of the delivery)."""
        self.procs = list(procs)
        self.ranks = list(ranks)
        self.cmd = list(cmd)
        self.failure_grace_s = failure_grace_s
        self.kill_grace_s = kill_grace_s
        self._log = log or (lambda message: None)
        self._failed_at: float | None = None
        self.first_failure: tuple[int, int] | None = None
        """(local rank, ``Popen.returncode``) of the first rank seen exiting non-zero while others ran."""
        self.before_term: Callable[[], object] | None = None  # its result is ignored
        """Called right before the failure grace's SIGTERM (``resilience run`` prints the stacks there)."""
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
                raise ValueError(f"ranks: local rank {local} is out of range 0..{len(self.procs) - 1}")
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
        installed its handlers (its ready marker exists; see :mod:`resilience.stop.handshake`), or it
        has a handler for ``sig`` now (``SigCgt`` of ``/proc/PID/status``, as the Slurm templates
        check; a program with handlers of its own). A rank that does neither is not ready,
        however long it takes: a model that builds for minutes must not be killed by the signal
        (the stop waits in the stop file). Only where ``/proc`` cannot be read does
        ``ready_timeout_s`` after the start count as ready, so such a program still gets its signals."""
        if self.ready_dir is None or ready_marker(self.ready_dir, self.ranks[local]).exists():
            return True
        handled = catches(self.procs[local].pid, sig) if sig is not None else None
        if handled is not None:
            return handled
        return time.monotonic() - self._started_at >= self.ready_timeout_s

    def request_stop(self, sig: int) -> tuple[list[int], list[int]]:
        """Record a stop in the stop file, then send ``sig`` to the ready ranks; hold it for the
        others until they are ready (a rank without its handler would die of it) — they read the
        stop file when they get ready. A signal, held or new, is dropped, not sent, for a rank that
        says it took the stop from the file (:func:`resilience.stop.handshake.stop_taken_marker`).
        A rank still not ready ``hold_timeout_s`` after its first held signal gets them all then
        (a program without ``resilient_loop()`` never gets ready), with a warning naming it.
        Returns (local ranks signalled, local ranks held)."""
        if self.stop_file is not None:
            try:
                request_stop(self.stop_file)
            except OSError as error:
                self._log(f"cannot record the stop in {self.stop_file}: {error}")
        live = self.live_ranks()
        # a rank that already died without its ready marker may have died of this very signal,
        # sent to the whole process group before the launcher's handler ran
        for local in range(len(self.procs)):
            if local not in live and self.ready_dir is not None and not ready_marker(self.ready_dir, self.ranks[local]).exists():
                self._held_ever.setdefault(local, set()).add(sig)
        ready = [local for local in live if self.is_ready(local, sig)]
        held = [local for local in live if local not in ready]
        finished = [local for local in ready if self.loop_ended(local)]
        if finished:
            self._log(
                f"ranks {[self.ranks[local] for local in finished]} have finished their training loop: "
                f"{signal.Signals(sig).name} not sent to them (nothing is left to stop, and it would end "
                "the work they do after it)"
            )
            ready = [local for local in ready if local not in finished]
        # A rank that found the stop file when it got ready stops already (the batch templates
        # pass on a signal that came before the launch once the launcher runs): no second one.
        taken = [local for local in ready if self._took_stop(local)]
        if taken:
            self._log(f"ranks {self._global(taken)} took the stop from the stop file already: {signal.Signals(sig).name} not sent to them")
            ready = [local for local in ready if local not in taken]
        for local in held:
            self._held.setdefault(local, []).append(sig)
            self._held_at.setdefault(local, time.monotonic())
            self._held_ever.setdefault(local, set()).add(sig)
        sent = []
        for local in ready:
            stop_sig = self._stop_signal_for(local, sig)
            if stop_sig != sig:
                self._log(
                    f"rank {self.ranks[local]} does not handle {signal.Signals(sig).name} (not in its "
                    f"preemption_signal): sending {signal.Signals(stop_sig).name}, which it does"
                )
            sent += self.send_signal(stop_sig, [local])
        return sent, held

    def loop_ended(self, local: int) -> bool:
        """True when local rank ``local`` reported ``done`` (:mod:`resilience.progress`): its
        ``resilient_loop`` is over and has put back the signal handlers it found, so a stop signal
        there would only kill what the program does after training (an evaluation, an export),
        turning a finished job into a failed one. False without a readable record."""
        if self.ready_dir is None:
            return False
        report = read_report(progress_file(self.ready_dir, self.ranks[local]))
        return report is not None and report.phase == "done"

    def _stop_signal_for(self, local: int, sig: int) -> int:
        """The stop signal to send a ready rank for ``sig``: ``sig`` itself, unless the rank does
        not handle it but handles another stop signal (every one asks for the same stop, and
        ``sig`` would kill it). A program that handles none of them gets ``sig``, as without us."""
        pid = self.procs[local].pid
        if catches(pid, sig) is not False:
            return sig
        return next((alt for alt in STOP_SIGNALS if catches(pid, alt)), sig)

    def _took_stop(self, local: int) -> bool:
        """Local rank ``local`` found the stop file when it got ready and acts on it (its
        :func:`~resilience.stop.handshake.stop_taken_marker` exists)."""
        return self.ready_dir is not None and stop_taken_marker(self.ready_dir, self.ranks[local]).exists()

    def _release_held(self) -> None:
        expired = []
        for local in list(self._held):
            if self.procs[local].poll() is not None:
                del self._held[local]
            elif self._took_stop(local):
                # It read the stop file when it got ready and stops for it: the held signal could
                # reach it after its loop ended, with the default disposition back, and kill it.
                del self._held[local]
            elif all(self.is_ready(local, sig) for sig in self._held[local]):
                for sig in self._held.pop(local):
                    self.send_signal(sig, [local])
            elif time.monotonic() - self._held_at[local] >= self.hold_timeout_s:
                expired.append(local)
        if expired:
            self._deliver_after_hold(expired)

    def _deliver_after_hold(self, expired: Sequence[int]) -> None:
        """Send their held signals to the local ranks ``expired``, not ready ``hold_timeout_s`` after
        the first: better their own handler, or the default action, than none before the job ends."""
        names = sorted({signal.Signals(sig).name for local in expired for sig in self._held[local]})
        held_s = time.monotonic() - min(self._held_at[local] for local in expired)
        self._log(
            f"warning: ranks {self._global(expired)} never became ready (no ready marker from resilient_loop(), no handler "
            f"for {', '.join(names)}) in the {self.hold_timeout_s:g} s the stop was held for them (--signal-hold-timeout): "
            "delivering it now, so their own handler or the default action (terminate) runs"
        )
        for local in expired:
            for sig in self._held.pop(local):
                self.send_signal(sig, [local])
        self.delivered_after_hold.append({"signals": names, "ranks": self._global(expired), "held_s": round(held_s, 1), "at": time.time()})

    def _stopped_before_ready(self, codes: Sequence[int | None]) -> bool:
        """True when the run is a stop (``PREEMPTED``, requeue), not a failure: every rank died of a stop signal
        this launcher recorded while the rank was not ready (it reached the rank directly too, sent to the process
        group as Slurm and ``kill -- -PGID`` do, before its handlers existed: nothing trained past ``LATEST``); or,
        after a delivery past the hold, each died of a signal held or delivered, or exited 0 or 75 (``[75, -15]``)."""
        delivered = {signal.Signals[name] for event in self.delivered_after_hold for name in event["signals"]}
        orderly = (0, int(ExitCode.PREEMPTED)) if delivered else ()
        if not all(
            code is not None and (code in orderly or (code < 0 and -code in delivered | self._held_ever.get(local, set()))) for local, code in enumerate(codes)
        ):
            return False
        if delivered:  # a program without resilient_loop() may have trained: no claim about LATEST
            waited = sorted({rank for event in self.delivered_after_hold for rank in event["ranks"]})
            self._log(
                f"ranks {list(self.ranks)} exited with {list(codes)} on the stop signal this launcher was asked to pass on "
                f"(ranks {waited} got it after it was held {self.hold_timeout_s:g} s for them: they never became ready): "
                f"exit {int(ExitCode.PREEMPTED)} (preempted: requeue)"
            )
            return True
        names = sorted({signal.Signals(-code).name for code in codes if code is not None})
        self._log(
            f"ranks {list(self.ranks)} died of {', '.join(names)} before installing their handlers (the signal reached "
            "them directly too, e.g. sent to the whole process group): nothing trained since LATEST, which is "
            f"unchanged; exit {int(ExitCode.PREEMPTED)} (stopped before the first step)"
        )
        return True

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
            if self._stopped_before_ready(codes):
                return int(ExitCode.PREEMPTED)
            return combine_exit_codes(codes)  # type: ignore[arg-type]
        now = time.monotonic()
        if self._failed_at is None:
            failed = [(local, code) for local, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                self._failed_at = now
                # of several seen at once, a death by a signal: the likelier cause of the others' errors
                local, code = self.first_failure = min(failed, key=lambda item: item[1] >= 0)
                # 75/76/77 are orderly stops (the others normally follow within moments); the
                # grace and then SIGTERM still apply, so a peer stuck in a collective cannot hang us.
                if code in _ORDERLY_STOPS:
                    then = f"the other ranks normally follow (SIGTERM to any still running in {self.failure_grace_s:g} s)"
                    self._log(f"rank {self.ranks[local]} stopped with {describe_code(code)}; {then}")
                else:
                    self._log(f"rank {self.ranks[local]} exited with {describe_code(code)}; waiting up to {self.failure_grace_s:g} s for the other ranks")
        elif self._term_sent_at is None:
            if now - self._failed_at >= self.failure_grace_s:
                if self.before_term is not None:
                    self.before_term()
                sent = self.send_signal(signal.SIGTERM)
                self._term_sent_at = now
                self._log(f"failure grace of {self.failure_grace_s:g} s expired; sent SIGTERM to ranks {self._global(sent)}")
        elif not self._kill_sent and now - self._term_sent_at >= self.kill_grace_s:
            sent = self.send_signal(signal.SIGKILL)
            self._kill_sent = True
            self._log(f"ranks {self._global(sent)} still running {self.kill_grace_s:g} s after SIGTERM; sent SIGKILL")
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
