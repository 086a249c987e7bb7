"""The transfer section: a verdict holds when every model gives it and flips when they differ; the rank correlation
is Spearman's rho with a resampling interval, computed over the lossy cells only."""

import math

import numpy as np
import pandas as pd
import pytest
from scipy.stats import spearmanr

from kvbench.report.sections.transfer_section import correlations, rho_interval, spearman, verdicts


def test_spearman_is_scipys_rho_with_ties_and_nan_where_undefined():
    x = np.array([1.0, 2.0, 2.0, 5.0, 3.0])
    y = np.array([0.1, 0.4, 0.3, 0.9, 0.2])
    assert spearman(x, y) == pytest.approx(spearmanr(x, y).statistic)
    assert math.isnan(spearman(x[:2], y[:2])) and math.isnan(spearman(np.ones(4), np.arange(4.0)))


def test_the_interval_resamples_cells_and_brackets_rho():
    rng = np.random.default_rng(1)
    x = rng.normal(size=40)
    y = x + rng.normal(scale=0.5, size=40)
    lo, hi = rho_interval(x, y)
    assert lo < spearman(x, y) < hi and hi - lo < 0.5
    assert rho_interval(x, y) == (lo, hi)  # seeded: the page rebuilds to the same bytes
    lo, hi = rho_interval(x, rng.normal(size=40))
    assert lo < 0 < hi


def _cells(rows):
    return pd.DataFrame(rows, columns=["model", "setting", "nll_verdict", "recall_vs_ref_verdict"])


def test_a_verdict_holds_when_every_model_gives_it_and_flips_when_they_differ():
    d = _cells([("a", "kivi 4", "within", "no worse"), ("b", "kivi 4", "within", "worse"),
                ("a", "turboquant 4", "within", "worse"), ("b", "turboquant 4", "not within", "worse"),
                ("a", "delta 3", "within", "unresolved")])
    table, cols = verdicts(d)
    t = table.set_index("setting")
    assert t.loc["kivi 4", "nll_verdict:holds"] == "holds" and t.loc["kivi 4", "recall_vs_ref_verdict:holds"] == "flips"
    assert t.loc["turboquant 4", "nll_verdict:holds"] == "flips"
    assert t.loc["turboquant 4", "recall_vs_ref_verdict:holds"] == "holds"
    # measured on one model of two: neither holds nor flips
    assert math.isnan(t.loc["delta 3", "nll_verdict:holds"]) and math.isnan(t.loc["delta 3", "b:nll_verdict"])
    assert [c.key for c in cols][:4] == ["setting", "a:nll_verdict", "b:nll_verdict", "nll_verdict:holds"]


def test_correlations_leave_out_the_reference_and_lossless_rows_and_pool_relative_losses():
    rng = np.random.default_rng(0)
    rows = []
    for model, base in (("a", 3.0), ("b", 4.0)):
        for i in range(6):
            err = float(i + 1)
            rows.append({"model": model, "rel_mse_k": err, "rel_mse_v": err, "attn_logit_rel_mse": err,
                         "attn_output_rel_err": float(rng.normal()), "delta_nll": base * err / 100, "nll_base": base,
                         "delta_nll_recall": err, "nll_recall_base": 1.0, "lossless": False,
                         "compressor_facts.quality_reference": None})
        # a reference row and a lossless row far off the trend: they must not count
        rows.append({**rows[-1], "attn_logit_rel_mse": 100.0, "delta_nll": -5.0, "compressor_facts.quality_reference": True})
        rows.append({**rows[-2], "attn_logit_rel_mse": 1e-9, "delta_nll": 9.0, "lossless": True})
    got = correlations(pd.DataFrame(rows))
    logit = got[(got["distortion"] == "attention-logit rel MSE") & (got["loss"] == "next-token dNLL / base")]
    assert list(logit["model"]) == ["a", "b", "all models"]
    assert list(logit["cells"]) == [6, 6, 12] and np.allclose(logit["rho"], 1.0, atol=0.01)
