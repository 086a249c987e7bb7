"""Paper figures from the report table (one row per run). Each builder returns ``(Figure, "")`` or
``(None, reason)`` when no summary carries what it plots, so a report never fails for a missing figure.

Figures are built on ``matplotlib.figure.Figure`` directly (no pyplot, no global backend), with labelled axes and
units, and log axes wherever a range spans a decade or more.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import matplotlib
import numpy as np
import pandas as pd
from matplotlib import rc_context, ticker
from matplotlib.figure import Figure

from kvbench.report_data import series_label

STYLE = {
    "font.size": 8, "axes.titlesize": 9, "axes.labelsize": 8, "legend.fontsize": 7, "xtick.labelsize": 7,
    "ytick.labelsize": 7, "axes.grid": True, "grid.alpha": 0.3, "lines.markersize": 4, "lines.linewidth": 1.2,
    "savefig.dpi": 200, "pdf.fonttype": 42,  # TrueType in PDFs: editable text, accepted by publishers
}
BOUND_STYLE = {"color": "black", "linestyle": "--", "linewidth": 1.0}

# Keys that later summaries may carry (workload statistics, eval outputs): the first one present is used.
SHARE_RATE_KEYS = ("sharing.share_rate", "share_rate")
DEDUP_KEYS = ("sharing.dedup_ratio", "dedup_ratio")


MARKERS = "osD^vPX*<>"
LINESTYLES = ("-", "--", "-.", ":")


def series_styles(names) -> dict[str, dict]:
    """One color per compressor family (the label's first word) in every figure; variants of a family differ by
    marker and line style."""
    names = sorted(set(map(str, names)))
    families = sorted({n.split()[0] for n in names})
    cmap = "tab10" if len(families) <= 10 else "tab20"
    colors = {f: matplotlib.colormaps[cmap](i % (10 if cmap == "tab10" else 20)) for i, f in enumerate(families)}
    seen: dict[str, int] = {}
    out = {}
    for n in names:
        f = n.split()[0]
        k = seen[f] = seen.get(f, -1) + 1
        out[n] = {"color": colors[f], "marker": MARKERS[k % len(MARKERS)], "linestyle": LINESTYLES[k % len(LINESTYLES)]}
    return out


def _single_sequence_runs(df: pd.DataFrame) -> pd.DataFrame:
    """Runs on the dataset's windows, not multi-session workloads (those have their own figure)."""
    if "workload" not in df:
        return df
    return df[df["workload"].isna() | (df["workload"].astype(str).isin(["none", ""]))]


def _finite(df: pd.DataFrame, *cols: str) -> pd.DataFrame:
    if df.empty or any(c not in df for c in cols):
        return df.iloc[0:0]
    num = df[list(cols)].apply(pd.to_numeric, errors="coerce")
    keep = np.isfinite(num.to_numpy(dtype=float)).all(axis=1)
    out = df.loc[keep].copy()
    out[list(cols)] = num.loc[keep]
    return out


def _first(df: pd.DataFrame, keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if k in df and pd.to_numeric(df[k], errors="coerce").notna().any()), None)


def _facets(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """One panel per model and dataset (and workload, for multi-session runs)."""
    keys = [c for c in ("model", "dataset", "workload") if c in df]
    if not keys:
        return [("", df)]
    title = df[keys].astype(str).where(df[keys].notna(), "").agg(lambda r: " / ".join(v for v in r if v), axis=1)
    return [(t, g) for t, g in df.groupby(title, sort=True)]


def _grid(n: int, ncols_max: int = 3, w: float = 3.4, h: float = 2.7, sharey: bool = False):
    ncols = min(n, ncols_max)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(w * ncols, h * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=sharey).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _log_if_spans(ax, axis: str, values, base: float = 10, span: float = 10) -> None:
    """Log scale when the positive values span ``span``x (a decade by default); ticks as plain numbers."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size and (v > 0).all() and v.max() / v.min() >= span:
        which = ax.xaxis if axis == "x" else ax.yaxis
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log", base=base)
        if base == 10 and v.max() / v.min() < 1e3:  # a decade or two: label 1, 2, 5, 10, 20, 50
            which.set_major_locator(ticker.LogLocator(base=10, subs=(1, 2, 5)))
        which.set_major_formatter(ticker.FuncFormatter(lambda t, _: f"{t:g}"))
        which.set_minor_formatter(ticker.NullFormatter())


def _legend(fig: Figure, axes) -> None:
    """One legend: inside a single axes when short, else to the right of the figure, widened to make room."""
    handles: dict[str, object] = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    if not handles:
        return
    if len(axes) == 1 and len(handles) <= 4:
        with rc_context(STYLE):
            axes[0].legend()
        return
    longest = max(len(label) for label in handles)
    fig.set_figwidth(fig.get_figwidth() + 0.6 + 0.055 * longest)
    with rc_context(STYLE):
        fig.legend(list(handles.values()), list(handles), loc="outside right upper")


def _symlog_if_spans(ax, values) -> None:
    """Symmetric log on y when |values| span a decade (delta_nll can be 0 or slightly negative)."""
    raw = np.asarray(values, dtype=float)
    raw = raw[np.isfinite(raw)]
    pos = np.abs(raw[raw != 0])
    if pos.size and pos.max() / pos.min() >= 10:
        lin = 10 ** math.floor(math.log10(pos.min()))
        ax.set_yscale("symlog", linthresh=lin, linscale=0.5)
        lo = raw.min() * 2 if raw.min() < 0 else -lin
        ax.set_ylim(lo, raw.max() * 2)


def _mean_curves(ax, g: pd.DataFrame, x: str, y: str, styles: dict[str, dict], x_scale: float = 1) -> None:
    """One line per series through its mean ``y`` at each ``x`` (repeated cells of a sweep are averaged)."""
    for name, s in g.groupby("series", sort=True):
        s = s.groupby(x, as_index=False)[y].mean()
        ax.plot(x_scale * s[x], s[y], label=name, **styles[name])


def _reference_curve(ax, g: pd.DataFrame, x: str, y: str, label: str, x_scale: float = 1) -> list[float]:
    """The dashed reference (the entropy bound, ideal dedup) through the mean ``y`` at each ``x``; its y values,
    for the axis scale. Nothing when no row of the panel carries ``y``."""
    b = _finite(g, y)
    if b.empty:
        return []
    b = b.groupby(x, as_index=False)[y].mean()
    ax.plot(x_scale * b[x], b[y], marker="s", **BOUND_STYLE, label=label)
    return list(b[y])


def rate_distortion(df: pd.DataFrame):
    """Bits per element against delta_nll with its paired 95% interval, one line per compressor (and per non-rate
    setting), on one set of evaluated windows per panel."""
    d = _finite(_single_sequence_runs(df), "bits_per_element", "delta_nll")
    if d.empty:
        return None, "no run has both bits_per_element and delta_nll (run with metrics.nll=true)"
    d["series"] = series_label(d)
    facets = _facets(d)
    styles = series_styles(d["series"])
    with rc_context(STYLE):
        fig, axes = _grid(len(facets))
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
            _log_if_spans(ax, "x", g["bits_per_element"])
            _symlog_if_spans(ax, ys)
            ax.set_xlabel("rate (bits per KV element; 16-bit baseline = 16)")
            ax.set_ylabel(r"$\Delta$NLL (nats/token, held-out text)")
            ax.set_title(title)
    _legend(fig, [ax for ax in fig.axes if ax.get_visible()])
    return fig, ""


def context_length(df: pd.DataFrame):
    """Bits per token against context length, with the measured entropy bound H(token | history)."""
    d = _finite(_single_sequence_runs(df), "bits_per_token", "context_len")
    if d.empty:
        return None, "no run has bits_per_token"
    d["series"] = series_label(d, exclude=())
    swept = d.groupby("series")["context_len"].transform("nunique") > 1
    if swept.any():  # curves measured at one context only would be a column of points: leave them to the table
        d = d[swept]
    facets = _facets(d)
    styles = series_styles(d["series"])
    with rc_context(STYLE):
        fig, axes = _grid(len(facets))
        for ax, (title, g) in zip(axes, facets):
            _mean_curves(ax, g, "context_len", "bits_per_token", styles)
            ys = list(g["bits_per_token"])
            ys += _reference_curve(ax, g, "context_len", "bound_bits_per_token", "entropy bound H(token | history)")
            _log_if_spans(ax, "y", ys)
            _log_if_spans(ax, "x", g["context_len"], base=2, span=4)  # doubling sweeps: even steps
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("bits per token (all layers, K and V)")
            ax.set_title(title)
    _legend(fig, [ax for ax in fig.axes if ax.get_visible()])
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


def throughput(df: pd.DataFrame):
    """Encode and decode throughput against compression ratio, the Pareto front marked."""
    d = _finite(df, "compression_ratio", "encode_MBps", "decode_MBps")
    if not d.empty:
        d = d[(d["encode_MBps"] > 0) & (d["decode_MBps"] > 0) & (d["compression_ratio"] > 0)]
    if d.empty:
        return None, "no run has finite compression_ratio, encode_MBps and decode_MBps"
    facets = _facets(d)
    compressors = sorted(d["compressor"].astype(str).unique())
    colors = {c: st["color"] for c, st in series_styles(compressors).items()}
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
                _log_if_spans(ax, "x", x)
                _log_if_spans(ax, "y", y)
                ax.set_xlabel(r"compression ratio vs 16-bit ($\times$)")
                ax.set_ylabel(f"{what} throughput (MB/s of 16-bit KV)")
                ax.set_title(f"{title}: {what}" if title else what)
    _legend(fig, [ax for ax in fig.axes if ax.get_visible()])
    return fig, ""


def prefix_sharing(df: pd.DataFrame):
    """Compression ratio against the workload's share rate (summaries with sharing statistics), beside the
    ratio exact token-level dedup alone would give (tokens / unique tokens)."""
    x = _first(df, SHARE_RATE_KEYS)
    if x is None:
        return None, "no summary carries sharing statistics (a share rate)"
    d = _finite(df, x, "compression_ratio")
    if d.empty:
        return None, f"no run has both {x} and compression_ratio"
    ideal = _first(d, DEDUP_KEYS)
    d["series"] = series_label(d, exclude=())
    facets = _facets(d)
    styles = series_styles(d["series"])
    with rc_context(STYLE):
        fig, axes = _grid(len(facets))
        for ax, (title, g) in zip(axes, facets):
            _mean_curves(ax, g, x, "compression_ratio", styles, x_scale=100)
            ys = list(g["compression_ratio"])
            if ideal:
                ys += _reference_curve(ax, g, x, ideal, "exact dedup: tokens / unique tokens", x_scale=100)
            _log_if_spans(ax, "y", ys)
            ax.set_xlabel("share rate (% of tokens in a prefix seen before)")
            ax.set_ylabel(r"compression ratio vs 16-bit ($\times$)")
            ax.set_title(title)
    _legend(fig, [ax for ax in fig.axes if ax.get_visible()])
    return fig, ""


def accuracy(ev: pd.DataFrame):
    """Task-accuracy change (compressed minus 16-bit, same examples) per task and compressor, 95% intervals."""
    d = _finite(ev, "diff")
    if d.empty or "task" not in d:
        return None, "no eval summary (python -m kvbench eval)"
    d["series"] = series_label(d, exclude=())
    facets = _facets(d.drop(columns=[c for c in ("dataset", "workload") if c in d]))
    with rc_context(STYLE):
        fig, axes = _grid(len(facets), ncols_max=1, w=max(3.4, 0.55 * d["task"].nunique() + 1.5))
        for ax, (title, g) in zip(axes, facets):
            tasks = sorted(g["task"].astype(str).unique())
            series = sorted(g["series"].unique())
            width = 0.8 / len(series)
            for i, name in enumerate(series):
                s = g[g["series"] == name].groupby("task")
                mean = s["diff"].mean().reindex(tasks).to_numpy(float)
                err = s["stderr_diff"].mean().reindex(tasks).to_numpy(float) if "stderr_diff" in g else None
                pos = np.arange(len(tasks)) + (i - (len(series) - 1) / 2) * width
                ax.bar(pos, 100 * mean, width, label=name, yerr=None if err is None else 196 * err, capsize=2)
            ax.axhline(0, color="black", linewidth=0.6)
            ax.set_xticks(np.arange(len(tasks)), tasks, rotation=20, ha="right")
            ax.set_ylabel("accuracy change vs 16-bit (points, 95% CI)")
            ax.set_title(title)
    _legend(fig, [ax for ax in fig.axes if ax.get_visible()])
    return fig, ""


def latency_vs_memory(lat: pd.DataFrame):
    """Decode tokens/s against the bytes the cache holds, per context length: the memory-throughput trade."""
    d = _finite(lat, "tokens_per_s", "bytes_held", "context")
    if d.empty:
        return None, "no latency summary (python -m kvbench latency)"
    d["series"] = series_label(d, exclude=())
    if "cache" in d:
        d.loc[d["cache"].astype(str) == "dynamic", "series"] = "DynamicCache (16-bit)"
    d = d.drop_duplicates(["model", "series", "context"]) if "model" in d else d
    facets = _facets(d.drop(columns=[c for c in ("dataset", "workload") if c in d]))
    contexts = sorted(d["context"].unique())
    markers = dict(zip(contexts, "osD^v<>p*h"))
    with rc_context(STYLE):
        fig, axes = _grid(len(facets))
        for ax, (title, g) in zip(axes, facets):
            for i, (name, s) in enumerate(g.groupby("series", sort=True)):
                s = s.sort_values("context")
                ax.plot(s["bytes_held"] / 1e6, s["tokens_per_s"], color=f"C{i % 10}", linewidth=0.8, label=name)
                for _, r in s.iterrows():
                    ax.scatter(r["bytes_held"] / 1e6, r["tokens_per_s"], color=f"C{i % 10}", marker=markers[r["context"]],
                               zorder=3)
            for c, m in markers.items():
                ax.scatter([], [], color="grey", marker=m, label=f"{int(c)} tokens")
            _log_if_spans(ax, "x", g["bytes_held"] / 1e6)
            _log_if_spans(ax, "y", g["tokens_per_s"])
            ax.set_xlabel("KV cache held (MB)")
            ax.set_ylabel("decode throughput (tokens/s)")
            ax.set_title(title)
    _legend(fig, [ax for ax in fig.axes if ax.get_visible()])
    return fig, ""


# name -> (table of the collection it reads, builder)
FIGURES: dict[str, tuple[str, Callable[[pd.DataFrame], tuple[Figure | None, str]]]] = {
    "rate_distortion": ("runs", rate_distortion),
    "context_length": ("runs", context_length),
    "throughput_vs_ratio": ("runs", throughput),
    "prefix_sharing": ("runs", prefix_sharing),
    "accuracy_regression": ("evals", accuracy),
    "latency_vs_memory": ("latency", latency_vs_memory),
}
