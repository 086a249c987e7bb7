"""The frontier section: fitted transform and predictive coders against per-vector references, per model."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from kvbench.report import study_figures
from kvbench.report.collect import Collection, numeric
from kvbench.report.sections.per_model import by_model, model_first, trace_notes
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

FRONTIER_COLUMNS = pick("model", "compressor", "compressor_params.bits", "exact_tokens", "stream_bits_per_element",
                        "bits_per_element", "codec_bits", "stream_compression_ratio", "delta_nll", "delta_nll_ci_text",
                        "nll_verdict", "rel_mse_k", "rel_mse_v")
FRONTIER_BEST_COLUMNS = pick("model", "compressor", "compressor_params.bits", "exact_tokens",
                             "stream_bits_per_element", "bits_per_element", "codec_bits", "delta_nll",
                             "delta_nll_ci_text", "nll_verdict")
RATE_NOTE = ("stream bits/elt: the bitstreams alone over every K and V element; bits/elt: with the codec's fitted "
             "parameters (codec bits) charged once to this run; dNLL: held-out NLL change with its paired 95% "
             "interval; within 1%? decided on the interval against 1% of the base NLL.")
#: per compressor: the fields naming the tokens it stores exactly in 16 bit (first ``sinks``, last ``recent``)
EXACT_FIELDS = {"kvtc": ("sinks", "window"), "aquakv": ("sinks", None), "kivi": (None, "residual")}


def param_count(row: pd.Series, field: str | None) -> int:
    """The row's ``compressor_params.<field>`` as a count; 0 when there is no such field or value."""
    v = pd.to_numeric(row.get(f"compressor_params.{field}"), errors="coerce") if field else math.nan
    return int(v) if pd.notna(v) else 0


def tokens_text(sinks: int, recent: int, recent_word: str = "recent") -> str:
    """``4 sinks + 128 recent``: the tokens kept first and last, or ``none``."""
    parts = [f"{sinks} sinks"] * (sinks > 0) + [f"{recent} {recent_word}"] * (recent > 0)
    return " + ".join(parts) or "none"


def exact_tokens(d: pd.DataFrame) -> pd.Series:
    """Per row, the tokens its coder stores exactly in 16 bit: ``4 sinks + 128 recent``, or ``none``."""
    def one(r: pd.Series) -> str:
        sinks, recent = EXACT_FIELDS.get(str(r["compressor"]), (None, None))
        return tokens_text(param_count(r, sinks), param_count(r, recent))
    return d.apply(one, axis=1) if not d.empty else pd.Series(dtype=str)


def frontier_label(d: pd.DataFrame) -> pd.Series:
    """A curve per coder: its name, TurboQuant's range-coded codes and KVTC without its exact recent window as
    curves of their own."""
    if d.empty:
        return pd.Series(dtype=str)
    name = d["compressor"].astype(str)
    coded = d.get("compressor_params.entropy_coding", pd.Series(False, index=d.index)).astype(str) == "True"
    no_window = (name == "kvtc") & (numeric(d, "compressor_params.window") == 0)
    return name.where(~coded, name + " (range-coded)").where(~no_window, name + " (no window)")


def lowest_within(d: pd.DataFrame, by: Sequence[str] = ("model", "series")) -> pd.DataFrame:
    """Per model and curve, the cell with the fewest stream bits per element whose delta-NLL interval lies wholly
    within 1% of the base NLL (verdict ``within``); curves without one are left out."""
    if d.empty or "nll_verdict" not in d:
        return d.iloc[0:0]
    ok = d[(d["nll_verdict"] == "within") & numeric(d, "stream_bits_per_element").notna()]
    if ok.empty:
        return ok
    best = ok.loc[numeric(ok, "stream_bits_per_element").groupby([ok[c] for c in by]).idxmin()]
    return model_first(best, "stream_bits_per_element", models=list(d["model"]))


def frontier(got: Collection) -> tuple[list[Table], Figures]:
    d = got.table
    d = d.assign(series=frontier_label(d), exact_tokens=exact_tokens(d))
    d = model_first(d.assign(compressor=d["series"]))
    tables = [Table("frontier", d, FRONTIER_COLUMNS, "every cell", f"{trace_notes(d)} {RATE_NOTE}".strip(), csv=True),
              Table("frontier", lowest_within(d), FRONTIER_BEST_COLUMNS,
                    "fewest stream bits per element within 1% NLL, per coder and model",
                    empty="_no cell is within 1% on its interval_\n")]
    figures = {f"frontier_{model}": study_figures.nll_vs_stream_bits(g, "Frontier")
               for model, g in by_model(d)}
    return tables, figures
