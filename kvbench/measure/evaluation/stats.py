"""Paired comparison of a compressor against the baseline on the same examples, by statistics that fit the scores.

Per-example scores are binary (exact match, multiple choice) or fractions (RULER's ``string_match_all`` gives partial
credit). For each task and for the pool of tasks:

* **interval**: the percentile interval of a bootstrap over examples of the mean paired difference (compressed
  minus baseline); pooled over tasks, the bootstrap is stratified by task (each task's examples resampled within
  the task, so the pool's mix of tasks stays the one the study chose). It is the "expanded" percentile interval of
  Hesterberg (2015, "What teachers should know about the bootstrap", The American Statistician 69:371): each
  stratum's deviations from its mean are scaled by ``sqrt(n/(n-1))`` and the level is raised to that of Student's
  t on the remaining degrees of freedom; the plain one is too narrow on 5-30 examples (its variance is the
  plug-in one and its quantile the normal one). BCa, tried too, covers less on binary differences of 30 examples
  (92% at nominal 95%, against 94%). Simulated coverage: ``tests/test_eval_stats.py``.
* **test**: the exact McNemar test (two-sided binomial on the discordant pairs) when every score is 0 or 1; else a
  paired permutation test (each pair's sides swapped at random: sign flips of the differences), exact up to 2^13
  pairs' arrangements and Monte Carlo beyond.
* **power**: ``detectable_diff``, the true difference a two-sided test at the 5% level detects 80% of the time with
  this many examples, ``(z_0.975 + z_0.8) * stderr_diff`` from the observed spread of the differences.

``scipy.stats`` does the resampling (``bootstrap``, ``permutation_test``, ``binomtest``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

LEVEL = 0.95
POWER = 0.8
RESAMPLES = 2000
PERMUTATIONS = 9999  # 2^13 = 8,192 arrangements or fewer are enumerated exactly


def _level(df: int, level: float = LEVEL) -> float:
    """The normal-quantile level whose quantile is Student's t quantile at ``level`` on ``df`` degrees of freedom."""
    return float(2 * stats.norm.cdf(stats.t.ppf(0.5 + level / 2, max(df, 1))) - 1)


def _expand(d: np.ndarray) -> np.ndarray:
    """Deviations from the mean scaled by ``sqrt(n/(n-1))``: the bootstrap's variance is then the unbiased one."""
    return d if d.size < 2 else d.mean() + math.sqrt(d.size / (d.size - 1)) * (d - d.mean())


def _pooled_mean(*strata: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.concatenate(strata, axis=axis).mean(axis=axis)


def bootstrap_ci(strata: Sequence[np.ndarray], seed: int = 0, resamples: int = RESAMPLES, level: float = LEVEL) -> list[float]:
    """``[low, high]`` for the mean of all values, resampling each stratum's values within it: the expanded
    percentile interval (module docstring). Identical values give a zero-width interval; fewer than two values, or
    one per stratum, NaN."""
    strata = [np.asarray(s, dtype=float).reshape(-1) for s in strata if np.size(s)]
    every = np.concatenate(strata) if strata else np.zeros(0)
    if every.size < 2:
        return [math.nan, math.nan]
    if np.all(every == every[0]):
        return [float(every[0])] * 2
    df = every.size - len(strata)
    if df < 1:  # one example per stratum: nothing varies within a stratum to resample
        return [math.nan, math.nan]
    res = stats.bootstrap(tuple(_expand(s) for s in strata), _pooled_mean, n_resamples=int(resamples),
                          method="percentile", confidence_level=_level(df, level), vectorized=True,
                          rng=np.random.default_rng(seed))
    low, high = res.confidence_interval
    return [float(low), float(high)]


def paired_test(base: np.ndarray, comp: np.ndarray, seed: int = 0) -> tuple[str, float]:
    """``(test name, two-sided p)``: exact McNemar when every score is 0 or 1, else a paired permutation test."""
    d = comp - base
    if not np.any(d) or d.size < 2:  # one pair: its two arrangements are equally extreme
        return ("mcnemar_exact" if is_binary(base, comp) else "permutation"), 1.0
    if is_binary(base, comp):
        lost, gained = int(np.sum(d < 0)), int(np.sum(d > 0))
        return "mcnemar_exact", float(stats.binomtest(min(lost, gained), lost + gained, 0.5).pvalue)
    res = stats.permutation_test((comp, base), lambda x, y, axis=-1: np.mean(x - y, axis=axis), permutation_type="samples",
                                 n_resamples=PERMUTATIONS, vectorized=True, rng=np.random.default_rng(seed))
    return "permutation", float(res.pvalue)


def is_binary(*scores: np.ndarray) -> bool:
    return all(bool(np.all((s == 0) | (s == 1))) for s in scores)


def detectable(stderr: float, level: float = LEVEL, power: float = POWER) -> float:
    """The true difference a two-sided test at ``1 - level`` detects with probability ``power``, given the
    standard error of the observed difference."""
    return float((stats.norm.ppf(0.5 + level / 2) + stats.norm.ppf(power)) * stderr)


def paired_scores(base: np.ndarray, comp: np.ndarray, task: Sequence | None = None, seed: int = 0) -> dict:
    """Each side's mean score with its standard error, their paired difference with its bootstrap interval, the
    paired test and the detectable difference (module docstring). ``task`` (one label per example) pools several
    tasks: the bootstrap is stratified by it and the standard errors are those of the stratified mean."""
    base = np.asarray(base, dtype=float)
    comp = np.asarray(comp, dtype=float)
    if base.shape != comp.shape or base.ndim != 1:
        raise ValueError(f"paired scores must be two vectors of one length; got {base.shape} and {comp.shape}")
    n = base.size
    if n == 0:
        return {"n": 0}
    labels = np.zeros(n, dtype=int) if task is None else np.asarray(task)
    if labels.shape != (n,):
        raise ValueError(f"task labels must be one per example ({n}); got shape {labels.shape}")
    groups = [np.flatnonzero(labels == t) for t in dict.fromkeys(labels.tolist())]
    d = comp - base

    def se(x: np.ndarray) -> float:
        # the stratified mean's standard error: each task's variance over its size, weighted by its share
        parts = [(len(g) / n) ** 2 * np.var(x[g], ddof=1) / len(g) for g in groups if len(g) > 1]
        return float(math.sqrt(sum(parts))) if parts else math.nan

    binary = is_binary(base, comp)
    test, p = paired_test(base, comp, seed)
    low, high = bootstrap_ci([d[g] for g in groups], seed)
    # the expanded deviations can reach past what two scores in this range can differ by
    span = float(max(base.max(), comp.max()) - min(base.min(), comp.min()))
    low, high = max(low, -span), min(high, span)
    se_d = se(d)
    return {
        "n": n,
        "acc_base": float(base.mean()),
        "stderr_base": se(base),
        "acc_comp": float(comp.mean()),
        "stderr_comp": se(comp),
        "diff": float(d.mean()),
        "stderr_diff": se_d,
        "ci95_low": low,
        "ci95_high": high,
        "ci_method": "bootstrap" if len(groups) == 1 else "bootstrap_stratified",
        "binary": binary,
        "flipped_to_wrong": int(np.sum((base == 1) & (comp == 0))),
        "flipped_to_right": int(np.sum((base == 0) & (comp == 1))),
        "worse": int(np.sum(d < 0)),
        "better": int(np.sum(d > 0)),
        "paired_test": test,
        "p_value": p,
        # McNemar counts only 1 <-> 0 flips: undefined where scores give partial credit
        "mcnemar_p": p if binary else math.nan,
        "detectable_diff": detectable(se_d),
        "identical": bool(np.array_equal(base, comp)),
    }


def smallest_significant_flips(alpha: float = 0.05) -> int:
    """The fewest discordant pairs, all flipped one way, for which the exact McNemar test gives p < ``alpha``
    (6 at 0.05): with n binary examples, an accuracy change below this over n is never significant."""
    k = 1
    while stats.binomtest(0, k, 0.5).pvalue >= alpha:
        k += 1
    return k
