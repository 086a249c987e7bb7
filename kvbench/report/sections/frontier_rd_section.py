"""The frontier's points against the Gaussian rate–distortion reference priced as each coder prices its error: for
the cells closest to each quality axis (the fewest bits within 1% next-token NLL, the recall of the FP8 cache, which
is a row here too), the stream bits, the weighted R(D) of the same windows at the cell's own weighted distortion, and
the two gaps it splits the distance into (:mod:`kvbench.measure.metrics.rate_distortion`)."""

from __future__ import annotations

import pandas as pd

from kvbench.report.collect import Collection, numeric
from kvbench.report.sections.frontier_section import (
    RD_NOTE,
    RD_WEIGHTED_NOTE,
    exact_tokens,
    frontier_label,
    recall_vs_reference,
)
from kvbench.report.sections.per_model import model_first, trace_notes
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

COLUMNS = pick("model", "compressor", "compressor_params.bits", "exact_tokens", "stream_bits_per_element",
               "rd_bits_per_element_pre_rope", "rd_key_weight", "rd_bits_per_element_weighted", "rd_gap_coder",
               "rd_times", "rd_gap_split", "rel_mse_k", "rel_mse_v", "delta_nll", "delta_nll_ci_text", "nll_verdict",
               "delta_nll_recall", "delta_nll_recall_ci_text", "recall_vs_ref", "recall_vs_ref_ci_text",
               "recall_vs_ref_verdict", "eval_documents_n")
NOTE = (f"{RD_NOTE} {RD_WEIGHTED_NOTE} Quantizer + entropy gap: stream bits minus R(D) weighted (x R(D): their "
        "ratio); K/V split gap: R(D) pre-RoPE minus R(D) weighted. A coder that also weighs tokens (by their attention) "
        "is priced here as if every token counted alike. dNLL and recall as on the frontier table; minus FP8's: the "
        "recall loss minus the FP8 row's on the same windows.")


def gaps(d: pd.DataFrame) -> pd.DataFrame:
    """``d`` with ``rd_gap_coder`` (stream bits minus the weighted R(D)), ``rd_times`` (their ratio) and
    ``rd_gap_split`` (the per-kind R(D) with RoPE undone, or as stored where the run had no config, minus the
    weighted one)."""
    weighted = numeric(d, "rd_bits_per_element_weighted")
    per_kind = numeric(d, "rd_bits_per_element_pre_rope").fillna(numeric(d, "rd_bits_per_element"))
    stream = numeric(d, "stream_bits_per_element")
    return d.assign(rd_gap_coder=stream - weighted, rd_times=stream / weighted, rd_gap_split=per_kind - weighted)


def frontier_rd(got: Collection) -> tuple[list[Table], Figures]:
    d = got.table
    if d.empty:
        return [Table("frontier_rd", d, COLUMNS, "every cell", "")], {}
    d = d.assign(series=frontier_label(d), exact_tokens=exact_tokens(d))
    d = model_first(gaps(recall_vs_reference(d.assign(compressor=d["series"]), got)), "stream_bits_per_element")
    return [Table("frontier_rd", d, COLUMNS, "every cell, against the weighted Gaussian R(D)",
                  f"{trace_notes(d)} {NOTE}".strip(), csv=True)], {}
