"""The sequential coders' section: rate, distortion and time per cell, and where the residual coders' bits go."""

from __future__ import annotations

import pandas as pd

from kvbench.report import study_figures
from kvbench.report.collect import Collection, numeric, series_label
from kvbench.report.sections.per_model import trace_note
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

SEQUENTIAL_COLUMNS = pick("compressor", "bits_per_token", "x_bound", "compression_ratio", "bits_per_element",
                          "lossless", "rel_mse_k", "rel_mse_v", "delta_nll", "delta_nll_ci_text", "encode_s_per_seq",
                          "decode_s_per_seq", formats={"compression_ratio": ",.2f"})
PARTS_COLUMNS = pick("compressor", "part.k_residual", "part.k_residual_ideal", "part.v_residual",
                     "part.v_residual_ideal", "part.scales", "part.tokens", "part.tokens_ideal", "part.frame",
                     "side_info_bits", "part.side_info")
PARTS_NOTE = ("Per token: coded = the bitstream's parts; ideal = the coder's own model of them (sum of -log2 p); side "
              "info = fitted weights and steps, charged once per run and here spread over the run's tokens.")


def bits_per_part(d: pd.DataFrame) -> pd.DataFrame:
    """Per token, each part of the residual coders' bitstreams (the rows that code a K residual), coded and as the
    coder's model estimates it. Plain token ids have no model estimate: their size is their ideal."""
    d = d[numeric(d, "bits_by_part.k.residual").notna()]
    n = numeric(d, "n_tokens")
    per = lambda col: numeric(d, col) / n  # noqa: E731
    tokens = per("bits_by_part.tokens")
    return d.assign(**{
        "part.k_residual": per("bits_by_part.k.residual"),
        "part.k_residual_ideal": per("compressor_stats.ideal_bits.k.residual"),
        "part.v_residual": per("bits_by_part.v.residual"),
        "part.v_residual_ideal": per("compressor_stats.ideal_bits.v.residual"),
        "part.scales": per("bits_by_part.scales"),
        "part.tokens": tokens,
        "part.tokens_ideal": per("compressor_stats.tokens.ideal_token_bits").fillna(tokens),
        "part.frame": (numeric(d, "bits_by_part.frame") + numeric(d, "bits_by_part.bounds").fillna(0)) / n,
        "part.side_info": per("side_info_bits"),
    })


def sequential(got: Collection) -> tuple[list[Table], Figures]:
    d = got.table.assign(series=series_label(got.table, exclude=()))
    d = d.assign(compressor=d["series"])
    tables = [Table("sequential", d, SEQUENTIAL_COLUMNS, "rate, distortion and time per cell", trace_note(d)),
              Table("sequential", bits_per_part(d), PARTS_COLUMNS, "where the residual coders' bits go", PARTS_NOTE)]
    return tables, {"sequential": study_figures.sequential(d)}
