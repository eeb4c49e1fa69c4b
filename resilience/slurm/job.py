"""The Slurm job this process runs in: ids, restart count, end time, and how signals reach it.

Read from the environment Slurm sets (``sbatch(1)``/``srun(1)`` "OUTPUT ENVIRONMENT VARIABLES")
and, for the end time, from ``scontrol show job``. Nothing here talks to Slurm at import time.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import re
import subprocess
from collections.abc import Mapping

# Environment contract with templates/slurm*.sub (set by the batch script, read by the ranks).
from resilience.env_names import RUN_ID_ENV, SLURM, TEMPLATE_ENV


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    """What Slurm tells a process about its job. Strings as Slurm gives them; counts as ints."""

    job_id: str
    array_job_id: str | None = None
    array_task_id: str | None = None
    restart_count: int = 0
    """``SLURM_RESTART_COUNT``: 0 on the first run (Slurm leaves it unset then), 1, 2, ... after requeues."""
    step_id: str | None = None
    """``SLURM_STEP_ID`` under ``srun``; ``None`` for the batch script and its plain children."""
    node_list: str | None = None
    node_id: int | None = None
    procid: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SlurmJob | None:
        """The job described by ``env`` (default ``os.environ``), or ``None`` outside Slurm."""
        env = os.environ if env is None else env

        def _get(field: str) -> str | None:  # the first of the field's names that is set (``a or b``)
            *first, last = SLURM[field]
            return next((env[name] for name in first if env.get(name)), env.get(last))

        def _int(field: str) -> int | None:
            value = _get(field)
            return int(value) if value and value.isdigit() else None

        job_id = _get("job_id")
        if not job_id:
            return None
        return cls(
            job_id=job_id,
            array_job_id=_get("array_job_id"),
            array_task_id=_get("array_task_id"),
            restart_count=_int("restart_count") or 0,
            step_id=_get("step_id"),
            node_list=_get("node_list"),
            node_id=_int("node_id"),
            procid=_int("procid"),
        )

    @property
    def requeue_id(self) -> str:
        """The id to requeue: ``<array job id>_<task id>`` for an array task (requeuing the
        plain job id of an array task would requeue a different task), else the job id."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    @property
    def run_id(self) -> str:
        """A run id stable across requeues of this job: ``slurm-<requeue id>``."""
        return f"slurm-{self.requeue_id}"

    def end_time(self, *, timeout_s: float = 10.0) -> float | None:
        """The job's end time as a Unix timestamp (seconds), from ``scontrol show job``;
        ``None`` when Slurm reports none (``Unknown``) or ``scontrol`` is unavailable."""
        try:
            out = subprocess.run(["scontrol", "show", "job", "-o", self.job_id], capture_output=True, text=True, timeout=timeout_s, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        return parse_end_time(out)


def parse_end_time(scontrol_output: str) -> float | None:
    """``EndTime=`` of ``scontrol show job -o`` output as a Unix timestamp (local time), or ``None``."""
    match = re.search(r"\bEndTime=(\S+)", scontrol_output)
    if not match or match.group(1) in ("Unknown", "None"):
        return None
    try:
        return _dt.datetime.strptime(match.group(1), "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def signal_reach_warning(env: Mapping[str, str] | None = None) -> str | None:
    """A warning when this process runs in a Slurm job in a way ``--signal=B:...`` cannot reach.

    ``B:`` signals go to the batch shell only; without a trap the shell dies and the job is
    killed without a save. A process that is neither an ``srun`` step nor launched by one of
    our templates (which trap and forward) is such a case. Returns ``None`` when all is well.
    """
    env = os.environ if env is None else env
    job = SlurmJob.from_env(env)
    if job is None or env.get(TEMPLATE_ENV) == "1" or job.step_id not in (None, "", "batch"):
        return None
    return (
        f"running inside Slurm job {job.job_id} as a plain child of the batch script: a "
        "'--signal=B:<SIG>@<N>' warning reaches only the batch shell, which dies on it unless it "
        "traps and forwards it. Use templates/slurm.sub (`resilience template slurm CONFIG.yaml`) "
        "or launch the ranks with srun."
    )


def run_id_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """``RESILIENCE_RUN_ID`` if set, else the Slurm job's :attr:`SlurmJob.run_id`, else ``None``."""
    env = os.environ if env is None else env
    if env.get(RUN_ID_ENV):
        return env[RUN_ID_ENV]
    job = SlurmJob.from_env(env)
    return job.run_id if job else None
