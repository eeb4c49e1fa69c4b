"""Medians and 95 % confidence intervals for the bench's figures.

Two kinds of figure, two intervals:

* a ratio measured once per round (save vs disk, load vs safetensors, ...): the median over
  rounds with the distribution-free interval for a median, between two order statistics
  (no assumption on how the rounds spread). It reaches 95 % from 6 rounds on; with fewer the
  interval is the range of the rounds and ``confidence`` says what it covers (5 rounds: 93.8 %,
  3 rounds: 75 %, 1 round: no interval);
* an overhead measured in interleaved blocks (the agreement, the watchdog's reports): total time
  with over total time of the control, minus 1, with a moving-block bootstrap over the rows
  (each row resampled whole, so drift that hits all its blocks cancels; runs of consecutive
  rows resampled together, so a burst of the machine that spans several rows is not counted as
  independent evidence). The control is a no-op call in the same harness (an A/A arm): on the
  development VM the harness alone read +2.3 % against the bare step, so the bare step is no
  control for a call that costs microseconds.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from typing import Any

CONFIDENCE = 0.95


def _binom_cdf_half(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(0, k + 1)) / 2**n


def median_interval(values: Sequence[float | None], confidence: float = CONFIDENCE) -> dict[str, Any]:
    """Median of ``values`` (None dropped) and the order-statistic interval around it.

    Returns ``{"median", "ci_low", "ci_high", "confidence", "n", "rounds"}``: ``[ci_low, ci_high]``
    is ``[x_(k), x_(n-k+1)]`` of the sorted values with the largest ``k`` whose coverage
    ``1 - 2 P(Binomial(n, 1/2) <= k - 1)`` is at least ``confidence``; below 6 values none
    reaches 95 %, so the interval is the whole range and ``confidence`` its real coverage.
    ``ci_low``/``ci_high`` are None for fewer than 2 values; everything is None for none."""
    rounds = [float(v) for v in values if v is not None]
    n = len(rounds)
    out: dict[str, Any] = {"median": None, "ci_low": None, "ci_high": None, "confidence": None, "n": n, "rounds": rounds}
    if not n:
        return out
    out["median"] = statistics.median(rounds)
    if n < 2:
        return out
    ordered = sorted(rounds)
    best_k, coverage = 1, 1 - 2 * _binom_cdf_half(0, n)
    # P(X <= k - 1) kept as an exact running sum of C(n, i): O(n) for thousands of step times
    term = cumulative = 1  # C(n, 0)
    total = 2**n
    for k in range(2, n // 2 + 1):
        term = term * (n - k + 2) // (k - 1)  # C(n, k - 1)
        cumulative += term
        c = 1 - 2 * cumulative / total
        if c < confidence:
            break
        best_k, coverage = k, c
    out.update(ci_low=ordered[best_k - 1], ci_high=ordered[n - best_k], confidence=coverage)
    return out


def block_length(n: int) -> int:
    """The moving-block bootstrap's block length for ``n`` rows: ``ceil(n ** (1/3))``, the usual
    order for a mean of a weakly dependent series (Hall, Horowitz and Jing 1995)."""
    return max(1, math.ceil(n ** (1 / 3))) if n else 1


def paired_overhead(
    treated: Sequence[float],
    base: Sequence[float],
    *,
    resamples: int = 4000,
    seed: int = 0,
    confidence: float = CONFIDENCE,
    block: int | None = None,
) -> dict[str, Any]:
    """Overhead of ``treated`` over ``base`` from paired blocks: ``sum(treated) / sum(base) - 1``.

    ``treated[i]`` and ``base[i]`` are one row's mean step times (s), measured back to back in
    the same processes. The interval is the percentile moving-block bootstrap of the same
    statistic: each resample strings together runs of ``block`` consecutive rows (default
    :func:`block_length`; 1 is the plain pair bootstrap) from random starts, ``resamples``
    draws, seeded (the same data gives the same interval). Returns ``{"value", "ci_low",
    "ci_high", "confidence", "n", "block", "pair_fractions", "median_pair_fraction",
    "method"}``; intervals are None below 2 rows.

    Raises:
        ValueError: the sequences differ in length, or ``block`` < 1.
    """
    if len(treated) != len(base):
        raise ValueError(f"paired_overhead: {len(treated)} treated blocks but {len(base)} base blocks")
    n = len(base)
    block = block_length(n) if block is None else block
    if block < 1:
        raise ValueError(f"paired_overhead: block must be >= 1, got {block}")
    block = min(block, max(1, n))
    fractions = [t / b - 1 for t, b in zip(treated, base)]
    out: dict[str, Any] = {
        "value": (math.fsum(treated) / math.fsum(base) - 1) if n else None,
        "ci_low": None,
        "ci_high": None,
        "confidence": None,
        "n": n,
        "block": block,
        "pair_fractions": fractions,
        "median_pair_fraction": statistics.median(fractions) if n else None,
        "method": f"moving-block bootstrap over {n} rows (blocks of {block}, {resamples} resamples) of sum(with)/sum(control) - 1",
    }
    if n < 2:
        return out
    rng = random.Random(seed)
    draws = []
    runs = math.ceil(n / block)
    for _ in range(resamples):
        idx = [start + j for start in (rng.randrange(n - block + 1) for _ in range(runs)) for j in range(block)][:n]
        # fsum: a resample holding the same rows as the data gives exactly its value, in any order
        draws.append(math.fsum(treated[i] for i in idx) / math.fsum(base[i] for i in idx) - 1)
    draws.sort()
    tail = (1 - confidence) / 2
    out.update(ci_low=draws[int(tail * resamples)], ci_high=draws[min(resamples - 1, int((1 - tail) * resamples))], confidence=confidence)
    return out


def controlled_overhead(rows: Sequence[dict[str, float]], treated: str, *, control: str = "noop", base: str = "none", **kw: Any) -> dict[str, Any]:
    """The overhead of arm ``treated`` over the ``control`` arm (a no-op call in the same harness)
    from rows of interleaved blocks (``{arm: mean step s}``), by :func:`paired_overhead`, plus
    ``raw`` (``treated`` over the bare step ``base``) and ``aa`` (``control`` over ``base``, the
    harness's own reading of doing nothing) with their intervals. Rows without the control arm
    (older results) fall back to ``base`` as the control. ``kw`` goes to :func:`paired_overhead`."""
    t = [r[treated] for r in rows]
    b = [r[base] for r in rows]
    has_control = bool(rows) and all(control in r for r in rows)
    c = [r[control] for r in rows] if has_control else b
    out = paired_overhead(t, c, **kw)
    out["control"] = control if has_control else base
    out["raw"] = {k: v for k, v in paired_overhead(t, b, **kw).items() if k != "pair_fractions"}
    out["aa"] = {k: v for k, v in paired_overhead(c, b, **kw).items() if k != "pair_fractions"} if has_control else None
    return out


def mean_interval(values: Sequence[float], *, block: int | None = None, resamples: int = 4000, seed: int = 0, confidence: float = CONFIDENCE) -> dict[str, Any]:
    """Mean of ``values`` (a series in time order: chunks of consecutive step boundaries) with the
    percentile moving-block bootstrap interval of the mean (runs of ``block`` consecutive values,
    default :func:`block_length`, resampled together: a burst of the machine spanning several
    chunks is one piece of evidence, not several), ``resamples`` draws, seeded. Returns
    ``{"mean", "ci_low", "ci_high", "confidence", "n", "block"}``; no interval below 2 values."""
    n = len(values)
    block = min(block_length(n) if block is None else max(1, block), max(1, n))
    out: dict[str, Any] = {"mean": math.fsum(values) / n if n else None, "ci_low": None, "ci_high": None, "confidence": None, "n": n, "block": block}
    if n < 2:
        return out
    rng = random.Random(seed)
    runs = math.ceil(n / block)
    draws = []
    for _ in range(resamples):
        idx = [start + j for start in (rng.randrange(n - block + 1) for _ in range(runs)) for j in range(block)][:n]
        draws.append(math.fsum(values[i] for i in idx) / n)
    draws.sort()
    tail = (1 - confidence) / 2
    out.update(ci_low=draws[int(tail * resamples)], ci_high=draws[min(resamples - 1, int((1 - tail) * resamples))], confidence=confidence)
    return out


def cost_fraction(costs: Sequence[float], steps: Sequence[float], *, extra: float = 0.0, baseline: Sequence[float] | None = None, **kw: Any) -> dict[str, Any]:
    """A per-step cost over the median step: ``(mean(costs) - mean(baseline)) / median(steps) + extra``.

    ``costs``: seconds per step boundary, one value per chunk of consecutive boundaries (time
    order); ``baseline``: the same for a call that does nothing, timed the same way in the same run
    (the timing's own cost, subtracted; none: 0); ``steps``: every step's time (s) in the same run;
    ``extra``: a fraction added as is (measured elsewhere, without an interval). The interval
    combines the means' block-bootstrap intervals (:func:`mean_interval`, ``kw``) with the median
    step's order-statistic interval (:func:`median_interval`), the wide way round: the lowest and
    highest of ``(cost - baseline) / step`` over the three intervals' ends.
    Returns ``{"value", "ci_low", "ci_high", "confidence", "cost_s", "baseline_s", "step_s"}``."""
    cost, step = mean_interval(costs, **kw), median_interval(steps)
    base = mean_interval(baseline, **kw) if baseline else {"mean": 0.0, "ci_low": 0.0, "ci_high": 0.0, "n": 0}
    step_s = {k: v for k, v in step.items() if k != "rounds"}  # not every step's time
    out: dict[str, Any] = {"value": None, "ci_low": None, "ci_high": None, "confidence": None, "cost_s": cost, "baseline_s": base, "step_s": step_s}
    if cost["mean"] is None or base["mean"] is None or not step["median"]:
        return out
    out["value"] = (cost["mean"] - base["mean"]) / step["median"] + extra
    if cost["ci_low"] is not None and base["ci_low"] is not None and step["ci_low"]:
        low, high = cost["ci_low"] - base["ci_high"], cost["ci_high"] - base["ci_low"]
        steps_at = (step["ci_low"], step["ci_high"])
        out.update(ci_low=min(low / t for t in steps_at) + extra, ci_high=max(high / t for t in steps_at) + extra, confidence=cost["confidence"])
    return out
