"""Paired NLL statistics of a scored run: the mean NLL with and without compression, the paired difference with its
interval (documents, then blocks within them) and the verdict against the 1% line, for the next-token continuation
and for the long-range recall probe. One place, so that a run, each of its fit draws and ``report --check``'s
re-derivation from the per-token arrays compute them alike."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbench.measure.metrics.intervals import NLL_TOLERANCE, detectable_from_ci, document_bootstrap_ci, verdict


def task_loss(nll_base: list[np.ndarray], nll_comp: list[np.ndarray], metrics: Any, documents: Sequence[int] | None = None) -> dict:
    """Mean NLL with and without compression over every scored token, the paired difference with its 95%
    interval resampling documents and blocks within them (:mod:`kvbench.measure.metrics.intervals`; ``documents``:
    each window's document, None: one each), and the verdict against the 1% line."""
    if not nll_base:
        nan = math.nan
        return {"nll_base": nan, "nll_compressed": nan, "delta_nll": nan, "delta_nll_ci": [nan, nan],
                "nll_base_ci": [nan, nan], "eval_tokens": 0, "delta_nll_verdict_1pct": "unresolved", "delta_nll_mde": nan}
    block, resamples, seed = int(metrics.ci_block), int(metrics.ci_resamples), int(metrics.ci_seed)
    base, comp = np.concatenate(nll_base), np.concatenate(nll_comp)
    diffs = [c - b for b, c in zip(nll_base, nll_comp)]
    docs = None if documents is None else list(documents)[: len(diffs)]
    delta_ci = document_bootstrap_ci(diffs, docs, block, resamples, seed)
    nll_base_mean = float(base.mean())
    delta = float(comp.mean() - nll_base_mean)
    n_docs = len(set(range(len(diffs)) if docs is None else docs))
    return {
        "nll_base": nll_base_mean,
        "nll_compressed": float(comp.mean()),
        "delta_nll": delta,
        "delta_nll_ci": delta_ci,
        "nll_base_ci": document_bootstrap_ci(nll_base, docs, block, resamples, seed),
        "eval_documents_n": n_docs,
        "eval_tokens": int(base.size),
        "ci_block_tokens": block,
        "delta_nll_verdict_1pct": verdict(delta_ci, NLL_TOLERANCE * nll_base_mean),
        **decidability(delta, delta_ci, NLL_TOLERANCE * nll_base_mean, n_docs),
        # the smallest true delta NLL these tokens detect 80% of the time at the 5% level, from this cell's spread
        "delta_nll_mde": detectable_from_ci(delta_ci),
    }


def decidability(delta: float, ci: Sequence[float], line: float, n_documents: int) -> dict:
    """How far an interval is from deciding its verdict against ``line``: ``delta_nll_ci_half_width_rel``, the
    interval's half-width over the line (the 1% margin; below 1 an interval narrower than the margin), and, while the
    verdict is unresolved, ``delta_nll_documents_needed``: the documents an interval of the observed spread would need
    to clear the line, its half-width shrinking as one over the square root of the documents resampled (None when
    the estimate sits on the line)."""
    low, high = ci
    half = (high - low) / 2
    out: dict = {"delta_nll_ci_half_width_rel": half / line if line > 0 else math.nan}
    if verdict(ci, line) == "unresolved" and math.isfinite(half):
        gap = abs(delta - line)
        out["delta_nll_documents_needed"] = math.ceil(n_documents * (half / gap) ** 2 - 1e-9) if gap > 0 else None
    return out


def recall_loss(nll_base: list[np.ndarray], nll_comp: list[np.ndarray], metrics: Any, documents: Sequence[int] | None,
                of: Sequence[int]) -> dict:
    """The long-range probe (:func:`kvbench.measure.run.recall_probe`): mean NLL of the copy spans with the uncompressed cache, the
    paired difference with its interval (documents and blocks, as ``delta_nll_ci``), and the tokens scored.
    ``of``: the scored item (and so the document) each span belongs to."""
    if not nll_base:
        return {"nll_recall_base": math.nan, "delta_nll_recall": math.nan, "delta_nll_recall_ci": [math.nan, math.nan],
                "recall_tokens": 0}
    base, comp = np.concatenate(nll_base), np.concatenate(nll_comp)
    docs = None if documents is None else [list(documents)[i] for i in of]
    ci = document_bootstrap_ci([c - b for b, c in zip(nll_base, nll_comp)], docs, int(metrics.ci_block),
                               int(metrics.ci_resamples), int(metrics.ci_seed))
    return {"nll_recall_base": float(base.mean()), "delta_nll_recall": float(comp.mean() - base.mean()),
            "delta_nll_recall_ci": ci, "recall_tokens": int(base.size), "recall_from": float(metrics.get("recall_from", 0.1))}
