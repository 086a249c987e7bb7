"""The report's overview figures from its tables (one row per run, eval task or latency row). Each builder returns
``(Figure, "")`` or ``(None, reason)`` when no summary carries what it plots, so a report never fails for a missing
figure. Style and drawing helpers: ``kvbench.report.plotting``; the per-part studies' figures: ``kvbench.report.study_figures``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd
from matplotlib import rc_context
from matplotlib.figure import Figure

from kvbench.report import plotting as pl
from kvbench.report.collect import series_label
from kvbench.report.plotting import STYLE, series_styles

# Keys that later summaries may carry (workload statistics, eval outputs): the first one present is used.
SHARE_RATE_KEYS = ("sharing.share_rate", "share_rate")
DEDUP_KEYS = ("sharing.dedup_ratio", "dedup_ratio")


def rate_distortion(df: pd.DataFrame):
    """Bits per element against delta_nll with its paired 95% interval, one line per compressor (and per non-rate
    setting), on one set of evaluated windows per panel."""
    d = pl.finite(pl.single_sequence_runs(df), "bits_per_element", "delta_nll")
    if d.empty:
        return None, "no run has both bits_per_element and delta_nll (run with metrics.nll=true)"
    d["series"] = series_label(d)
    facets = pl.facets(d)
    styles = series_styles(d["series"])
    with rc_context(STYLE):
        fig, axes = pl.grid(len(facets))
        for ax, (title, g) in zip(axes, facets):
            if "windows" in g and g["windows"].nunique() > 1:
                # one panel compares cells on the same windows only: other windows are other text (or another
                # context length), and a line through them zig-zags; they belong to the context-length figure
                g = g[g["windows"] == g["windows"].mode().iloc[0]]
                title = f"{title}, {int(g['context_len'].iloc[0])}-token windows"
            for name, s in g.groupby("series", sort=True):
                s = s.sort_values("bits_per_element")
                ax.plot(s["bits_per_element"], s["delta_nll"], label=name, **styles[name])
                if "delta_nll_low" in s and s["delta_nll_low"].notna().any():  # the paired 95% interval
                    lo = (s["delta_nll"] - s["delta_nll_low"]).clip(lower=0)
                    hi = (s["delta_nll_high"] - s["delta_nll"]).clip(lower=0)
                    ax.errorbar(s["bits_per_element"], s["delta_nll"], yerr=[lo.fillna(0), hi.fillna(0)], fmt="none",
                                ecolor=styles[name].get("color"), elinewidth=0.8, capsize=2)
            ys = list(g["delta_nll"]) + [v for v in g.get("delta_nll_high", []) if pd.notna(v)]
            if "nll_base" in g and pd.to_numeric(g["nll_base"], errors="coerce").notna().any():
                ref = 0.01 * float(pd.to_numeric(g["nll_base"], errors="coerce").mean())
                ax.axhline(ref, color="grey", linestyle=":", linewidth=1, label="1% NLL regression")
                ys.append(ref)
            ax.axhline(0, color="black", linewidth=0.6)
            pl.log_if_spans(ax, "x", g["bits_per_element"])
            pl.symlog_if_spans(ax, ys)
            ax.set_xlabel("rate (bits per KV element; 16-bit baseline = 16)")
            ax.set_ylabel(r"$\Delta$NLL (nats/token, held-out text)")
            ax.set_title(title)
    pl.legend(fig, [ax for ax in fig.axes if ax.get_visible()])
    return fig, ""


def context_length(df: pd.DataFrame):
    """Bits per token against context length, with the measured entropy bound H(token | history)."""
    d = pl.finite(pl.single_sequence_runs(df), "bits_per_token", "context_len")
    if d.empty:
        return None, "no run has bits_per_token"
    d["series"] = series_label(d, exclude=())
    swept = d.groupby("series")["context_len"].transform("nunique") > 1
    if swept.any():  # curves measured at one context only would be a column of points: leave them to the table
        d = d[swept]
    facets = pl.facets(d)
    styles = series_styles(d["series"])
    with rc_context(STYLE):
        fig, axes = pl.grid(len(facets))
        for ax, (title, g) in zip(axes, facets):
            pl.mean_curves(ax, g, "context_len", "bits_per_token", styles)
            ys = list(g["bits_per_token"])
            ys += pl.reference_curve(ax, g, "context_len", "bound_bits_per_token", "entropy bound H(token | history)")
            pl.log_if_spans(ax, "y", ys)
            pl.log_if_spans(ax, "x", g["context_len"], base=2, span=4)  # doubling sweeps: even steps
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("bits per token (all layers, K and V)")
            ax.set_title(title)
    pl.legend(fig, [ax for ax in fig.axes if ax.get_visible()])
    return fig, ""


def pareto_front(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Indices of the points no other point beats on both x and y (both maximised), sorted by x."""
    order = np.lexsort((-y, -x))  # x descending, then y descending
    front, best = [], -np.inf
    for i in order:
        if y[i] > best:
            front.append(i)
            best = y[i]
    return np.array(sorted(front, key=lambda i: x[i]), dtype=int)


def compressor_colors(d: pd.DataFrame) -> dict[str, str]:
    """One colour per compressor of ``d``, the same whichever panel it appears in."""
    return {c: st["color"] for c, st in series_styles(sorted(d["compressor"].astype(str).unique())).items()}


def throughput(df: pd.DataFrame):
    """Encode and decode throughput against compression ratio, the Pareto front marked."""
    d = pl.finite(df, "compression_ratio", "encode_MBps", "decode_MBps")
    if not d.empty:
        d = d[(d["encode_MBps"] > 0) & (d["decode_MBps"] > 0) & (d["compression_ratio"] > 0)]
    if d.empty:
        return None, "no run has finite compression_ratio, encode_MBps and decode_MBps"
    facets = pl.facets(d)
    colors = compressor_colors(d)
    with rc_context(STYLE):
        fig = Figure(figsize=(7.0, 2.8 * len(facets)), layout="constrained")
        axes = fig.subplots(len(facets), 2, squeeze=False)
        for row, (title, g) in zip(axes, facets):
            for ax, col, what in ((row[0], "encode_MBps", "encode"), (row[1], "decode_MBps", "decode")):
                for c, s in g.groupby("compressor", sort=True):
                    ax.scatter(s["compression_ratio"], s[col], color=colors[str(c)], label=str(c), s=14, zorder=3)
                x, y = g["compression_ratio"].to_numpy(float), g[col].to_numpy(float)
                f = pareto_front(x, y)
                ax.plot(x[f], y[f], color="black", linewidth=0.8, drawstyle="steps-post", zorder=2,
                        label="Pareto front")
                ax.scatter(x[f], y[f], s=60, facecolors="none", edgecolors="black", linewidths=0.8, zorder=4)
                pl.log_if_spans(ax, "x", x)
                pl.log_if_spans(ax, "y", y)
                ax.set_xlabel(r"compression ratio vs 16-bit ($\times$)")
                ax.set_ylabel(f"{what} throughput (MB/s of 16-bit KV)")
                ax.set_title(f"{title}: {what}" if title else what)
    pl.legend(fig, [ax for ax in fig.axes if ax.get_visible()])
    return fig, ""


def prefix_sharing(df: pd.DataFrame):
    """Compression ratio against the workload's share rate (summaries with sharing statistics), beside the
    ratio exact token-level dedup alone would give (tokens / unique tokens)."""
    x = pl.first(df, SHARE_RATE_KEYS)
    if x is None:
        return None, "no summary carries sharing statistics (a share rate)"
    d = pl.finite(df, x, "compression_ratio")
    if d.empty:
        return None, f"no run has both {x} and compression_ratio"
    ideal = pl.first(d, DEDUP_KEYS)
    d["series"] = series_label(d, exclude=())
    facets = pl.facets(d)
    styles = series_styles(d["series"])
    with rc_context(STYLE):
        fig, axes = pl.grid(len(facets))
        for ax, (title, g) in zip(axes, facets):
            pl.mean_curves(ax, g, x, "compression_ratio", styles, x_scale=100)
            ys = list(g["compression_ratio"])
            if ideal:
                ys += pl.reference_curve(ax, g, x, ideal, "exact dedup: tokens / unique tokens", x_scale=100)
            pl.log_if_spans(ax, "y", ys)
            ax.set_xlabel("share rate (% of tokens in a prefix seen before)")
            ax.set_ylabel(r"compression ratio vs 16-bit ($\times$)")
            ax.set_title(title)
    pl.legend(fig, [ax for ax in fig.axes if ax.get_visible()])
    return fig, ""


def accuracy(ev: pd.DataFrame):
    """Task-accuracy change (compressed minus 16-bit, same examples) per task and compressor, 95% intervals."""
    d = pl.finite(ev, "diff")
    if d.empty or "task" not in d:
        return None, "no eval summary (python -m kvbench eval)"
    d["series"] = series_label(d, exclude=())
    facets = pl.facets(d.drop(columns=[c for c in ("dataset", "workload") if c in d]))
    styles = series_styles(d["series"])
    with rc_context(STYLE):
        fig, axes = pl.grid(len(facets), ncols_max=1, w=max(3.4, 0.55 * d["task"].nunique() + 1.5))
        for ax, (title, g) in zip(axes, facets):
            tasks = sorted(g["task"].astype(str).unique())
            series = sorted(g["series"].unique())
            width = 0.8 / len(series)
            for i, name in enumerate(series):
                s = g[g["series"] == name].groupby("task")
                mean = s["diff"].mean().reindex(tasks).to_numpy(float)
                err = s["stderr_diff"].mean().reindex(tasks).to_numpy(float) if "stderr_diff" in g else None
                pos = np.arange(len(tasks)) + (i - (len(series) - 1) / 2) * width
                ax.bar(pos, 100 * mean, width, label=name, yerr=None if err is None else 196 * err, capsize=2,
                       color=styles[name]["color"])
            ax.axhline(0, color="black", linewidth=0.6)
            ax.set_xticks(np.arange(len(tasks)), tasks, rotation=20, ha="right")
            ax.set_ylabel("accuracy change vs 16-bit (points, 95% CI)")
            ax.set_title(title)
    pl.legend(fig, [ax for ax in fig.axes if ax.get_visible()])
    return fig, ""


def memory_rows(lat: pd.DataFrame) -> pd.DataFrame:
    """Latency rows that can be drawn, each compressor a series and the 16-bit cache one more (a run's own 16-bit
    rows are its baseline; the first run's stand for them all)."""
    d = pl.finite(lat, "tokens_per_s", "bytes_held", "context")
    if d.empty:
        return d
    d["series"] = series_label(d, exclude=())
    if "cache" in d:
        d.loc[d["cache"].astype(str) == "dynamic", "series"] = "DynamicCache (16-bit)"
    return d.drop_duplicates(["model", "series", "context"]) if "model" in d else d


def context_markers(d: pd.DataFrame) -> dict:
    return dict(zip(sorted(d["context"].unique()), "osD^v<>p*h"))


def memory_panel(ax, g: pd.DataFrame, styles: dict[str, dict], markers: dict) -> None:
    """Decode tokens/s against MB held: a line per series through its contexts, a marker per context."""
    for name, s in g.groupby("series", sort=True):
        s = s.sort_values("context")
        color = styles[name]["color"]
        ax.plot(s["bytes_held"] / 1e6, s["tokens_per_s"], color=color, linewidth=0.8, label=name)
        for _, r in s.iterrows():
            ax.scatter(r["bytes_held"] / 1e6, r["tokens_per_s"], color=color, marker=markers[r["context"]], zorder=3)
    for c, m in markers.items():
        ax.scatter([], [], color="grey", marker=m, label=f"{int(c)} tokens")
    pl.log_if_spans(ax, "x", g["bytes_held"] / 1e6)
    pl.log_if_spans(ax, "y", g["tokens_per_s"])
    ax.set_xlabel("KV cache held (MB)")
    ax.set_ylabel("decode throughput (tokens/s)")


def latency_vs_memory(lat: pd.DataFrame):
    """Decode tokens/s against the bytes the cache holds, per context length: the memory-throughput trade."""
    d = memory_rows(lat)
    if d.empty:
        return None, "no latency summary (python -m kvbench latency)"
    facets = pl.facets(d.drop(columns=[c for c in ("dataset", "workload") if c in d]))
    markers, styles = context_markers(d), series_styles(d["series"])
    with rc_context(STYLE):
        fig, axes = pl.grid(len(facets))
        for ax, (title, g) in zip(axes, facets):
            memory_panel(ax, g, styles, markers)
            ax.set_title(title)
    pl.legend(fig, [ax for ax in fig.axes if ax.get_visible()])
    return fig, ""


def restore_ttft(rest: pd.DataFrame):
    """Time to first token restoring a stored cache against link bandwidth (log axes), a panel per model and
    context: a solid line per compressor, and in its colour the 16-bit KV (dashed) and re-run prefill (dotted)
    routes of the same run, which measured them on the same session at the same load (other runs' load differs, so
    a compressor is compared with its own run's references). Transfer is modelled, the rest measured."""
    d = pl.finite(rest, "bandwidth_gbps", "ttft_s", "ttft_16bit_s", "ttft_prefill_s", "context")
    if d.empty:
        return None, "no restore summary (python -m kvbench restore)"
    d["series"] = series_label(d, exclude=())
    keys = [c for c in ("model", "dataset") if c in d]
    title = d[keys].astype(str).agg(" / ".join, axis=1) + ", " + d["context"].astype(int).astype(str) + " tokens"
    facets = [(t, g) for t, g in d.groupby(title, sort=False)]
    styles = series_styles(d["series"])
    with rc_context(STYLE):
        fig, axes = pl.grid(len(facets))
        for ax, (t, g) in zip(axes, facets):
            pl.mean_curves(ax, g, "bandwidth_gbps", "ttft_s", styles)
            for name, s in g.groupby("series", sort=True):
                s = s.groupby("bandwidth_gbps", as_index=False)[["ttft_16bit_s", "ttft_prefill_s"]].mean()
                color = styles[name]["color"]
                ax.plot(s["bandwidth_gbps"], s["ttft_16bit_s"], color=color, linestyle="--", linewidth=0.9)
                ax.plot(s["bandwidth_gbps"], s["ttft_prefill_s"], color=color, linestyle=":", linewidth=0.9)
            ax.plot([], [], color="grey", linestyle="--", label="16-bit KV sent (same run)")
            ax.plot([], [], color="grey", linestyle=":", label="prefill re-run, ids sent (same run)")
            pl.log_if_spans(ax, "x", g["bandwidth_gbps"], span=1)
            pl.log_if_spans(ax, "y", list(g["ttft_s"]) + list(g["ttft_16bit_s"]) + list(g["ttft_prefill_s"]), span=1)
            ax.set_xlabel("link bandwidth (Gbit/s; transfer modelled)")
            ax.set_ylabel("time to first token (s)")
            ax.set_title(t)
    pl.legend(fig, [ax for ax in fig.axes if ax.get_visible()])
    return fig, ""


def bits_vs_decode_time(df: pd.DataFrame):
    """Stream bits per element against the decoder's seconds per restored token (log axes), every run a point: coders
    that decode from KV alone, speculative and recompute (which run the model to decode) on one chart, with the
    decode of the exact 16-bit copy (reading 16-bit KV back) as the reference line, a panel per model."""
    d = pl.finite(pl.single_sequence_runs(df), "stream_bits_per_element", "decode_s_per_token")
    if not d.empty:
        d = d[(d["stream_bits_per_element"] > 0) & (d["decode_s_per_token"] > 0)]
    if d.empty:
        return None, "no run has stream_bits_per_element and decode_s_per_token"
    facets = pl.facets(d)
    colors = compressor_colors(d)
    with rc_context(STYLE):
        fig, axes = pl.grid(len(facets))
        for ax, (title, g) in zip(axes, facets):
            for c, s in g.groupby("compressor", sort=True):
                ax.scatter(s["decode_s_per_token"], s["stream_bits_per_element"], color=colors[str(c)], label=str(c),
                           s=14, zorder=3)
            # the 16-bit copy: exact runs that store every element in 16 bits or more
            copy = (g["lossless"].astype(str) == "True") if "lossless" in g else pd.Series(False, index=g.index)
            ref = g.loc[copy & (g["stream_bits_per_element"] >= 16), "decode_s_per_token"]
            if not ref.empty:
                ax.axvline(float(ref.median()), color="grey", linestyle=":", linewidth=1,
                           label="16-bit KV read back")
            pl.log_if_spans(ax, "x", g["decode_s_per_token"])
            pl.log_if_spans(ax, "y", g["stream_bits_per_element"])
            ax.set_xlabel("decode seconds per restored token (this machine)")
            ax.set_ylabel("stream bits per KV element")
            ax.set_title(title)
    pl.legend(fig, [ax for ax in fig.axes if ax.get_visible()])
    return fig, ""


# name -> (table of the collection it reads, builder)
FIGURES: dict[str, tuple[str, Callable[[pd.DataFrame], tuple[Figure | None, str]]]] = {
    "rate_distortion": ("runs", rate_distortion),
    "context_length": ("runs", context_length),
    "throughput_vs_ratio": ("runs", throughput),
    "bits_vs_decode_time": ("runs", bits_vs_decode_time),
    "prefix_sharing": ("runs", prefix_sharing),
    "accuracy_regression": ("evals", accuracy),
    "latency_vs_memory": ("latency", latency_vs_memory),
    "restore_ttft": ("restore", restore_ttft),
}
