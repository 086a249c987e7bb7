"""Confidence intervals for task loss that respect how the scored tokens are correlated, and verdicts on them.

Tokens of one text are not independent draws: a hard passage raises the NLL of its neighbours with and without
compression. The paired difference (compressed minus base, token by token) is therefore resampled in blocks of
``block`` consecutive tokens that never cross a window (the moving-blocks idea of Künsch 1989, with
non-overlapping blocks as in Carlstein 1986): every (window, block) pair is one unit of the bootstrap, and the
statistic is the token-weighted mean over the resampled units. Percentile intervals, seeded, so a rerun on the
same numbers gives the same interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

LEVEL = 0.95
#: the headline quality line: a loss increase of at most 1% of the base NLL
NLL_TOLERANCE = 0.01
VERDICTS = ("within", "not within", "unresolved")


def _blocks(per_window: Sequence[np.ndarray], block: int) -> tuple[np.ndarray, np.ndarray]:
    """Sums and token counts of the non-overlapping blocks of every window, ``(B,)`` each."""
    sums, counts = [], []
    for x in per_window:
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        starts = np.arange(0, x.size, block)
        if starts.size:
            sums.append(np.add.reduceat(x, starts))
            counts.append(np.diff(np.append(starts, x.size)))
    if not sums:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(sums), np.concatenate(counts).astype(np.float64)


def block_bootstrap_ci(per_window: Sequence[np.ndarray], block: int = 32, resamples: int = 2000, seed: int = 0,
                       level: float = LEVEL) -> list[float]:
    """``[low, high]`` for the mean of all values, resampling (window, block) units with replacement."""
    if block < 1 or resamples < 1 or not 0 < level < 1:
        raise ValueError(f"bootstrap needs block >= 1, resamples >= 1 and 0 < level < 1; got {block}, {resamples}, {level}")
    sums, counts = _blocks(per_window, int(block))
    if sums.size < 2:
        return [math.nan, math.nan]
    idx = np.random.default_rng(seed).integers(0, sums.size, size=(int(resamples), sums.size))  # (R, B)
    stat = sums[idx].sum(1) / counts[idx].sum(1)  # (R,)
    alpha = (1 - level) / 2
    low, high = np.quantile(stat, [alpha, 1 - alpha])
    return [float(low), float(high)]


def verdict(ci: Sequence[float], tolerance: float) -> str:
    """Whether a loss increase is within ``tolerance``, decided on its interval: ``within`` when the whole
    interval lies at or below it, ``not within`` when the whole interval lies above it, else ``unresolved``."""
    low, high = ci
    if not (math.isfinite(low) and math.isfinite(high) and math.isfinite(tolerance)):
        return "unresolved"
    if high <= tolerance:
        return "within"
    if low > tolerance:
        return "not within"
    return "unresolved"


def detectable_from_ci(ci: Sequence[float], level: float = LEVEL, power: float = 0.8) -> float:
    """The smallest true shift of the mean that a two-sided test at ``level`` detects with probability ``power``,
    given a measured ``level`` interval: ``(z_a + z_b) * se`` with the standard error read off its width."""
    from scipy.stats import norm

    low, high = ci
    z_a = float(norm.ppf(1 - (1 - level) / 2))
    return (z_a + float(norm.ppf(power))) * (high - low) / (2 * z_a)


def minimum_detectable_effect(per_window: Sequence[np.ndarray], block: int = 32, resamples: int = 2000,
                              seed: int = 0, level: float = LEVEL, power: float = 0.8) -> float:
    """:func:`detectable_from_ci` of the block-bootstrap interval of ``per_window`` (paired differences)."""
    return detectable_from_ci(block_bootstrap_ci(per_window, block, resamples, seed, level), level, power)
