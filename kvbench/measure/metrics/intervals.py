"""Confidence intervals for task loss that respect how the scored tokens are correlated, and verdicts on them.

Tokens of one text are not independent draws: a hard passage raises the NLL of its neighbours with and without
compression, and a whole document can be harder to compress than another. The paired difference (compressed minus
base, token by token) is resampled at two levels (:func:`document_bootstrap_ci`, the two-stage bootstrap of
Davison & Hinkley 1997, section 3.8): **documents** with replacement, then, within each drawn document, its
**blocks** of ``block`` consecutive tokens with replacement (blocks never cross a window; the moving-blocks idea of
Künsch 1989 with non-overlapping blocks as in Carlstein 1986). The statistic is the token-weighted mean over the
resampled blocks. The interval so covers the mean over documents drawn as these were (other addresses of the same
corpus, other windows of them), not only over other tokens of these texts; with both levels drawn with replacement
it errs wide, by about the within-document variance over the number of documents. With one document it is the
block bootstrap of that document alone (:func:`block_bootstrap_ci`). Percentile intervals, seeded, so a rerun on
the same numbers gives the same interval.
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


def document_bootstrap_ci(per_window: Sequence[np.ndarray], documents: Sequence[int] | None = None, block: int = 32,
                          resamples: int = 2000, seed: int = 0, level: float = LEVEL) -> list[float]:
    """``[low, high]`` for the mean of all values, resampling documents and then blocks within each drawn document
    (module docstring). ``documents`` gives each window's document (windows of one document share it); None: every
    window is a document of its own."""
    if block < 1 or resamples < 1 or not 0 < level < 1:
        raise ValueError(f"bootstrap needs block >= 1, resamples >= 1 and 0 < level < 1; got {block}, {resamples}, {level}")
    docs = np.arange(len(per_window)) if documents is None else np.asarray(documents)
    if docs.shape != (len(per_window),):
        raise ValueError(f"documents must name one document per window ({len(per_window)}); got shape {docs.shape}")
    groups = [_blocks([per_window[i] for i in np.flatnonzero(docs == d)], int(block)) for d in dict.fromkeys(docs.tolist())]
    groups = [(s, c) for s, c in groups if s.size]
    if len(groups) < 2:
        return block_bootstrap_ci(per_window, block, resamples, seed, level)
    rng = np.random.default_rng(seed)
    R, D = int(resamples), len(groups)
    sums, counts = _within(groups, R, rng)  # (D, R): every document's own resamples of its blocks
    drawn = rng.integers(0, D, size=(R, D))  # (R, D) documents of each resample
    which = rng.integers(0, R, size=(R, D))  # an independent within-document resample for every drawn document
    stat = sums[drawn, which].sum(1) / counts[drawn, which].sum(1)  # (R,)
    alpha = (1 - level) / 2
    low, high = np.quantile(stat, [alpha, 1 - alpha])
    return [float(low), float(high)]


def _within(groups: list[tuple[np.ndarray, np.ndarray]], resamples: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``(sums, counts)``, ``(D, R)`` each: every document's blocks resampled ``R`` times with replacement."""
    sums, counts = [], []
    for s, c in groups:
        idx = rng.integers(0, s.size, size=(resamples, s.size))  # (R, B_d)
        sums.append(s[idx].sum(1))
        counts.append(c[idx].sum(1))
    return np.stack(sums), np.stack(counts)


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
