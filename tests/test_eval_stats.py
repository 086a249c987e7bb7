"""Paired statistics of task scores: the coverage of each interval method on simulated binary and fractional paired
scores, the test that fits each kind of score, the detectable difference, and degenerate inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvbench.measure.evaluation.stats import bootstrap_ci, detectable, paired_scores, paired_test


def _binary(rng: np.random.Generator, n: int, p_base: float, lose: float, gain: float) -> tuple[np.ndarray, float]:
    """Paired differences of 0/1 scores: a right answer lost with probability ``lose``, a wrong one gained with
    ``gain``; and their true mean."""
    base = (rng.random(n) < p_base).astype(float)
    u = rng.random(n)
    comp = np.where(base == 1, (u >= lose).astype(float), (u < gain).astype(float))
    return comp - base, p_base * -lose + (1 - p_base) * gain


def _fraction(rng: np.random.Generator, n: int, p_found: float, lose: float) -> tuple[np.ndarray, float]:
    """Paired differences of string_match_all scores over four answers: each found answer lost with ``lose``."""
    found = rng.binomial(4, p_found, n)
    lost = rng.binomial(found, lose)
    return -lost / 4, -p_found * lose


def _coverage(draw, runs: int) -> float:
    rng = np.random.default_rng(20240601)
    hits = 0
    for i in range(runs):
        strata, truth = draw(rng)
        low, high = bootstrap_ci(strata, seed=i, resamples=999)
        hits += low <= truth <= high
    return hits / runs


@pytest.mark.parametrize("kind", ["binary", "fraction"])
def test_one_task_interval_covers_the_true_difference(kind):
    # a one-sided loss on 50 binary examples (at 30 the expanded percentile interval covers about 93%, short of
    # nominal: few discordant pairs make the mean's distribution skewed); 30 fractional ones
    def draw(rng):
        d, truth = _binary(rng, 50, 0.65, 0.25, 0.1) if kind == "binary" else _fraction(rng, 30, 0.7, 0.2)
        return [d], truth

    assert _coverage(draw, 1500) >= 0.93


@pytest.mark.parametrize("kind", ["binary", "fraction"])
def test_pooled_interval_stratified_by_task_covers_the_true_difference(kind):
    # ten tasks of six examples each, every task with its own accuracy and loss: the pooled RULER row's shape
    task_rng = np.random.default_rng(7)
    p, lose, gain = task_rng.uniform(0.2, 0.95, 10), task_rng.uniform(0.0, 0.5, 10), task_rng.uniform(0.0, 0.15, 10)

    def draw(rng):
        parts = [_binary(rng, 6, p[t], lose[t], gain[t]) if kind == "binary" else _fraction(rng, 6, p[t], lose[t])
                 for t in range(10)]
        return [d for d, _ in parts], float(np.mean([truth for _, truth in parts]))

    assert _coverage(draw, 300) >= 0.93


def test_binary_scores_get_mcnemar_and_fractions_a_permutation_test():
    base = np.array([1, 1, 0, 0, 0, 0, 0, 1], dtype=float)
    comp = np.ones(8)
    s = paired_scores(base, comp)
    assert s["acc_base"] == 3 / 8 and s["acc_comp"] == 1.0 and s["diff"] == 5 / 8 and s["binary"]
    assert s["flipped_to_right"] == 5 and s["flipped_to_wrong"] == 0
    assert s["paired_test"] == "mcnemar_exact" and s["p_value"] == s["mcnemar_p"] == pytest.approx(2 * 0.5**5)
    assert s["ci95_low"] < s["diff"] < s["ci95_high"] <= 1.0
    # partial credit: four pairs each lose a quarter, McNemar sees no 1 <-> 0 flip but the permutation test does
    frac_b = np.array([1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.75, 0.75])
    frac_c = frac_b - np.array([0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25])
    f = paired_scores(frac_b, frac_c)
    assert not f["binary"] and f["paired_test"] == "permutation" and math.isnan(f["mcnemar_p"])
    assert f["flipped_to_wrong"] == 0 and f["worse"] == 8
    assert f["p_value"] == pytest.approx(2 / 2**8)  # exact: only all-worse and all-better are as extreme
    assert f["ci95_low"] == f["ci95_high"] == -0.25  # every pair lost the same
    assert paired_test(frac_b, frac_b) == ("permutation", 1.0)


def test_interval_and_test_agree_on_a_clear_loss():
    rng = np.random.default_rng(3)
    base = (rng.random(40) < 0.8).astype(float)
    comp = base * (rng.random(40) < 0.4)
    s = paired_scores(base, comp)
    assert s["p_value"] < 0.05 and s["ci95_high"] < 0


def test_identical_sides_and_tiny_samples():
    base = np.array([1.0, 0.0, 1.0, 0.5])
    same = paired_scores(base, base)
    assert same["identical"] and same["p_value"] == 1.0 and same["stderr_diff"] == 0
    assert same["ci95_low"] == same["ci95_high"] == 0.0 and same["detectable_diff"] == 0.0
    one = paired_scores(np.array([1.0]), np.array([0.0]))
    assert one["n"] == 1 and math.isnan(one["ci95_low"]) and math.isnan(one["detectable_diff"])
    assert paired_scores(np.array([0.75]), np.array([0.25]))["p_value"] == 1.0
    assert paired_scores(np.zeros(0), np.zeros(0)) == {"n": 0}
    with pytest.raises(ValueError, match="one length"):
        paired_scores(base, base[:3])
    with pytest.raises(ValueError, match="one per example"):
        paired_scores(base, base, task=["a", "b"])


def test_pooled_stats_are_stratified_by_task():
    # task a: all lost; task b: unchanged. Pooled diff is the example-weighted mean; within-task spread is zero,
    # so the stratified interval and standard error are exactly zero width, unlike a pool that ignores the tasks
    base = np.ones(12)
    comp = np.r_[np.zeros(4), np.ones(8)]
    task = ["a"] * 4 + ["b"] * 8
    s = paired_scores(base, comp, task=task)
    assert s["diff"] == pytest.approx(-1 / 3) and s["stderr_diff"] == 0.0 and s["ci_method"] == "bootstrap_stratified"
    assert s["ci95_low"] == pytest.approx(-1 / 3) and s["ci95_high"] == pytest.approx(-1 / 3)
    flat = paired_scores(base, comp)
    assert flat["ci95_low"] < -1 / 3 < flat["ci95_high"] and flat["ci_method"] == "bootstrap"


def test_detectable_difference_is_2_8_standard_errors():
    assert detectable(0.1) == pytest.approx(0.28016, rel=1e-4)
    rng = np.random.default_rng(5)
    base = (rng.random(50) < 0.7).astype(float)
    comp = base * (rng.random(50) < 0.8)
    s = paired_scores(base, comp)
    assert s["detectable_diff"] == pytest.approx(2.8016 * np.std(comp - base, ddof=1) / math.sqrt(50), rel=1e-4)
