"""submitit integration: requeue a ``resilient_loop`` run on timeout or preemption, resume from LATEST.

::

    import submitit
    from resilience.integrations.submitit import ResilientTask, submitit_preemption_signal

    def train(argv: list[str]) -> int:          # runs resilient_loop, returns loop.exit_code
        ...

    executor = submitit.AutoExecutor(folder="runs/submitit")
    executor.update_parameters(timeout_min=60, slurm_signal_delay_s=120, tasks_per_node=1)
    argv = [f"step_scheduler.preemption_signal={submitit_preemption_signal()}", ...]   # SIGUSR2
    job = executor.submit(ResilientTask(train), argv)
    job.result()                                # what train returned, once it returned DONE

How the pieces meet (submitit 1.5, ``submitit/core/job_environment.py``):

* submitit submits with ``#SBATCH --signal=USR2@<slurm_signal_delay_s>`` (no ``B:``, so Slurm sends
  it to the ``srun`` task, i.e. the Python process) and, in that process, installs
  ``SignalHandler.checkpoint_and_try_requeue`` on USR2 (``SUBMITIT_PREEMPT_SIGNAL`` changes the
  signal) and log-only handlers on TERM and CONT. Its USR2 handler does everything *inside the
  signal*: it calls the callable's ``checkpoint()``, pickles the returned resubmission, runs
  ``scontrol requeue`` and calls ``sys.exit``. Left alone it would requeue before our loop had
  saved anything (and our recorder, which chains to it, would not stop that).
* :class:`ResilientTask` puts a *gate* on that signal while the training function runs. While a
  ``resilient_loop`` is recording the signal (``step_scheduler.preemption_signal`` includes it),
  the loop's :class:`~resilience.stop.signals.SignalRecorder` is the installed handler; it records and
  chains to the gate, which returns at once. The loop agrees a stop step across ranks, every rank
  saves it, and the function returns ``ExitCode.PREEMPTED``. Only then, from the main thread, does
  the task call submitit's own handler, which classifies timed-out vs preempted (walltime >=
  min(0.8 x timeout, timeout - 10 min) is a timeout, so with ``timeout_min`` <= 10 every signal
  is; only timeouts count against ``max_num_timeout``), calls :meth:`ResilientTask.checkpoint`,
  pickles the resubmission, runs ``scontrol requeue`` and exits.
* When the signal arrives while no loop records it (imports, data loading, after the loop ended,
  or a config without the signal), nothing newer than LATEST exists to save, so the gate hands it
  to submitit's handler at once: submitit's stock behaviour (the gate adds no work of its own to
  a signal handler), and the requeued run resumes from LATEST, losing only the setup time (or,
  with a config that does not record the signal, the steps since the last save).
* :meth:`ResilientTask.checkpoint` resubmits a *fresh* task (no in-memory training state is
  pickled); the next run's ``resilient_loop`` resumes from the checkpoint directory's ``LATEST``.
  ``scontrol requeue`` keeps the job id, so the run id (``slurm-<job id>``) stays the same.

Exit codes (``resilience.exit_codes``): ``DONE`` -> the function's return value is the job's
result; ``PREEMPTED`` -> requeue as above; anything else (``FAILED``, ``CONFIG_ERROR``,
``NO_PROGRESS``, ``RESTART_LIMIT``, unknown) -> :class:`TaskExitError`, no requeue. An exception
from the function propagates (submitit records it; no requeue).

Several tasks per job (``tasks_per_node``/``nodes`` > 1): Slurm signals every task; every rank's
loop saves the same step; rank 0 requeues (submitit's handler does nothing on other ranks) and the
other ranks wait, up to ``requeue_wait_s``, for the requeue to end the job (Slurm kills every
task when rank 0 requeues). Without srun (``slurm_use_srun=False``) the signal, sent without
``B:``, reaches no process at all: keep srun.

TERM: submitit only logs it. Leave it out of ``preemption_signal`` for submitit jobs: ``scancel``
sends TERM, and a loop that saved on it would then try to requeue a cancelled job. Scheduler
preemption sends the job's own ``--signal`` only with ``SlurmctldParameters=
preempt_send_user_signal`` and a ``GraceTime`` (otherwise just TERM, then a kill); elsewhere rely
on periodic saves (``ckpt_every_steps``). Our tests exercise the time limit, not preemption.

Relies on submitit internals (``SignalHandler.checkpoint_and_try_requeue``,
``JobEnvironment._usr_sig``), checked against submitit 1.5.4. Where that handler is not found
(a direct call, ``DebugExecutor``), no gate is installed and ``PREEMPTED`` raises
:class:`TaskExitError`.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any, NoReturn

import submitit
from submitit.core.job_environment import JobEnvironment, SignalHandler
from submitit.core.logger import get_logger

from resilience.exit_codes import ExitCode
from resilience.slurm.job import SlurmJob
from resilience.stop.signals import SignalRecorder

DEFAULT_REQUEUE_WAIT_S = 120.0


class TaskExitError(RuntimeError):
    """The training function ended with an exit code after which the job must not be requeued.

    Raised for ``FAILED``, ``CONFIG_ERROR``, ``NO_PROGRESS``, ``RESTART_LIMIT`` and unknown codes;
    for ``PREEMPTED`` when no submitit job runner is present to requeue (a direct call, submitit's
    ``DebugExecutor``); and on ranks > 0 when the requeue did not end the job in time.
    ``exit_code`` is the int the function returned.
    """

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def submitit_preemption_signal() -> str:
    """The signal submitit sends and handles for timeout/preemption, as a name for
    ``step_scheduler.preemption_signal`` (``"SIGUSR2"`` unless ``SUBMITIT_PREEMPT_SIGNAL`` is set,
    submitit's ``JobEnvironment.USR_SIG``)."""
    return "SIG" + JobEnvironment.USR_SIG


def exit_code_of(value: Any) -> int:
    """The exit code a training function reported: ``value`` itself when it is an ``int``, else
    its ``exit_code`` attribute (e.g. a :class:`~resilience.ResilientLoop` or a result object).

    Raises:
        TypeError: neither is an int (``bool`` and ``None`` are rejected too).
    """
    code = value if isinstance(value, int) and not isinstance(value, bool) else getattr(value, "exit_code", None)
    if isinstance(code, bool) or not isinstance(code, int):
        raise TypeError(
            f"ResilientTask: the training function returned {value!r} ({type(value).__name__}); expected an "
            "exit code (an int such as resilient_loop's loop.exit_code) or an object with an int 'exit_code'"
        )
    return int(code)


class ResilientTask(submitit.helpers.Checkpointable):
    """A submitit callable that runs ``fn(*args, **kwargs)`` under submitit's ``Checkpointable``
    contract with our exit-code rules (see the module docstring for the signal interplay).

    Args:
        fn: the training function; it builds its state from scratch, runs a ``resilient_loop``
            whose ``preemption_signal`` includes :func:`submitit_preemption_signal`, and returns
            the loop's exit code (an ``int``) or an object with an int ``exit_code``. It must be
            picklable by cloudpickle (submitit pickles the task for each (re)submission).
        requeue_wait_s: seconds a rank > 0 waits, after returning ``PREEMPTED``, for rank 0's
            requeue to end the job before raising :class:`TaskExitError` (> 0).
        attempt: 0 for the first submission; :meth:`checkpoint` increments it (informational).

    Calling it returns what ``fn`` returned when the code is ``DONE``. On ``PREEMPTED`` inside a
    submitit job, rank 0 runs submitit's requeue, which ends the process (``SystemExit``) or raises
    submitit's ``UncompletedJobError`` once ``max_num_timeout`` is used up; ranks > 0 wait for the
    requeue to kill them (:class:`TaskExitError` after ``requeue_wait_s``). Any other code raises
    :class:`TaskExitError`; an exception from ``fn`` propagates. Neither is requeued.

    Raises (constructor):
        TypeError: ``fn`` is not callable. ValueError: ``requeue_wait_s`` <= 0 or ``attempt`` < 0.
    """

    def __init__(self, fn: Callable[..., Any], *, requeue_wait_s: float = DEFAULT_REQUEUE_WAIT_S, attempt: int = 0) -> None:
        if not callable(fn):
            raise TypeError(f"ResilientTask: fn must be callable, got {fn!r}")
        if not requeue_wait_s > 0:
            raise ValueError(f"ResilientTask: requeue_wait_s must be > 0 seconds, got {requeue_wait_s!r}")
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
            raise ValueError(f"ResilientTask: attempt must be an int >= 0, got {attempt!r}")
        self.fn = fn
        self.requeue_wait_s = float(requeue_wait_s)
        self.attempt = attempt

    def __repr__(self) -> str:
        fn = getattr(self.fn, "func", self.fn)  # functools.partial: name the wrapped function
        return f"ResilientTask({getattr(fn, '__qualname__', type(fn).__name__)}, attempt={self.attempt})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` in this job attempt; the class docstring says what each exit code does."""
        sig = JobEnvironment._usr_sig()
        handler = _submitit_handler(sig)
        if handler is None:  # not in a submitit job process: nothing can requeue
            return self._finish(self.fn(*args, **kwargs), requeue=None)
        get_logger().info(f"resilience: {self!r} starting (Slurm restart count {_restart_count()})")
        with _Gate(sig, handler) as gate:
            try:
                value = self.fn(*args, **kwargs)
            finally:
                gate.armed = False  # later signals are dropped: this task returns or requeues itself next
            return self._finish(value, requeue=lambda: self._requeue(handler, sig))

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """submitit's ``Checkpointable`` hook, called by its signal handler before it requeues.

        Returns a resubmission of a *fresh* task with the same ``fn`` and arguments (``attempt``
        + 1): nothing from this run's memory is pickled; the next run resumes from ``LATEST`` in
        the loop's checkpoint directory.
        """
        fresh = type(self)(self.fn, requeue_wait_s=self.requeue_wait_s, attempt=self.attempt + 1)
        return submitit.helpers.DelayedSubmission(fresh, *args, **kwargs)

    # -- internals ------------------------------------------------------------------------------
    def _finish(self, value: Any, *, requeue: Callable[[], NoReturn] | None) -> Any:
        code = exit_code_of(value)
        if code == ExitCode.DONE:
            return value
        if code == ExitCode.PREEMPTED:
            if requeue is None:
                raise TaskExitError(
                    code,
                    "training stopped with PREEMPTED (75) and saved a checkpoint, but this is not a submitit "
                    "job process (direct call or DebugExecutor), so nothing can requeue it; call again to resume",
                )
            requeue()  # returns only by raising (SystemExit after the requeue, or an error)
        try:
            name = ExitCode(code).name
        except ValueError:
            name = "an unknown exit code"
        raise TaskExitError(code, f"training ended with {name} ({code}); not requeued")

    def _requeue(self, handler: Callable[[int, Any], None], sig: signal.Signals) -> NoReturn:
        rank = handler.__self__.env.global_rank  # type: ignore[attr-defined]
        log = get_logger()
        if rank == 0:
            log.info(f"resilience: training saved its stop step and returned PREEMPTED; requeueing ({self!r})")
            # submitit's own decision: timed-out vs preempted, max_num_timeout, checkpoint(), then
            # `scontrol requeue` and sys.exit (SystemExit), or UncompletedJobError when out of timeouts.
            handler(int(sig), None)
        else:
            log.info(f"resilience: rank {rank} saved its stop step; waiting for rank 0's requeue to end the job")
        deadline = time.monotonic() + self.requeue_wait_s
        while time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        raise TaskExitError(
            ExitCode.PREEMPTED,
            f"rank {rank}: training saved and returned PREEMPTED, but the job was not requeued within "
            f"{self.requeue_wait_s:g} s (did rank 0 fail to requeue, or run out of max_num_timeout?)",
        )


def _submitit_handler(sig: signal.Signals) -> Callable[[int, Any], None] | None:
    """submitit's checkpoint-and-requeue handler if it is the one installed for ``sig`` (i.e. this
    is a submitit job process, ``submitit.core.submission.process_job``), else ``None``."""
    current = signal.getsignal(sig)
    owner = getattr(current, "__self__", None)
    if isinstance(owner, SignalHandler) and getattr(current, "__name__", None) == "checkpoint_and_try_requeue":
        return current  # type: ignore[return-value]
    return None


class _Gate:
    """Stands between submitit's handler and the training loop for one signal (see module docstring).

    While ``armed`` and no ``resilient_loop`` recorder is the installed handler (the gate was
    called directly, not chained), it passes the signal on to submitit's handler, exactly what
    would have run without us; otherwise it returns at once (the loop has recorded the signal).
    """

    def __init__(self, sig: signal.Signals, submitit_handler: Callable[[int, Any], None]) -> None:
        self.sig = sig
        self.armed = True
        self._submitit = submitit_handler
        self._previous: Any = None

    def __enter__(self) -> _Gate:
        self._previous = signal.signal(self.sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        signal.signal(self.sig, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.armed:
            return
        installed = signal.getsignal(signum)
        if getattr(installed, "__module__", None) == SignalRecorder.__module__:
            return  # chained from a resilient_loop's recorder: the loop agrees, saves and returns PREEMPTED
        self._submitit(signum, frame)


def _restart_count() -> int:
    job = SlurmJob.from_env()
    return job.restart_count if job else 0
