"""The job's deadline, as rank 0 sees it: its end time, whether the time left still covers a
stop, and whether the Slurm signal's lead time does (the rules are :mod:`resilience.timing`'s).

Other ranks hold no end time and always answer "no": rank 0's answer reaches them through the
stop agreement.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from resilience import timing
from resilience.config import ResilienceConfig
from resilience.env_names import SIGNAL_LEAD_S_ENV
from resilience.slurm.job import SlurmJob

log = logging.getLogger("resilience")


class Deadline:
    """The job's end and the checks against it, judged from ``timer``'s step and save times.

    ``agreement_every_steps`` is the stop agreement's cadence at the time of each check (the
    steps it may still run before a stop grow with it).
    """

    def __init__(self, config: ResilienceConfig, rank: int, timer: timing.RunTimer):
        self.config = config
        self.rank = rank
        self.timer = timer
        self.end_time: float | None = None
        """The job's end (Unix time, rank 0 only), once :meth:`start` has read it."""
        self._lead_time_warned = False

    def start(self) -> None:
        """Read the job's end (rank 0, with ``deadline_stop``): ``wall_time_s`` from now, else
        Slurm's EndTime."""
        sched_cfg = self.config.step_scheduler
        if not sched_cfg.deadline_stop or self.rank != 0:
            return
        if sched_cfg.wall_time_s is not None:
            self.end_time = time.time() + sched_cfg.wall_time_s
        else:
            job = SlurmJob.from_env()
            self.end_time = job.end_time() if job is not None else None

    def must_stop(self, agreement_every_steps: int) -> bool:
        """True once the time left no longer covers a stop (see :func:`resilience.timing.must_stop`)."""
        if self.end_time is None:
            return False
        return timing.must_stop(
            time.time(),
            self.end_time,
            self.timer.step_s,
            self.timer.save_s,
            agreement_every_steps=agreement_every_steps,
            safety=self.config.step_scheduler.deadline_safety,
        )

    def warn_lead_time(self, timings: dict[str, Any], agreement_every_steps: int) -> None:
        """Warn (rank 0, once) when the Slurm signal's lead time cannot cover a stop, judged from
        ``timings`` (``step_s``, ``save_s``): the resumed checkpoint's at the start, this run's own
        after each save."""
        if self.rank != 0 or self._lead_time_warned:
            return
        lead = os.environ.get(SIGNAL_LEAD_S_ENV)
        if lead is None and SlurmJob.from_env() is None:
            return
        lead_s = float(lead) if lead is not None else float(self.config.slurm.signal_lead_s)
        warning = timing.lead_time_warning(
            lead_s, timings.get("step_s"), timings.get("save_s"), agreement_every_steps=agreement_every_steps, safety=self.config.step_scheduler.deadline_safety
        )
        if warning:
            log.warning(warning)
            self._lead_time_warned = True
