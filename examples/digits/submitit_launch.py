"""Submit the digits example through submitit: requeued on timeout or preemption, resumed from LATEST.

    python examples/digits/submitit_launch.py --folder runs/submitit \\
        --checkpoint-dir runs/digits/submitit-ck --timeout-min 10 --signal-delay-s 120

submitit adds ``#SBATCH --signal=USR2@<signal-delay-s>`` and runs the training under ``srun``;
:class:`resilience.integrations.submitit.ResilientTask` makes the loop save on that USR2 and requeues the job
(``scontrol requeue``, same job id) until training returns DONE. ``job.result()`` is then the
training's exit code, 0.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import submitit

from resilience.integrations.submitit import ResilientTask, submitit_preemption_signal

DIGITS_DIR = Path(__file__).resolve().parent
CONFIG = DIGITS_DIR / "digits.yaml"


def train_digits(argv: list[str]) -> int:
    """Run ``train.main(argv)`` inside a submitit task and return its exit code.

    With several tasks (``tasks_per_node`` or ``nodes`` > 1) it first exports torch.distributed's
    ``env://`` variables from submitit's job environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR`` = first node, ``MASTER_PORT`` derived from the job id and the
    Slurm restart count, so a requeued run does not meet the previous run's port).
    """
    if str(DIGITS_DIR) not in sys.path:
        sys.path.insert(0, str(DIGITS_DIR))
    try:
        job = submitit.JobEnvironment()
    except RuntimeError:  # not in a submitit job (a direct call): one local rank
        job = None
    if job is not None and job.num_tasks > 1:
        restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        digits = int("".join(ch for ch in job.raw_job_id if ch.isdigit()) or 0)
        os.environ.update(
            RANK=str(job.global_rank),
            WORLD_SIZE=str(job.num_tasks),
            LOCAL_RANK=str(job.local_rank),
            MASTER_ADDR=job.hostnames[0],
            MASTER_PORT=str(20000 + (digits * 13 + restart * 101) % 20000),
        )
    from train import main

    return main(argv)


def digits_argv(checkpoint_dir: str | os.PathLike, overrides: Sequence[str] = ()) -> list[str]:
    """The digits ``main`` arguments for a submitit run: our config, ``checkpoint_dir`` (made
    absolute: the job's working directory may differ), submitit's preemption signal as
    ``step_scheduler.preemption_signal``, then ``overrides`` (dotted ``key=value``, applied last)."""
    return [
        "--config",
        str(CONFIG),
        f"checkpoint.checkpoint_dir={Path(checkpoint_dir).resolve()}",
        f"step_scheduler.preemption_signal={submitit_preemption_signal()}",
        *overrides,
    ]


def submit(
    folder: str | os.PathLike,
    checkpoint_dir: str | os.PathLike,
    *,
    timeout_min: int = 60,
    signal_delay_s: int = 120,
    tasks_per_node: int = 1,
    nodes: int = 1,
    max_num_timeout: int = 3,
    partition: str | None = None,
    cluster: str | None = None,
    overrides: Sequence[str] = (),
    fn: Callable[[list[str]], int] = train_digits,
) -> submitit.Job:
    """Submit the digits training as a :class:`~resilience.integrations.submitit.ResilientTask`; return the job.

    Args:
        folder: submitit's folder for pickles and logs (``%j`` allowed, as in submitit).
        checkpoint_dir: the run's checkpoint directory, shared by every requeue of the job.
        timeout_min: the job's time limit in minutes (``--time``; Slurm has minute granularity).
        signal_delay_s: seconds before the limit that Slurm sends USR2 (``--signal=USR2@N``;
            Slurm checks every 30 s, so it arrives N to N+30 s before the end). Choose N above the
            time one step plus one checkpoint save takes.
        tasks_per_node, nodes: ranks per node and nodes (one rank per task, gloo on CPU).
        max_num_timeout: how many time-limit requeues submitit allows (preemptions are unlimited).
        partition: Slurm partition, or ``None`` for the default.
        cluster: submitit executor (``"slurm"``, ``"local"``, ``"debug"``), ``None`` to detect.
        overrides: extra dotted config overrides, e.g. ``step_scheduler.num_epochs=40``.
        fn: what the task runs with the digits arguments (default :func:`train_digits`; tests
            wrap it); it must be importable by name in the job, or defined in ``__main__``.

    Raises submitit's errors when ``sbatch`` refuses the job.
    """
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster, slurm_max_num_timeout=max_num_timeout)
    # The job imports this module and train.py by name.
    pythonpath = f"export PYTHONPATH={shlex.quote(str(DIGITS_DIR))}${{PYTHONPATH:+:$PYTHONPATH}}"
    params: dict = dict(
        name="digits",
        timeout_min=timeout_min,
        nodes=nodes,
        tasks_per_node=tasks_per_node,
        cpus_per_task=1,
        slurm_signal_delay_s=signal_delay_s,
        slurm_setup=[pythonpath],
        local_setup=[pythonpath],
        # --requeue: `scontrol requeue` is allowed even where the cluster's JobRequeue default is 0.
        slurm_additional_parameters={"requeue": True},
    )
    if partition:
        params["slurm_partition"] = partition
    executor.update_parameters(**params)
    return executor.submit(ResilientTask(fn), digits_argv(checkpoint_dir, overrides))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="runs/submitit/%j", help="submitit folder (logs, pickles)")
    parser.add_argument("--checkpoint-dir", default="runs/digits/submitit-checkpoints")
    parser.add_argument("--timeout-min", type=int, default=60)
    parser.add_argument("--signal-delay-s", type=int, default=120)
    parser.add_argument("--tasks-per-node", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--max-num-timeout", type=int, default=3)
    parser.add_argument("--partition", default=None)
    parser.add_argument("--cluster", default=None, help="slurm, local or debug (default: detect)")
    parser.add_argument("--no-wait", action="store_true", help="print the job id and return")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. step_scheduler.num_epochs=40")
    args = parser.parse_args(argv)
    job = submit(
        args.folder,
        args.checkpoint_dir,
        timeout_min=args.timeout_min,
        signal_delay_s=args.signal_delay_s,
        tasks_per_node=args.tasks_per_node,
        nodes=args.nodes,
        max_num_timeout=args.max_num_timeout,
        partition=args.partition,
        cluster=args.cluster,
        overrides=args.overrides,
    )
    print(f"submitted job {job.job_id}; logs in {job.paths.folder}", flush=True)
    if args.no_wait:
        return 0
    results = job.results()  # one per task; raises if the job failed
    print(f"job {job.job_id} finished: {results}", flush=True)
    return int(results[0])


if __name__ == "__main__":
    sys.exit(main())
