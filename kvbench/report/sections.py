"""The report's sections: which runs each shows, and the tables and figures it makes of them.

``overview`` shows every run under the report's dirs. Each study section shows the cells of its presets in
``configs/experiment/``: the runs whose ``cell_key`` is one of theirs, in the presets' order, so a section finds
exactly what its driver in ``scripts/`` ran, under any results root (cells run with extra overrides, e.g. a shorter
window, are found with the same overrides).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import pandas as pd

from kvbench.core.config import available
from kvbench.report import study_figures
from kvbench.report.collect import (
    Collection,
    best_at_tolerance,
    interval_text,
    numeric,
    plain,
    pool_tasks,
    series_label,
    with_pooled,
)
from kvbench.report.figures import FIGURES, accuracy
from kvbench.report.tables import BEST_COLUMNS, COLUMNS, EVAL_COLUMNS, LATENCY_COLUMNS, RESTORE_COLUMNS, Column, pick
from kvbench.sweep.presets import Preset, cells, fitting


@dataclass(frozen=True)
class Table:
    stem: str  # written to <out>/<stem>.md and .tex; the tables of one stem share the files, each under its title
    frame: pd.DataFrame
    columns: Sequence[Column]
    title: str = ""
    note: str = ""  # a paragraph above the Markdown table: the setting, the units
    empty: str | None = None  # the Markdown when the frame is empty; None leaves the table out
    csv: bool = False  # also <stem>.csv: every column of every row shown


Figures = dict[str, tuple]  # name -> (Figure, "") or (None, why nothing was drawn)


@dataclass(frozen=True)
class Section:
    name: str
    presets: tuple[Preset, ...]  # the cells it shows; () shows every run
    build: Callable[[Collection], tuple[list[Table], Figures]]


def select(got: Collection, presets: Sequence[Preset], overrides: Sequence[str] = ()) -> Collection:
    """The rows of ``got`` that are runs of the presets' cells (each run with ``overrides`` added), in the
    presets' order, each with the ``preset`` it belongs to. A preset the overrides do not apply to shows nothing.
    Unless the overrides name a model, a preset's cells run on any packaged model (``model=NAME``, as the drivers
    take it) are its cells too."""
    where: dict[tuple[str, str], tuple[int, str]] = {}
    frames = (got.table, got.evals, got.latency, got.restore)
    models = sorted({str(m) for f in frames if "model" in f for m in f["model"].dropna()} & set(available("model")))
    variants = [list(overrides)]
    if not any(o.startswith("model=") for o in overrides):
        variants += [[*overrides, f"model={m}"] for m in models]
    for preset in presets:  # a preset the overrides do not apply to has no cells here
        for extra in variants:
            for cell in cells([preset], fitting(preset.kind, extra), unfit=lambda *_: None):
                where.setdefault((cell.kind, cell.key), (len(where), preset.name))

    def pick_rows(df: pd.DataFrame, kind: str) -> pd.DataFrame:
        if df.empty or "cell_key" not in df:
            return df.iloc[0:0]
        found = [where.get((kind, k)) for k in df["cell_key"]]
        keep = [f is not None for f in found]
        out = df[keep].assign(_cell=[f[0] for f in found if f], preset=[f[1] for f in found if f])
        return out.sort_values("_cell", kind="stable").drop(columns="_cell").reset_index(drop=True)

    return replace(got, table=pick_rows(got.table, "run"), evals=pick_rows(got.evals, "eval"),
                   latency=pick_rows(got.latency, "latency"), restore=pick_rows(got.restore, "restore"))


def _trace_note(d: pd.DataFrame) -> str:
    """The trace every row was measured on, when they share one: model, windows, cache dtype, the bound."""
    need = {"model", "dataset", "n_sequences", "n_tokens", "bound_bits_per_token"}
    if d.empty or not need <= set(d.columns) or d[["model", "dataset", "n_sequences"]].nunique().max() > 1:
        return ""
    r = d.iloc[0]
    t = int(r["n_tokens"]) // int(r["n_sequences"])
    dtype = f", {r['dtype']} cache" if "dtype" in d else ""
    return (f"Trace: {r['model']} / {r['dataset']}, {int(r['n_sequences'])} sequences x {t} tokens{dtype}; bound "
            f"H(token | history) = {numeric(d, 'bound_bits_per_token').mean():.3f} bits/token. Times are per {t}-token "
            "sequence.")


# ---- overview -------------------------------------------------------------------------------------------------
RESTORE_NOTE = ("Restore rows: encode, decode, first-token forward and prefill measured; transfer at each bandwidth "
                "modelled as bits / bandwidth (python -m kvbench restore).")


def overview(got: Collection) -> tuple[list[Table], Figures]:
    df = got.table
    tables = [Table("runs", df, COLUMNS, f"{len(df)} runs", empty="_no runs_\n", csv=True),
              Table("best_at_1pct_nll", best_at_tolerance(df), BEST_COLUMNS, "highest ratio at <= 1% NLL regression",
                    empty="_no run has both delta_nll and nll_base_\n")]
    for stem, table, columns in (("eval", got.evals, EVAL_COLUMNS), ("latency", got.latency, LATENCY_COLUMNS),
                                 ("restore", got.restore, RESTORE_COLUMNS)):
        if not table.empty:
            note = RESTORE_NOTE if stem == "restore" else ""
            tables.append(Table(stem, table, columns, f"{stem}: {table['run_id'].nunique()} runs", note))
    frames = {"runs": df, "evals": got.evals, "latency": got.latency, "restore": got.restore}
    return tables, {name: make(frames[frame]) for name, (frame, make) in FIGURES.items()}


# ---- per-vector quantizers ------------------------------------------------------------------------------------
PER_VECTOR_COLUMNS = pick("compressor", "compressor_params.bits", "bits_per_element", "rel_mse_k", "rel_mse_v",
                          "delta_nll", "delta_nll_ci_text", "encode_MBps", "decode_MBps",
                          formats={"rel_mse_k": ".4f", "rel_mse_v": ".4f"})


def per_vector(got: Collection) -> tuple[list[Table], Figures]:
    d = got.table.assign(series=series_label(got.table))  # bits move a point along its compressor's curve
    table = Table("per_vector", d.assign(compressor=d["series"]), PER_VECTOR_COLUMNS, "per-vector quantizers", csv=True)
    return [table], {"per_vector": study_figures.per_vector(d)}


# ---- sequential coders ----------------------------------------------------------------------------------------
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
    tables = [Table("sequential", d, SEQUENTIAL_COLUMNS, "rate, distortion and time per cell", _trace_note(d)),
              Table("sequential", bits_per_part(d), PARTS_COLUMNS, "where the residual coders' bits go", PARTS_NOTE)]
    return tables, {"sequential": study_figures.sequential(d)}


# ---- prefix sharing -------------------------------------------------------------------------------------------
# a share rate or ratio near 1 needs three decimals to show what dedup gained; bits per token run to six figures
PREFIX_FORMATS = {"sharing.share_rate": ".3f", "bits_per_token": ",.0f", "compression_ratio": ".3f",
                  "sharing.dedup_ratio": ".3f"}
SWEEP_COLUMNS = pick("cfg.workload.target_share_rate", "sharing.share_rate", "prefix_cache.hit_rate",
                     "sharing.sessions", "sharing.tokens", "compressor", "bits_per_token", "compression_ratio",
                     "sharing.dedup_ratio", "lossless", "max_abs_err_k", "shared_prefix_kv.identical_pairs",
                     "shared_prefix_kv.pairs", "shared_prefix_kv.max_abs_diff",
                     "shared_prefix_kv.tokens_after_first_difference", formats=PREFIX_FORMATS)
FAMILY_COLUMNS = pick("workload", "sharing.sessions", "sharing.tokens", "sharing.share_rate", "sharing.ideal_hit_rate",
                      "bits_per_token", "compression_ratio", "sharing.dedup_ratio", "lossless",
                      "shared_prefix_kv.identical_pairs", "shared_prefix_kv.pairs", "shared_prefix_kv.max_abs_diff",
                      formats=PREFIX_FORMATS)
BUDGET_COLUMNS = pick("compressor", "budget", "prefix_cache.hit_rate", "prefix_cache.request_hit_rate",
                      "prefix_cache.prefill_tokens_saved", "prefix_cache.memory_held_mean_tokens",
                      "prefix_cache.memory_held_max_tokens", "bits_per_token", "compression_ratio", formats=PREFIX_FORMATS)
COMPOSITION_COLUMNS = pick("workload", "compressor", "bits_per_token", "compression_ratio", "lossless", "rel_mse_k",
                           "rel_mse_v", "delta_nll", "delta_nll_ci_text", formats=PREFIX_FORMATS)


def composition_label(d: pd.DataFrame) -> pd.Series:
    """A compressor alone by its name, inside the trie as trie+<inner>."""
    if d.empty:
        return pd.Series(dtype=str)
    inner = d["compressor_params.inner.name"] if "compressor_params.inner.name" in d else pd.Series(index=d.index)
    return d["compressor"].astype(str).where(inner.isna(), "trie+" + inner.astype(str))


def prefix_sharing(got: Collection) -> tuple[list[Table], Figures]:
    d = got.table
    part = {name: d[d["preset"].str.startswith(f"prefix_sharing_{name}")] if "preset" in d else d.iloc[0:0]
            for name in ("sweep", "families", "budget", "compose")}
    sweep = part["sweep"].assign(series=series_label(part["sweep"], exclude=()))
    families = part["families"].assign(series=series_label(part["families"], exclude=()))
    families = families.sort_values("sharing.share_rate") if "sharing.share_rate" in families else families
    budget = part["budget"].assign(series=series_label(part["budget"], exclude=("budget_tokens",)))
    budget["budget"] = [f"{int(b)}" if pd.notna(b) else "unbounded" for b in numeric(budget, "prefix_cache.budget_tokens")]
    compose = part["compose"].assign(series=composition_label(part["compose"]))
    if not compose.empty:  # each compressor alone, then inside the trie
        inner = compose["series"].str.removeprefix("trie+")
        first = {c: i for i, c in enumerate(dict.fromkeys(inner))}
        compose = compose.assign(_o=inner.map(first), _t=compose["series"].str.startswith("trie+"))
        compose = compose.sort_values(["workload", "_o", "_t"], kind="stable").drop(columns=["_o", "_t"])
    tables = [Table("prefix_sharing", sweep.assign(compressor=sweep["series"]), SWEEP_COLUMNS,
                    "mixed-workload sweep (trie, unbounded)"),
              Table("prefix_sharing", families, FAMILY_COLUMNS, "single-family workloads (trie, unbounded)"),
              Table("prefix_sharing", budget.assign(compressor=budget["series"]), BUDGET_COLUMNS,
                    "prefix cache under a budget"),
              Table("prefix_sharing", compose.assign(compressor=compose["series"]), COMPOSITION_COLUMNS,
                    "composition: each compressor alone and inside the trie")]
    figures = {"prefix_sharing_ratio": study_figures.prefix_sharing_ratio(sweep, families),
               "prefix_sharing_budget": study_figures.prefix_sharing_budget(budget),
               "prefix_sharing_composition": study_figures.prefix_sharing_composition(compose)}
    return tables, figures


# ---- the compressed cache in the loop: task accuracy and end-to-end latency -----------------------------------
ACCURACY_COLUMNS = pick("compressor", "bits_per_element", "task", "n", "acc_base", "stderr_base", "acc_comp",
                        "stderr_comp", "diff", "diff_ci_text", "mcnemar_p", "identical_responses",
                        formats={"bits_per_element": ".2f"})
ACCURACY_NOTE = ("Paired on the same examples; diff = compressed - 16-bit with its 95% interval; McNemar = exact "
                 "test on the examples that flipped; same responses = raw responses equal to the baseline's.")


def accuracy_study(got: Collection) -> tuple[list[Table], Figures]:
    ev = with_pooled(got.evals)
    ev = ev.assign(compressor=series_label(ev, exclude=())) if not ev.empty else ev
    return ([Table("accuracy", ev, ACCURACY_COLUMNS, "task accuracy, compressed against 16-bit", ACCURACY_NOTE,
                   csv=True)],
            {"accuracy": accuracy(ev)})


END_TO_END_COLUMNS = pick("compressor", "context", "prefill_s", "compress_s", "decode_median_ms", "decode_p95_ms",
                          "tokens_per_s", "mb_held", "peak_mem_mb", "ratio_tokens_per_s", "ratio_bytes",
                          "tokens_match_dynamic", "load_1m",
                          formats={"prefill_s": ".2f", "compress_s": ".2f", "decode_median_ms": ".0f",
                                   "decode_p95_ms": ".0f", "tokens_per_s": ".2f"})
END_TO_END_NOTE = ("Ratios are compressed / DynamicCache of the same run (compare within a run: the machine's load "
                   "differs between runs); peak RSS is the whole process's, model included.")


def _mean_of_list(text) -> float:
    try:
        values = json.loads(text) if isinstance(text, str) else []
        return float(pd.Series(values, dtype=float).mean()) if values else math.nan
    except (TypeError, ValueError):
        return math.nan


def end_to_end_rows(lat: pd.DataFrame) -> pd.DataFrame:
    """Latency rows with the compressed cache's ratios to the 16-bit cache of its run (on its own rows), MB and the
    run's mean load; the 16-bit rows are named after the run they belong to."""
    if lat.empty:
        return lat
    label = series_label(lat, exclude=())
    compressed = lat["cache"].astype(str) == "compressed"

    def ratio(what: str) -> list[float]:  # summary["ratios"][context][what], flattened per context
        return [pd.to_numeric(r.get(f"ratios.{int(r['context'])}.{what}"), errors="coerce") if ok else math.nan
                for (_, r), ok in zip(lat.iterrows(), compressed)]

    return lat.assign(compressor=label.where(compressed, "DynamicCache (run of " + label + ")"),
                      mb_held=numeric(lat, "bytes_held") / 1e6, peak_mem_mb=numeric(lat, "peak_mem_bytes") / 1e6,
                      ratio_tokens_per_s=ratio("tokens_per_s"), ratio_bytes=ratio("bytes_held"),
                      load_1m=lat["loadavg_1m"].map(_mean_of_list) if "loadavg_1m" in lat else math.nan,
                      series=label)


def end_to_end(got: Collection) -> tuple[list[Table], Figures]:
    lat = end_to_end_rows(got.latency)
    return ([Table("end_to_end", lat, END_TO_END_COLUMNS, "decode latency and memory", END_TO_END_NOTE, csv=True)],
            {"end_to_end": study_figures.end_to_end(lat)})


# ---- the frontier: fitted transform and predictive coders against per-vector references -----------------------
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


def _count(row: pd.Series, field: str | None) -> int:
    v = pd.to_numeric(row.get(f"compressor_params.{field}"), errors="coerce") if field else math.nan
    return int(v) if pd.notna(v) else 0


def _tokens_text(sinks: int, recent: int, recent_word: str = "recent") -> str:
    parts = [f"{sinks} sinks"] * (sinks > 0) + [f"{recent} {recent_word}"] * (recent > 0)
    return " + ".join(parts) or "none"


def exact_tokens(d: pd.DataFrame) -> pd.Series:
    """Per row, the tokens its coder stores exactly in 16 bit: ``4 sinks + 128 recent``, or ``none``."""
    def one(r: pd.Series) -> str:
        sinks, recent = EXACT_FIELDS.get(str(r["compressor"]), (None, None))
        return _tokens_text(_count(r, sinks), _count(r, recent))
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
    return _model_first(best, "stream_bits_per_element", models=list(d["model"]))


def _by_model(d: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    return [(str(m), g) for m, g in d.groupby("model", sort=False)] if "model" in d and not d.empty else []


def _model_first(d: pd.DataFrame, *then: str, models: Sequence[str] = ()) -> pd.DataFrame:
    """The rows grouped by model (``models`` first, then the others in the order they first appear), then by
    ``then``; stable otherwise."""
    if d.empty or "model" not in d:
        return d
    order = {m: i for i, m in enumerate(dict.fromkeys([*models, *d["model"]]))}
    keys = d.assign(_m=d["model"].map(order), **{f"_{c}": numeric(d, c) for c in then})
    return keys.sort_values(["_m", *(f"_{c}" for c in then)], kind="stable").drop(
        columns=["_m", *(f"_{c}" for c in then)])


def _trace_notes(d: pd.DataFrame) -> str:
    """The trace note of each model's rows."""
    return " ".join(n for _, g in _by_model(d) if (n := _trace_note(g)))


def frontier(got: Collection) -> tuple[list[Table], Figures]:
    d = got.table
    d = d.assign(series=frontier_label(d), exact_tokens=exact_tokens(d))
    d = _model_first(d.assign(compressor=d["series"]))
    tables = [Table("frontier", d, FRONTIER_COLUMNS, "every cell", f"{_trace_notes(d)} {RATE_NOTE}".strip(), csv=True),
              Table("frontier", lowest_within(d), FRONTIER_BEST_COLUMNS,
                    "fewest stream bits per element within 1% NLL, per coder and model",
                    empty="_no cell is within 1% on its interval_\n")]
    figures = {f"frontier_{model}": study_figures.nll_vs_stream_bits(g, "Frontier")
               for model, g in _by_model(d)}
    return tables, figures


# ---- eviction -------------------------------------------------------------------------------------------------
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
            return _tokens_text(0, math.floor(share * k + 0.5) if pd.notna(share) else 0)
        if name == "streaming_llm":
            return _tokens_text(_count(r, "sinks"), k - _count(r, "sinks"))
        return _tokens_text(_count(r, "sinks"), _count(r, "window"), "last")
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
    ev = _model_first(ev.assign(vs_random=against_random(ev), compressor=ev["series"]), "compressor_params.keep")
    ref = ref.assign(series=frontier_label(ref), exact_tokens=exact_tokens(ref))
    ref = ref.assign(compressor=ref["series"])
    tables = [Table("eviction", ev, EVICTION_COLUMNS, "every eviction cell", f"{_trace_notes(ev)} {EVICTION_NOTE}".strip(),
                    csv=True)]
    snap = ev[ev["compressor"].astype(str).str.startswith("snapkv")].assign(exact_tokens="-")
    both = pd.concat([snap, ref], ignore_index=True)
    if not both.empty:
        both = _model_first(both, "stream_bits_per_element", models=list(ev["model"]))
        tables.append(Table("eviction", both, MATCHED_COLUMNS,
                            "eviction against quantization at similar stored bits", MATCHED_NOTE))
    every = pd.concat([ev, ref], ignore_index=True)
    figures = {f"eviction_{model}": study_figures.nll_vs_stream_bits(g, "Eviction", reference=ref_names(g))
               for model, g in _by_model(every)}
    return tables, figures


def ref_names(d: pd.DataFrame) -> set[str]:
    """The curves of rows that are not eviction (the quantizers drawn for reference)."""
    return set(d.loc[~d["preset"].astype(str).str.startswith("eviction"), "series"]) if "preset" in d else set()


# ---- RULER-style long-context accuracy ----------------------------------------------------------------------------
RULER_BASE_COLUMNS = pick("model", "family", "length", "n", "acc_base", "chance", "near_chance_text")
RULER_COLUMNS = pick("model", "compressor", "bits_per_element", "task", "n", "acc_base", "acc_comp", "diff",
                     "diff_ci_text", "mcnemar_p", "smallest_significant_diff", formats={"bits_per_element": ".2f"})
RULER_BASE_NOTE = ("16-bit accuracy per task family and length (the baseline side of every paired run; the same "
                   "examples in each). A task under chance + {margin} is flagged near chance: the model cannot do it, "
                   "so it cannot lose it, and it is left out of the pooled verdicts.")
RULER_NOTE = ("Paired on the same examples; diff = compressed - 16-bit with its 95% interval; pooled = every task "
              "clear of chance; smallest significant change = 6 one-way flips over n, the least change McNemar can "
              "call at p < 0.05 with these examples: a smaller true change reads as no change.")


def ruler_rows(ev: pd.DataFrame) -> pd.DataFrame:
    """The RULER tasks' eval rows with their family, length and near-chance flag (from the 16-bit accuracy, for
    runs that predate the flag too), then per run a ``pooled`` row over the tasks clear of chance."""
    from kvbench.measure.evaluation.evaluate import NEAR_CHANCE_MARGIN
    from kvbench.measure.evaluation.ruler import PREFIX
    from kvbench.measure.evaluation.stats import smallest_significant_flips

    if ev.empty or "task" not in ev:
        return ev
    d = ev[ev["task"].astype(str).str.startswith(PREFIX)].copy()
    if d.empty:
        return d
    parts = d["task"].astype(str).str.rsplit("_", n=1)
    d["family"] = parts.str[0]
    d["length"] = parts.str[1].str.removesuffix("k").astype(int) * 1024
    d["chance"] = numeric(d, "chance").fillna(0.0)
    d["near_chance"] = numeric(d, "acc_base") < d["chance"] + NEAR_CHANCE_MARGIN
    d["near_chance_text"] = d["near_chance"].map({True: "yes", False: ""})
    d["smallest_significant_diff"] = smallest_significant_flips() / numeric(d, "n")
    d = d.assign(compressor=series_label(d, exclude=()))
    pooled = []
    for _, g in d.groupby("run_id", sort=False):
        clear = g[~g["near_chance"]]
        pooled.append(g.iloc[[0]].assign(task="pooled (clear of chance)", **pool_tasks(clear), length=math.nan, family="pooled"))
    out = pd.concat([d, *pooled], ignore_index=True)
    order = {r: i for i, r in enumerate(d["run_id"].drop_duplicates())}
    out = out.sort_values("run_id", key=lambda r: r.map(order), kind="stable").reset_index(drop=True)
    out["diff_ci_text"] = [interval_text(lo, hi, "+.3f") for lo, hi in zip(numeric(out, "ci95_low"), numeric(out, "ci95_high"))]
    return out


def ruler_study(got: Collection) -> tuple[list[Table], Figures]:
    from kvbench.measure.evaluation.evaluate import NEAR_CHANCE_MARGIN

    d = ruler_rows(got.evals)
    if d.empty:
        return [], {"ruler": (None, "no RULER eval run (python -m kvbench eval tasks=[ruler])")}
    tasks = d[d["family"] != "pooled"]
    base = tasks.drop_duplicates(["model", "task"]) if "model" in tasks else tasks.drop_duplicates("task")
    tables = [Table("ruler", base, RULER_BASE_COLUMNS, "16-bit baseline per task", RULER_BASE_NOTE.format(margin=NEAR_CHANCE_MARGIN)),
              Table("ruler", d, RULER_COLUMNS, "accuracy with the compressed cache, per task and pooled", RULER_NOTE, csv=True)]
    figures = {f"ruler_{model}": study_figures.accuracy_vs_bits(g) for model, g in _by_model(tasks)}
    return tables, figures


def _presets(kind: str, *names: str) -> tuple[Preset, ...]:
    return tuple(Preset(kind, n) for n in names)


MATCHED_BITS = ("matched_bits", "matched_bits_turboquant")
FRONTIER = ("frontier_kvtc", "frontier_kvtc_window0", "frontier_aquakv", "frontier_kvquant", "frontier_turboquant",
            "frontier_kivi", "frontier_delta")
SECTIONS = {s.name: s for s in (
    Section("overview", (), overview),
    Section("per_vector", _presets("run", "per_vector_turboquant", "per_vector_kivi"), per_vector),
    Section("sequential", _presets("run", "sequential", "sequential_delta", "sequential_delta_bits",
                                   "sequential_speculative"), sequential),
    Section("prefix_sharing", _presets("run", "prefix_sharing_sweep", "prefix_sharing_budget",
                                       "prefix_sharing_families", "prefix_sharing_compose",
                                       "prefix_sharing_compose_kivi", "prefix_sharing_compose_pipeline"),
            prefix_sharing),
    Section("accuracy", _presets("eval", *MATCHED_BITS), accuracy_study),
    Section("ruler", _presets("eval", "ruler", "ruler_kivi", "ruler_turboquant", "ruler_delta", "ruler_eviction"), ruler_study),
    Section("end_to_end", _presets("latency", *MATCHED_BITS, "latency_lossless", "latency_model"), end_to_end),
    Section("frontier", _presets("run", *FRONTIER), frontier),
    # the per-vector quantizers of the frontier presets are the eviction study's reference at similar stored bits
    Section("eviction", _presets("run", "eviction", "eviction_inner", "frontier_kivi", "frontier_turboquant"), eviction),
)}


def section(name: str) -> Section:
    if name not in SECTIONS:
        raise ValueError(f"unknown report section {name!r}; one of {sorted(SECTIONS)}")
    return SECTIONS[name]
