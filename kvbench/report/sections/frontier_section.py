"""The frontier section: fitted transform and predictive coders against per-vector references, per model."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from kvbench.measure.metrics.reference_diff import NO_WORSE_MARGIN, paired_difference
from kvbench.report import study_figures
from kvbench.report.collect import Collection, fact, interval_text, numeric
from kvbench.report.sections.per_model import by_model, model_first, trace_notes
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

FRONTIER_COLUMNS = pick("model", "context_len", "compressor", "compressor_params.bits", "exact_tokens", "stream_bits_per_element",
                        "bits_per_element", "bits_per_element_amortized", "codec_bits", "stream_compression_ratio",
                        "delta_nll", "delta_nll_ci_text", "nll_verdict", "eval_documents_n", "rel_mse_k", "rel_mse_v",
                        "rd_bits_per_element", "rd_bits_per_element_pre_rope", "rd_bits_per_element_weighted",
                        "rd_key_weight", "measure_s", "load_average_1min")
FRONTIER_BEST_COLUMNS = pick("model", "context_len", "compressor", "compressor_params.bits", "exact_tokens",
                             "stream_bits_per_element", "bits_per_element", "bits_per_element_amortized",
                             "codec_bits", "delta_nll",
                             "delta_nll_ci_text", "nll_verdict", "eval_documents_n", "rank_stream", "rank_charged", "rank_amortized")
RECALL_COLUMNS = pick("model", "context_len", "compressor", "compressor_params.bits", "exact_tokens", "stream_bits_per_element",
                      "nll_verdict", "nll_recall_base", "delta_nll_recall", "delta_nll_recall_ci_text", "recall_vs_ref",
                      "recall_vs_ref_ci_text", "recall_vs_ref_verdict", "eval_documents_n")
RECALL_BEST_COLUMNS = pick("model", "context_len", "compressor", "compressor_params.bits", "exact_tokens", "stream_bits_per_element",
                           "bits_per_element", "bits_per_element_amortized", "delta_nll_recall",
                           "delta_nll_recall_ci_text", "recall_vs_ref", "recall_vs_ref_ci_text", "nll_verdict",
                           "eval_documents_n", "rank_stream", "rank_charged", "rank_amortized")
RECALL_NOTE = ("recall dNLL: the long-range probe (a copy of an early passage, scored where the copy repeats it; "
               "`kvbench/measure/run.py`) with the compressed cache minus the 16-bit cache's, paired 95% interval over "
               "documents then blocks; minus FP8's: the same copy spans' compressed NLL minus the FP8 cache's on the same "
               "windows (`kvbench/measure/metrics/reference_diff.py`), no worse when its whole interval is at or below "
               f"{NO_WORSE_MARGIN:+g} nats.")
#: the three rates a point can be ranked by: rank column -> rate column
RANKS = {"rank_stream": "stream_bits_per_element", "rank_charged": "bits_per_element",
         "rank_amortized": "bits_per_element_amortized"}
RATE_NOTE = ("stream bits/elt: the bitstreams alone over every K and V element; bits/elt: with the codec's fitted "
             "parameters (codec bits) charged once to this run; amortized: with them spread over the tokens one fitted "
             "codec serves (rate.amortize_tokens, as the run records it); best points are ranked by stream bits; dNLL: "
             "held-out NLL change with its paired 95% interval; within 1%? decided on the interval against 1% of the "
             "base NLL.")
CELL_NOTE = ("cell s: the cell's wall time (capture, fit and the 16-bit baseline included where the cell did them; a "
             "later cell of the same process reuses the trace and the baseline), with the 1-minute load it ran under.")
RD_NOTE = ("Gaussian R(D): the bits per element reverse water-filling over each layer's covariance (the coded "
           "windows', keys as stored, and with RoPE undone) needs for the cell's own relative MSE of K and V, the rate "
           "a coder matched to second-order statistics reaches that error with (blank for a cell that evicts or is "
           "exact).")
RD_WEIGHTED_NOTE = ("R(D) weighted: the same windows' rate at the cell's error priced as its coder's allocation prices "
                    "it (keys' relative error times the key weight, plus the values'), K and V free to trade error "
                    "under one water level: stream bits minus it is what the quantizer and entropy model lose; it up to "
                    "R(D) pre-RoPE, what the cell's own split of error between K and V costs.")


def exact_tokens(d: pd.DataFrame) -> pd.Series:
    """Per row, the tokens its coder stores exactly in 16 bit, as the compressor states them (``4 sinks + 128
    recent``, ``none``)."""
    return fact(d, "exact_tokens")


def frontier_label(d: pd.DataFrame) -> pd.Series:
    """A curve per coder and variant, as the compressor labels itself (TurboQuant's range-coded codes and KVTC
    without its exact recent window are curves of their own); a run without the label is its compressor's name."""
    if d.empty:
        return pd.Series(dtype=str)
    label = fact(d, "label")
    return label.where(label.notna(), d["compressor"].astype(str))


def lowest_within(d: pd.DataFrame, by: Sequence[str] = ("model", "series"), verdict: str = "nll_verdict",
                  passing: Sequence[str] = ("within",)) -> pd.DataFrame:
    """Per model and curve, the cell with the fewest stream bits per element whose ``verdict`` column says one of
    ``passing``: by default the delta-NLL interval lies wholly within 1% of the base NLL; with ``recall_vs_ref_verdict``
    and ``no worse``, the recall probe's loss is no larger than the reference cache's. Curves without one are left
    out."""
    if d.empty or verdict not in d:
        return d.iloc[0:0]
    ok = d[d[verdict].isin(list(passing)) & numeric(d, "stream_bits_per_element").notna()]
    if ok.empty:
        return ok
    best = ok.loc[numeric(ok, "stream_bits_per_element").groupby([ok[c] for c in by]).idxmin()]
    return model_first(best, "stream_bits_per_element", models=list(d["model"]))


def rate_ranks(best: pd.DataFrame) -> pd.DataFrame:
    """Per model, each point's rank by each rate (1: the fewest bits; ties share the lower rank)."""
    if best.empty:
        return best
    return best.assign(**{col: numeric(best, rate).groupby(best["model"]).rank(method="min")
                          for col, rate in RANKS.items()})


def rank_note(ranked: pd.DataFrame) -> str:
    """Where the rates rank the points differently, per model, which rate does; else that they agree."""
    if ranked.empty:
        return ""
    words = {"rank_charged": "charged", "rank_amortized": "amortized"}
    differ = []
    for model, g in ranked.groupby("model", sort=False):
        other = [w for col, w in words.items() if not numeric(g, col).equals(numeric(g, "rank_stream"))]
        if other:
            differ.append(f"{model} (by {' and '.join(other)} bits)")
    if not differ:
        return "Stream, charged and amortized bits rank these points alike."
    return f"The ranking by stream bits differs from the ranking by the other rates on {', '.join(differ)}."


def is_reference(d: pd.DataFrame) -> pd.Series:
    """Per row, whether its compressor says it is the quality axes' reference (its ``quality_reference`` fact)."""
    return fact(d, "quality_reference").map(lambda v: v is True or v == "True").astype(bool)


def recall_vs_reference(d: pd.DataFrame, runs: Collection | None = None) -> pd.DataFrame:
    """``d`` with each row's recall-probe NLL minus the reference cache's on the same windows (``recall_vs_ref``, its
    interval and verdict), where both runs kept the probe's per-token NLLs; blank elsewhere. The reference is the run
    whose compressor says it is one (its ``quality_reference`` fact: the FP8 cache). ``runs``: the collection ``d`` comes
    from, which says where its runs' files are (committed evidence names them relative to the results root)."""
    import json
    import math
    from types import SimpleNamespace

    d = d.copy()
    diff, text, verdict = [math.nan] * len(d), [math.nan] * len(d), [math.nan] * len(d)
    refs = d[is_reference(d)]
    where = runs.run_path if runs is not None else Path
    for i, (_, row) in enumerate(d.iterrows()):
        same = refs[(refs["model"] == row.get("model")) & (refs["windows"] == row.get("windows"))]
        if same.empty or "run_dir" not in row:
            continue
        metrics = SimpleNamespace(**{k: int(row.get(f"cfg.metrics.{k}")) for k in ("ci_block", "ci_resamples", "ci_seed")})
        docs = row.get("eval_documents")
        docs = json.loads(docs) if isinstance(docs, str) else docs
        try:
            got = paired_difference(where(row["run_dir"]), where(same.iloc[0]["run_dir"]), metrics,
                                    None if docs is None or (isinstance(docs, float) and math.isnan(docs)) else list(docs))
        except ValueError:  # a run that kept no probe arrays, or another window set: no paired figure
            continue
        diff[i], text[i], verdict[i] = got["diff"], interval_text(*got["ci"], "+.3f"), got["verdict"]
    return d.assign(recall_vs_ref=diff, recall_vs_ref_ci_text=text, recall_vs_ref_verdict=verdict)


def frontier(got: Collection) -> tuple[list[Table], Figures]:
    d = got.table
    d = d.assign(series=frontier_label(d), exact_tokens=exact_tokens(d))
    d = model_first(d.assign(compressor=d["series"]))
    best = rate_ranks(lowest_within(d))
    # runs from before the reference was measured show no column, so no note for it
    rd_note = " ".join(note for key, note in (("rd_bits_per_element", RD_NOTE),
                                              ("rd_bits_per_element_weighted", RD_WEIGHTED_NOTE))
                       if key in d and numeric(d, key).notna().any())
    tables = [Table("frontier", d, FRONTIER_COLUMNS, "every cell", f"{trace_notes(d)} {RATE_NOTE} {rd_note} {CELL_NOTE}".strip(), csv=True),
              Table("frontier", best, FRONTIER_BEST_COLUMNS,
                    "fewest stream bits per element within 1% NLL, per coder and model",
                    f"Ranked by each rate within its model (1: fewest bits). {rank_note(best)}",
                    empty="_no cell is within 1% on its interval_\n")]
    if "delta_nll_recall" in d and numeric(d, "delta_nll_recall").notna().any():
        recall = recall_vs_reference(d, got)
        tables.append(Table("frontier", recall, RECALL_COLUMNS, "the long-range recall probe, every cell", RECALL_NOTE))
        coders = recall[~is_reference(recall)]
        kept = rate_ranks(lowest_within(coders, verdict="recall_vs_ref_verdict", passing=("no worse",)))
        tables.append(Table("frontier", kept, RECALL_BEST_COLUMNS,
                            "fewest stream bits per element whose recall loss is no larger than FP8's, per coder and model",
                            f"Ranked by each rate within its model (1: fewest bits); the reference row itself is "
                            f"left out. {rank_note(kept)}",
                            empty="_no cell's recall loss is shown no larger than the FP8 cache's on its interval_\n"))
        near = rate_ranks(lowest_within(coders, verdict="recall_vs_ref_verdict", passing=("no worse", "unresolved")))
        tables.append(Table("frontier", near, RECALL_BEST_COLUMNS + pick("recall_vs_ref_verdict"),
                            "fewest stream bits per element whose recall loss is not shown larger than FP8's, per "
                            "coder and model",
                            "The same ranking with the unresolved cells admitted (the paired interval straddles "
                            f"{NO_WORSE_MARGIN:+g} nats): the closest each coder comes to the FP8 cache's recall, not a verdict that "
                            f"it keeps it. {rank_note(near)}",
                            empty="_every cell's recall loss is shown larger than the FP8 cache's_\n"))
    figures = {f"frontier_{model}": study_figures.nll_vs_stream_bits(g, "Frontier")
               for model, g in by_model(d)}
    if "delta_nll_recall" in d and numeric(d, "delta_nll_recall").notna().any():
        refs = set(d.loc[is_reference(d), "series"])
        figures |= {f"frontier_recall_{model}": study_figures.nll_vs_stream_bits(g, "Recall probe", refs,
                                                                                   "delta_nll_recall")
                    for model, g in by_model(d)}
    return tables, figures
