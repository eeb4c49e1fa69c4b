"""Medians and 95 % confidence intervals for the bench's figures.

Two kinds of figure, two intervals:

* a ratio measured once per round (save vs disk, load vs safetensors, ...): the median over
  rounds with the distribution-free interval for a median, between two order statistics
  (no assumption on how the rounds spread). It reaches 95 % from 6 rounds on; with fewer the
  interval is the range of the rounds and ``confidence`` says what it covers (5 rounds: 93.8 %,
  3 rounds: 75 %, 1 round: no interval);
* an overhead measured in interleaved A/B pairs (the agreement): total time with over total
  time without, minus 1, with a percentile bootstrap over the pairs (each pair resampled whole,
  so drift that hits both blocks of a pair cancels).
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
    for k in range(2, n // 2 + 1):
        c = 1 - 2 * _binom_cdf_half(k - 1, n)
        if c < confidence:
            break
        best_k, coverage = k, c
    out.update(ci_low=ordered[best_k - 1], ci_high=ordered[n - best_k], confidence=coverage)
    return out


def paired_overhead(treated: Sequence[float], base: Sequence[float], *, resamples: int = 4000, seed: int = 0, confidence: float = CONFIDENCE) -> dict[str, Any]:
    """Overhead of ``treated`` over ``base`` from paired blocks: ``sum(treated) / sum(base) - 1``.

    ``treated[i]`` and ``base[i]`` are one pair's mean step times (s), measured back to back in
    the same processes. The interval is the percentile bootstrap of the same statistic over the
    pairs (``resamples`` draws, seeded: the same data gives the same interval). Returns
    ``{"value", "ci_low", "ci_high", "confidence", "n", "pair_fractions", "median_pair_fraction",
    "method"}``; intervals are None below 2 pairs.

    Raises:
        ValueError: the sequences differ in length.
    """
    if len(treated) != len(base):
        raise ValueError(f"paired_overhead: {len(treated)} treated blocks but {len(base)} base blocks")
    n = len(base)
    fractions = [t / b - 1 for t, b in zip(treated, base)]
    out: dict[str, Any] = {
        "value": (sum(treated) / sum(base) - 1) if n else None,
        "ci_low": None,
        "ci_high": None,
        "confidence": None,
        "n": n,
        "pair_fractions": fractions,
        "median_pair_fraction": statistics.median(fractions) if n else None,
        "method": f"percentile bootstrap over {n} A/B pairs ({resamples} resamples) of sum(with)/sum(without) - 1",
    }
    if n < 2:
        return out
    rng = random.Random(seed)
    draws = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        draws.append(sum(treated[i] for i in idx) / sum(base[i] for i in idx) - 1)
    draws.sort()
    tail = (1 - confidence) / 2
    out.update(ci_low=draws[int(tail * resamples)], ci_high=draws[min(resamples - 1, int((1 - tail) * resamples))], confidence=confidence)
    return out
