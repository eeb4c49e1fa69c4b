"""Step and save durations (moving averages, seconds) and the deadline rule built on them.

The rule: stop and save by ourselves once the time left before the job's end can no longer
cover the steps the stop agreement may still run (up to 2k - 1 at cadence k) plus one save,
times a safety factor. Pure functions and a clock you can replace, so it is tested with a fake.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class RunTimer:
    """Exponential moving averages of step time and save time, in seconds.

    ``alpha`` weighs the newest sample (default 0.2). ``clock`` is ``time.monotonic`` unless a
    test passes another. The first step after a (re)start is not counted: it includes warm-up.
    """

    def __init__(self, *, alpha: float = 0.2, clock: Callable[[], float] = time.monotonic) -> None:
        self.alpha = alpha
        self.clock = clock
        self.step_s: float | None = None
        self.save_s: float | None = None
        self._last_boundary: float | None = None
        self._steps_seen = 0

    def _ema(self, old: float | None, sample: float) -> float:
        return sample if old is None else (1 - self.alpha) * old + self.alpha * sample

    def boundary(self) -> None:
        """Call at every step boundary (after a step finished, before any save)."""
        now = self.clock()
        if self._last_boundary is not None:
            self._steps_seen += 1
            if self._steps_seen > 1:
                self.step_s = self._ema(self.step_s, now - self._last_boundary)
        self._last_boundary = now

    def record_save(self, seconds: float) -> None:
        """Count one save's duration; the next step's time starts after it."""
        self.save_s = self._ema(self.save_s, seconds)
        self._last_boundary = self.clock()

    def as_dict(self) -> dict[str, float | None]:
        """``{"step_s", "save_s"}`` for a checkpoint's manifest (read by ``resilience advise``)."""
        return {"step_s": self.step_s, "save_s": self.save_s}


def auto_cadence(step_s: float | None, interval_s: float, *, max_steps: int = 1000) -> int:
    """The stop agreement's cadence for ``agreement_every_steps: auto``: the whole steps of
    ``step_s`` seconds that fit in ``interval_s`` seconds, between 1 and ``max_steps``; 0 (no
    proposal) while the step time is unknown."""
    if not step_s or step_s <= 0:
        return 0
    return max(1, min(max_steps, int(interval_s / step_s)))


def seconds_needed(step_s: float, save_s: float, *, agreement_every_steps: int = 1, safety: float = 1.5) -> float:
    """Seconds a stop needs before the end: the steps the agreement may still run (2k - 1 at
    cadence k) plus one save, times ``safety``."""
    return ((2 * agreement_every_steps - 1) * step_s + save_s) * safety


def must_stop(now: float, end_time: float | None, step_s: float | None, save_s: float | None, *, agreement_every_steps: int = 1, safety: float = 1.5) -> bool:
    """True when the time left (``end_time - now``, seconds) no longer covers a stop.

    False while the end time is unknown or no step has been timed yet. A save never timed yet
    counts as taking as long as one step (a guess that errs towards an early stop).
    """
    if end_time is None or step_s is None:
        return False
    needed = seconds_needed(step_s, save_s if save_s is not None else step_s, agreement_every_steps=agreement_every_steps, safety=safety)
    return end_time - now <= needed


def lead_time_warning(lead_s: float, step_s: float | None, save_s: float | None, *, agreement_every_steps: int = 1, safety: float = 1.5) -> str | None:
    """A warning when a signal ``lead_s`` seconds before the end (Slurm ``--signal=...@N``) is too
    late for a stop: shorter than :func:`seconds_needed`. ``None`` when it is long enough or
    nothing has been timed yet."""
    if step_s is None:
        return None
    save = save_s if save_s is not None else step_s
    needed = seconds_needed(step_s, save, agreement_every_steps=agreement_every_steps, safety=safety)
    if lead_s >= needed:
        return None
    return (
        f"the stop signal comes {lead_s:g} s before the end, but a stop needs about {needed:.1f} s "
        f"(({2 * agreement_every_steps - 1} step(s) x {step_s:.2f} s + one save of {save:.2f} s) x {safety:g}): "
        f"raise slurm.signal_lead_s (--signal=...@N) to at least {int(needed) + 1}"
    )
