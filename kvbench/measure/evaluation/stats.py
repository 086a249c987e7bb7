"""Paired comparison of a compressor against the baseline on the same examples."""

from __future__ import annotations

import math

import numpy as np
from scipy import stats


def paired_binary(base: np.ndarray, comp: np.ndarray, z: float = 1.959964) -> dict[str, float]:
    """Accuracy of each side with its standard error, their difference with a 95% interval, and the exact
    McNemar test (a two-sided binomial test on the discordant pairs; p = 1 when there are none).

    The interval is the normal one on the per-example differences, whose spread already reflects the pairing.
    """
    base = np.asarray(base, dtype=float)
    comp = np.asarray(comp, dtype=float)
    if base.shape != comp.shape or base.ndim != 1:
        raise ValueError(f"paired scores must be two vectors of one length; got {base.shape} and {comp.shape}")
    n = base.size
    if n == 0:
        return {"n": 0}
    d = comp - base
    se = lambda x: float(np.std(x, ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    lost = int(np.sum((base == 1) & (comp == 0)))
    gained = int(np.sum((base == 0) & (comp == 1)))
    p = float(stats.binomtest(min(lost, gained), lost + gained, 0.5).pvalue) if lost + gained else 1.0
    diff, se_d = float(d.mean()), se(d)
    return {
        "n": n,
        "acc_base": float(base.mean()),
        "stderr_base": se(base),
        "acc_comp": float(comp.mean()),
        "stderr_comp": se(comp),
        "diff": diff,
        "stderr_diff": se_d,
        # a difference of two accuracies lies in [-1, 1]; the normal interval can overshoot it at small n
        "ci95_low": max(diff - z * se_d, -1.0) if n > 1 else math.nan,
        "ci95_high": min(diff + z * se_d, 1.0) if n > 1 else math.nan,
        "flipped_to_wrong": lost,
        "flipped_to_right": gained,
        "mcnemar_p": p,
        # no difference smaller than this can reach McNemar p < 0.05 on n pairs, whatever the data
        "smallest_significant_diff": smallest_significant_flips() / n,
        "identical": bool(np.array_equal(base, comp)),
    }


def smallest_significant_flips(alpha: float = 0.05) -> int:
    """The fewest discordant pairs, all flipped one way, for which the exact McNemar test gives p < ``alpha``
    (6 at 0.05): with n examples, an accuracy change below this over n is never significant."""
    k = 1
    while stats.binomtest(0, k, 0.5).pvalue >= alpha:
        k += 1
    return k
