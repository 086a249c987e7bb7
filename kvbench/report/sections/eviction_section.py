"""The eviction section: every eviction cell against random eviction, and eviction against quantization at
similar stored bits."""

from __future__ import annotations

import math

import pandas as pd

from kvbench.report import study_figures
from kvbench.report.collect import Collection, numeric, plain
from kvbench.report.sections.frontier_section import exact_tokens, frontier_label, param_count, tokens_text
from kvbench.report.sections.per_model import by_model, model_first, trace_notes
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

EVICTION_COLUMNS = pick("model", "compressor", "compressor_params.keep", "always_kept", "kept_coding",
                        "stream_bits_per_element", "positions_bits_per_element", "bits_per_element", "delta_nll",
                        "delta_nll_ci_text", "nll_verdict", "vs_random", "rel_mse_k", "rel_mse_v")
MATCHED_COLUMNS = pick("model", "compressor", "compressor_params.bits", "compressor_params.keep", "kept_coding",
                       "exact_tokens", "stream_bits_per_element", "bits_per_element", "delta_nll", "delta_nll_ci_text",
                       "nll_verdict")
EVICTION_NOTE = ("keep: fraction of tokens every layer and KV head keeps; always kept: tokens kept before any is "
                 "scored; stream bits/elt counts the kept KV and the coded kept positions over every K and V element "
                 "of the full cache; vs random: against random_eviction at the same keep, decided on the two "
                 "intervals (better/worse when they do not overlap); rel MSE on the kept entries only (0 when they are "
                 "stored at 16 bits).")
MATCHED_NOTE = ("Eviction and quantization at similar stored bits: SnapKV's cells beside the per-vector quantizers "
                "of the frontier presets, by stream bits per element.")


def always_kept(d: pd.DataFrame) -> pd.Series:
    """Per eviction row, the tokens it keeps before scoring any: sinks, an observation or recent window, H2O's recent
    share of the budget, StreamingLLM's whole budget as sinks plus recent tokens."""
    def one(r: pd.Series) -> str:
        name, t = str(r["compressor"]), numeric(pd.DataFrame([r]), "context_len").iloc[0]
        keep = pd.to_numeric(r.get("compressor_params.keep"), errors="coerce")
        k = math.floor(keep * t + 0.5) if pd.notna(keep) and pd.notna(t) else 0
        if name == "h2o":
            share = pd.to_numeric(r.get("compressor_params.recent"), errors="coerce")
            return tokens_text(0, math.floor(share * k + 0.5) if pd.notna(share) else 0)
        if name == "streaming_llm":
            return tokens_text(param_count(r, "sinks"), k - param_count(r, "sinks"))
        return tokens_text(param_count(r, "sinks"), param_count(r, "window"), "last")
    return d.apply(one, axis=1) if not d.empty else pd.Series(dtype=str)


def kept_coding(d: pd.DataFrame) -> pd.Series:
    """How the kept KV is stored: ``16-bit``, or the inner coder and its bits."""
    if d.empty:
        return pd.Series(dtype=str)
    inner = d.get("compressor_params.inner.name", pd.Series(math.nan, index=d.index))
    bits = numeric(d, "compressor_params.inner.bits")
    text = [("16-bit" if pd.isna(n) else f"{n} {plain(b)}-bit" if pd.notna(b) else str(n)) for n, b in zip(inner, bits)]
    return pd.Series(text, index=d.index)


def eviction_label(d: pd.DataFrame) -> pd.Series:
    """A curve per method and kept-KV coding: ``snapkv``, ``snapkv + turboquant 3-bit``."""
    if d.empty:
        return pd.Series(dtype=str)
    kept = kept_coding(d)
    return d["compressor"].astype(str).where(kept == "16-bit", d["compressor"].astype(str) + " + " + kept)


def against_random(d: pd.DataFrame) -> pd.Series:
    """Per eviction row, ``better``/``worse`` than random_eviction at the same model and keep when the two delta-NLL
    intervals do not overlap, ``overlaps`` when they do."""
    out = pd.Series("", index=d.index, dtype=object)
    if d.empty:
        return out
    lo, hi, keep = numeric(d, "delta_nll_low"), numeric(d, "delta_nll_high"), numeric(d, "compressor_params.keep")
    rand = (d["compressor"] == "random_eviction") & (kept_coding(d) == "16-bit")
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
    ev = ev.assign(series=eviction_label(ev), always_kept=always_kept(ev), kept_coding=kept_coding(ev),
                   positions_bits_per_element=numeric(ev, "compressor_stats.positions_bits") / numeric(ev, "n_elements"))
    ev = model_first(ev.assign(vs_random=against_random(ev), compressor=ev["series"]), "compressor_params.keep")
    ref = ref.assign(series=frontier_label(ref), exact_tokens=exact_tokens(ref))
    ref = ref.assign(compressor=ref["series"])
    tables = [Table("eviction", ev, EVICTION_COLUMNS, "every eviction cell", f"{trace_notes(ev)} {EVICTION_NOTE}".strip(),
                    csv=True)]
    snap = ev[ev["compressor"].astype(str).str.startswith("snapkv")].assign(exact_tokens="-")
    both = pd.concat([snap, ref], ignore_index=True)
    if not both.empty:
        both = model_first(both, "stream_bits_per_element", models=list(ev["model"]))
        tables.append(Table("eviction", both, MATCHED_COLUMNS,
                            "eviction against quantization at similar stored bits", MATCHED_NOTE))
    every = pd.concat([ev, ref], ignore_index=True)
    figures = {f"eviction_{model}": study_figures.nll_vs_stream_bits(g, "Eviction", reference=ref_names(g))
               for model, g in by_model(every)}
    return tables, figures


def ref_names(d: pd.DataFrame) -> set[str]:
    """The curves of rows that are not eviction (the quantizers drawn for reference)."""
    return set(d.loc[~d["preset"].astype(str).str.startswith("eviction"), "series"]) if "preset" in d else set()
