"""The eviction section: every eviction cell against random eviction, and eviction against quantization at
similar stored bits."""

from __future__ import annotations

import pandas as pd

from kvbench.report import study_figures
from kvbench.report.collect import Collection, fact, numeric
from kvbench.report.sections.frontier_section import exact_tokens, frontier_label
from kvbench.report.sections.per_model import by_model, model_first, trace_notes
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

EVICTION_COLUMNS = pick("model", "compressor", "compressor_params.keep", "always_kept", "kept_coding",
                        "stream_bits_per_element", "positions_bits_per_element", "bits_per_element", "delta_nll",
                        "delta_nll_ci_text", "nll_verdict", "delta_nll_recall", "delta_nll_recall_ci_text",
                        "eval_documents_n", "vs_random", "rel_mse_k", "rel_mse_v")
MATCHED_COLUMNS = pick("model", "compressor", "compressor_params.bits", "compressor_params.keep", "kept_coding",
                       "exact_tokens", "stream_bits_per_element", "bits_per_element", "delta_nll", "delta_nll_ci_text",
                       "nll_verdict", "delta_nll_recall", "delta_nll_recall_ci_text", "eval_documents_n")
EVICTION_NOTE = ("keep: fraction of tokens every layer and KV head keeps; always kept: tokens kept before any is "
                 "scored; stream bits/elt counts the kept KV and the coded kept positions over every K and V element "
                 "of the full cache; vs random: against random_eviction at the same keep, decided on the two "
                 "intervals (better/worse when they do not overlap); recall dNLL: the long-range copy probe's, with its "
                 "paired 95% interval; rel MSE on the kept entries only (0 when they are stored at 16 bits).")
MATCHED_NOTE = ("Eviction and quantization at similar stored bits: the cells of the eviction method with the lowest "
                "mean dNLL on each model (over its cells with 16-bit kept KV) and every cell whose kept KV a coder "
                "stores, beside the per-vector quantizers of the frontier presets, by stream bits per element.")


def always_kept(d: pd.DataFrame) -> pd.Series:
    """Per eviction row, the tokens it keeps before scoring any (sinks, an observation or recent window), as the
    method states them."""
    return fact(d, "always_kept")


def kept_coding(d: pd.DataFrame) -> pd.Series:
    """How the kept KV is stored: ``16-bit``, or the inner coder and its bits."""
    return fact(d, "kept_coding")


def against_random(d: pd.DataFrame) -> pd.Series:
    """Per eviction row, ``better``/``worse`` than random_eviction at the same model and keep when the two delta-NLL
    intervals do not overlap, ``overlaps`` when they do."""
    out = pd.Series("", index=d.index, dtype=object)
    if d.empty:
        return out
    lo, hi, keep = numeric(d, "delta_nll_low"), numeric(d, "delta_nll_high"), numeric(d, "compressor_params.keep")
    rand = fact(d, "random_baseline").eq(True) & (kept_coding(d) == "16-bit")
    for i in d.index[~rand & keep.notna()]:
        ref = d.index[rand & (d["model"] == d.at[i, "model"]) & (keep == keep[i])]
        if len(ref) == 0 or pd.isna(lo[i]):
            continue
        r = ref[0]
        out[i] = "better" if hi[i] < lo[r] else "worse" if lo[i] > hi[r] else "overlaps"
    return out


def eviction(got: Collection) -> tuple[list[Table], Figures]:
    d = got.table
    if d.empty:
        return [], {}
    ev = d[d["preset"].astype(str).str.startswith("eviction")] if "preset" in d else d
    ref = d.drop(ev.index)
    ev = ev.assign(series=frontier_label(ev), always_kept=always_kept(ev), kept_coding=kept_coding(ev),
                   positions_bits_per_element=numeric(ev, "compressor_stats.positions_bits") / numeric(ev, "n_elements"))
    ev = model_first(ev.assign(vs_random=against_random(ev), compressor=ev["series"]), "compressor_params.keep")
    ref = ref.assign(series=frontier_label(ref), exact_tokens=exact_tokens(ref))
    ref = ref.assign(compressor=ref["series"])
    tables = [Table("eviction", ev, EVICTION_COLUMNS, "every eviction cell", f"{trace_notes(ev)} {EVICTION_NOTE}".strip(),
                    csv=True)]
    both = pd.concat([beside_quantizers(ev).assign(exact_tokens="-"), ref], ignore_index=True)
    if not both.empty:
        both = model_first(both, "stream_bits_per_element", models=list(ev["model"]))
        tables.append(Table("eviction", both, MATCHED_COLUMNS,
                            "eviction against quantization at similar stored bits", MATCHED_NOTE))
    every = pd.concat([ev, ref], ignore_index=True)
    figures = {f"eviction_{model}": study_figures.nll_vs_stream_bits(g, "Eviction", reference=ref_names(g))
               for model, g in by_model(every)}
    return tables, figures


def beside_quantizers(ev: pd.DataFrame) -> pd.DataFrame:
    """The eviction cells set beside the quantizers: the strongest method's at 16 bits and every cell whose kept KV
    a coder stores (eviction and coding on one frontier)."""
    return ev[ev.index.isin(strongest(ev).index) | (kept_coding(ev) != "16-bit")]


def strongest(ev: pd.DataFrame) -> pd.DataFrame:
    """Per model, every cell of the eviction method with the lowest mean delta-NLL over its cells that keep the KV
    at 16 bits: the method set beside the quantizers."""
    method = ev.get("compressor_params.name", ev["compressor"]).astype(str)
    plain16 = kept_coding(ev) == "16-bit"
    keep = pd.Series(False, index=ev.index)
    for _, g in ev[plain16].groupby("model", sort=False):
        means = numeric(g, "delta_nll").groupby(method[g.index]).mean().dropna()
        if not means.empty:
            keep |= (ev["model"] == g["model"].iloc[0]) & (method == means.idxmin())
    return ev[keep]


def ref_names(d: pd.DataFrame) -> set[str]:
    """The curves of rows that are not eviction (the quantizers drawn for reference)."""
    return set(d.loc[~d["preset"].astype(str).str.startswith("eviction"), "series"]) if "preset" in d else set()
