"""The transfer section: each coder setting's verdicts on every model side by side (what holds where), and which
distortion measure ranks the cells as their loss does.

A verdict that holds on one small model may flip on another family (Qwen2.5's keys carry large outliers), so every
setting is measured on each model's own windows and its three verdicts are put in one row: next-token NLL within 1%
of the base, and the recall probe's loss no worse than the FP8 cache's on the same copy spans. A setting whose
verdicts agree on every model *holds*; one whose verdicts differ *flips*.

Which distortion predicts the loss is a rank correlation (Spearman's rho) over the lossy cells (the reference row
left out), per model and pooled over models, with a bootstrap 95% interval that resamples cells. Pooled, each cell's
loss is taken relative to its model's base NLL so that models of different perplexity share one scale.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvbench.report.collect import Collection, numeric
from kvbench.report.sections.frontier_section import (
    RECALL_NOTE,
    exact_tokens,
    frontier_label,
    is_reference,
    recall_vs_reference,
)
from kvbench.report.sections.per_model import model_first, trace_notes
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import Column, pick

CELL_COLUMNS = pick("model", "context_len", "compressor", "compressor_params.bits", "exact_tokens", "stream_bits_per_element",
                    "rel_mse_k", "rel_mse_v", "attn_logit_rel_mse", "attn_output_rel_err", "attn_logit_mse",
                    "attn_kl", "nll_base", "delta_nll",
                    "delta_nll_ci_text", "nll_verdict", "delta_nll_recall", "delta_nll_recall_ci_text",
                    "recall_vs_ref", "recall_vs_ref_ci_text", "recall_vs_ref_verdict", "eval_documents_n",
                    "measure_s", "load_average_1min")
#: the distortions whose rank agreement with the loss is measured: summary key -> what the table calls it
DISTORTIONS = {"rel_mse_k": "rel MSE K", "rel_mse_v": "rel MSE V", "rel_mse_kv": "rel MSE K+V (mean)",
               "attn_logit_rel_mse": "attention-logit rel MSE", "attn_output_rel_err": "attention-output rel err",
               "attn_logit_mse": "attention-logit MSE (softmax units)", "attn_kl": "attention KL"}
#: the losses they are ranked against: column -> what the table calls it
LOSSES = {"rel_delta_nll": "next-token dNLL / base", "rel_delta_nll_recall": "recall dNLL / recall base"}
POOLED = "all models"
#: bootstrap draws of the correlation's interval, and their seed (the table is the same bytes on every rebuild)
RESAMPLES, SEED = 2000, 0
CORRELATION_COLUMNS = pick("model") + [
    Column("distortion", "distortion", "distortion", "s"), Column("loss", "loss", "loss", "s"),
    Column("rho", "Spearman rho", r"Spearman $\rho$", "+.2f"), Column("rho_ci_text", "rho 95% CI", r"$\rho$ 95\% CI", "s"),
    Column("cells", "cells", "cells", "d")]
VERDICT_NOTE = ("within 1%?: the next-token dNLL's paired 95% interval against 1% of the model's base NLL; no worse "
                "than FP8?: the recall probe's loss minus the FP8 cache's on the same copy spans, against a margin "
                "(the frontier's rule); holds: the same verdict on every model the setting ran on; flips: not.")
CORRELATION_NOTE = ("Spearman's rho between each distortion and each loss over the lossy cells (the FP8 reference row "
                    "left out), per model and pooled over the models with each loss divided by its model's base "
                    f"NLL; 95% interval: {RESAMPLES} bootstrap resamples of the cells (seed {SEED}). A measure that "
                    "predicts the loss has rho near +1 on every model.")


def setting(d: pd.DataFrame) -> pd.Series:
    """A coder setting across models: its curve label, nominal bits and context length (``kivi 2 @1024``,
    ``turboquant range-coded 3 @4096``): a verdict is compared across models at one length."""
    bits = d.get("compressor_params.bits", pd.Series(math.nan, index=d.index))
    length = numeric(d, "context_len")
    return (frontier_label(d).astype(str) + bits.map(lambda b: "" if pd.isna(b) else f" {float(b):g}")
            + length.map(lambda n: "" if pd.isna(n) else f" @{int(n)}"))


def _rank_corr(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman's rho of each row pair of ``x``, ``y`` ``(R, n)``: Pearson's correlation of the average ranks; NaN
    where a row is constant."""
    from scipy.stats import rankdata

    rx, ry = rankdata(x, axis=1), rankdata(y, axis=1)  # (R, n)
    rx, ry = rx - rx.mean(1, keepdims=True), ry - ry.mean(1, keepdims=True)
    den = np.sqrt((rx**2).sum(1) * (ry**2).sum(1))  # (R,)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (rx * ry).sum(1) / den, np.nan)


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rho; NaN with fewer than three pairs or a constant side."""
    return math.nan if len(x) < 3 else float(_rank_corr(x[None], y[None])[0])


def rho_interval(x: np.ndarray, y: np.ndarray, resamples: int = RESAMPLES, seed: int = SEED) -> tuple[float, float]:
    """The 2.5 and 97.5 percentiles of rho over cells resampled with replacement (draws with a constant side skipped)."""
    if len(x) < 3:
        return math.nan, math.nan
    draws = np.random.default_rng(seed).integers(0, len(x), size=(resamples, len(x)))  # (R, n)
    rhos = _rank_corr(x[draws], y[draws])
    rhos = rhos[np.isfinite(rhos)]
    return (math.nan, math.nan) if rhos.size == 0 else tuple(float(q) for q in np.percentile(rhos, [2.5, 97.5]))


def with_losses(d: pd.DataFrame) -> pd.DataFrame:
    """``d`` with the losses relative to the model's base NLLs and the K and V relative MSEs' mean."""
    return d.assign(rel_delta_nll=numeric(d, "delta_nll") / numeric(d, "nll_base"),
                    rel_delta_nll_recall=numeric(d, "delta_nll_recall") / numeric(d, "nll_recall_base"),
                    rel_mse_kv=(numeric(d, "rel_mse_k") + numeric(d, "rel_mse_v")) / 2)


def correlations(d: pd.DataFrame) -> pd.DataFrame:
    """One row per (model or :data:`POOLED`, distortion, loss): rho, its interval and the cells it rests on."""
    lossy = with_losses(d[~is_reference(d) & ~d.get("lossless", pd.Series(False, index=d.index)).astype(bool)])
    groups = [(str(m), g) for m, g in lossy.groupby("model", sort=False)]
    if len(groups) > 1:
        groups.append((POOLED, lossy))
    rows = []
    for model, g in groups:
        for dist, dist_name in DISTORTIONS.items():
            for loss, loss_name in LOSSES.items():
                x, y = numeric(g, dist).to_numpy(float), numeric(g, loss).to_numpy(float)
                ok = np.isfinite(x) & np.isfinite(y)
                if ok.sum() == 0:
                    continue
                lo, hi = rho_interval(x[ok], y[ok])
                rows.append({"model": model, "distortion": dist_name, "loss": loss_name,
                             "rho": spearman(x[ok], y[ok]), "rho_ci_text": _ci(lo, hi), "cells": int(ok.sum())})
    return pd.DataFrame(rows)


def _ci(lo: float, hi: float) -> str | float:
    return f"[{lo:+.2f}, {hi:+.2f}]" if math.isfinite(lo) and math.isfinite(hi) else math.nan


def verdicts(d: pd.DataFrame) -> tuple[pd.DataFrame, list[Column]]:
    """One row per coder setting, two verdict columns per model and whether each verdict holds on every model."""
    models = list(dict.fromkeys(d["model"].astype(str)))
    rows = []
    for name, g in d.groupby("setting", sort=False):
        row = {"setting": name}
        for axis in ("nll_verdict", "recall_vs_ref_verdict"):
            got = {str(r["model"]): r.get(axis) for _, r in g.iterrows()}
            for m in models:
                row[f"{m}:{axis}"] = got.get(m, math.nan)
            seen = {v for v in got.values() if isinstance(v, str)}
            row[f"{axis}:holds"] = ("holds" if len(seen) == 1 and len(got) == len(models) else
                                    "flips" if len(seen) > 1 else math.nan)
        rows.append(row)
    cols = [Column("setting", "coder setting", "coder setting", "s")]
    for axis, what in (("nll_verdict", "within 1%?"), ("recall_vs_ref_verdict", "no worse than FP8?")):
        cols += [Column(f"{m}:{axis}", f"{m} {what}", f"{m} {what}", "s") for m in models]
        cols.append(Column(f"{axis}:holds", f"{what} on every model", f"{what} on every model", "s"))
    return pd.DataFrame(rows), cols


COST_COLUMNS = pick("model") + [Column("cells", "cells", "cells", "d"), Column("study_s", "cells' wall s (sum)",
                                                                            "cells' wall s (sum)", ",.0f"),
                                 Column("cell_s_max", "slowest cell s", "slowest cell s", ",.0f")]
COST_NOTE = ("What the study cost on the machine it ran on: the sum of its cells' wall times (`measure_s`: capture, "
             "fits and the 16-bit baseline included where a cell did them; a later cell of the same process reuses "
             "the trace and the baseline) and the slowest cell, per model.")


def cost(d: pd.DataFrame) -> pd.DataFrame:
    """Per model: its cells, the sum of their wall times and the slowest one."""
    s = numeric(d, "measure_s")
    g = s.groupby(d["model"], sort=False)
    return pd.DataFrame({"model": list(g.groups), "cells": g.size().to_numpy(), "study_s": g.sum().to_numpy(),
                         "cell_s_max": g.max().to_numpy()})


def transfer(got: Collection, stem: str = "transfer") -> tuple[list[Table], Figures]:
    """The section's tables, under ``stem`` (the long-context study shows its cells with the same tables)."""
    d = got.table
    if d.empty:
        return [Table(stem, d, CELL_COLUMNS, "every cell", "")], {}
    d = d.assign(series=frontier_label(d), exact_tokens=exact_tokens(d))
    d = model_first(recall_vs_reference(d.assign(compressor=d["series"]), got), "stream_bits_per_element")
    d = d.assign(setting=setting(d))
    table, cols = verdicts(d[~is_reference(d)])
    return [Table(stem, table, cols, "each coder setting's verdicts on every model", VERDICT_NOTE, csv=True),
            Table(f"{stem}_cells", d, CELL_COLUMNS, "every cell", f"{trace_notes(d)} {RECALL_NOTE}".strip(), csv=True),
            Table(f"{stem}_correlations", correlations(d), CORRELATION_COLUMNS,
                  "which distortion ranks the cells as their loss does", CORRELATION_NOTE, csv=True),
            Table(f"{stem}_cost", cost(d), COST_COLUMNS, "what the study cost", COST_NOTE)], {}


def long_context(got: Collection) -> tuple[list[Table], Figures]:
    """The long-context study: the transfer study's settings at 4,096 tokens, in the same tables."""
    return transfer(got, "long_context")
