"""The per-part studies' figures (``kvbench.report.sections``), in the one style of ``kvbench.report.plotting``. Each builder
takes the rows its section selected, with a ``series`` column naming each row's curve or bar, and returns
``(Figure, "")`` or ``(None, reason)``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib import rc_context
from matplotlib.figure import Figure

from kvbench.report import plotting as pl
from kvbench.report.collect import pool_tasks
from kvbench.report.figures import context_markers, memory_panel, memory_rows
from kvbench.report.plotting import BOUND_STYLE, STYLE, series_styles

# Published production prefix-cache hit rates (token level), as reference points for the share-rate axis
PRODUCTION_HIT_RATES = (
    (0.51, "Mooncake (Kimi) trace 51%"),  # arXiv 2407.00079, Table 1, unbounded cache
    (0.563, "DeepSeek V3/R1 56.3%"),  # DeepSeek inference system overview, Feb 2025
)


def _title(d: pd.DataFrame) -> str:
    """Model and dataset, and the windows when every row has the same (a study runs on one trace)."""
    title = " / ".join(str(d[c].iloc[0]) for c in ("model", "dataset") if c in d and d[c].nunique() == 1)
    if {"n_sequences", "context_len"} <= set(d.columns) and d["n_sequences"].nunique() == 1:
        title += f", {int(d['n_sequences'].iloc[0])} x {d['context_len'].iloc[0]:.0f}-token windows"
    return title


def per_vector(df: pd.DataFrame):
    """Distortion and throughput of per-vector quantizers against the bits per element they actually spend."""
    d = pl.finite(df, "bits_per_element", "rel_mse_k", "rel_mse_v", "delta_nll")
    if d.empty:
        return None, "no run has bits_per_element, rel_mse_k, rel_mse_v and delta_nll"
    styles = series_styles(d["series"])
    x = "bits_per_element"
    with rc_context(STYLE):
        fig, axes = pl.grid(4, ncols_max=4, w=3.0)
        for ax, (col, label) in zip(axes, (("rel_mse_k", "relative MSE of K"), ("rel_mse_v", "relative MSE of V"),
                                           ("delta_nll", r"$\Delta$NLL (nats/token, held-out text)"))):
            pl.mean_curves(ax, d, x, col, styles)
            pl.log_if_spans(ax, "y", d[col])
            ax.set_ylabel(label)
        ax = axes[3]
        t = pl.finite(d, "encode_MBps", "decode_MBps")
        for name, s in t.groupby("series", sort=True):
            s = s.groupby(x, as_index=False)[["encode_MBps", "decode_MBps"]].mean()
            ax.plot(s[x], s["encode_MBps"], **styles[name])
            ax.plot(s[x], s["decode_MBps"], **{**styles[name], "markerfacecolor": "none"})
        ax.set_ylabel("MB/s of 16-bit KV (encode filled, decode open)")
        for ax in axes:
            ax.set_xlabel("bits per element (every stored bit)")
        fig.suptitle(_title(d))
    pl.legend(fig, axes)
    return fig, ""


def sequential(df: pd.DataFrame):
    """Bits per token of each cell against the entropy bound (log), beside its decode time per window."""
    d = pl.finite(df, "bits_per_token", "decode_s_per_seq")
    if d.empty:
        return None, "no run has bits_per_token and decode_s"
    styles = series_styles(d["series"])
    colors = [styles[s]["color"] for s in d["series"]]
    y = np.arange(len(d))[::-1]
    bits, dec = d["bits_per_token"].to_numpy(float), d["decode_s_per_seq"].to_numpy(float)
    with rc_context(STYLE):
        fig = Figure(figsize=(10, 0.3 * len(d) + 1.4), layout="constrained")
        ax1, ax2 = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 2]})
        ax1.barh(y, bits, color=colors)
        ax1.set_xscale("log")
        bound = pd.to_numeric(d.get("bound_bits_per_token"), errors="coerce").mean() if "bound_bits_per_token" in d \
            else np.nan
        if np.isfinite(bound):
            ax1.axvline(bound, **BOUND_STYLE)
            ax1.text(bound * 1.1, y[0] + 0.6, f"bound {bound:.2f} bits/token", va="bottom")
        for yi, b, (_, r) in zip(y, bits, d.iterrows()):
            lossy = "" if str(r.get("lossless")) == "True" else f"   ΔNLL {r.get('delta_nll', np.nan):+.4f}"
            ax1.text(b * 1.08, yi, (f"{b:,.1f}" if b < 100 else f"{b:,.0f}") + lossy, va="center")
        ax1.set_xlim(min(bits.min(), bound if np.isfinite(bound) else bits.min()) / 2, bits.max() * 12)
        ax1.set_yticks(y, d["series"])
        ax1.set_xlabel("bits per token, all layers, K and V (log)")
        ax2.barh(y, dec, color=colors)
        ax2.set_xscale("log")
        for yi, t in zip(y, dec):
            ax2.text(t * 1.08, yi, f"{t:.2f} s", va="center")
        ax2.set_xlim(dec[dec > 0].min() / 2 if (dec > 0).any() else 1e-3, dec.max() * 8)
        ax2.set_xlabel("decode s per window (log)")
        fig.suptitle(f"Sequential KV coding: {_title(d)}")
    return fig, ""


def prefix_sharing_ratio(sweep: pd.DataFrame, families: pd.DataFrame):
    """Compression ratio of exact dedup against the share rate: the mixed workload's sweep as curves, single-family
    workloads as points, the ideal 1/(1 - share) and published production hit rates for reference."""
    x, y = "sharing.share_rate", "compression_ratio"
    d = pl.finite(sweep, x, y)
    if d.empty:
        return None, "no run has sharing.share_rate and compression_ratio"
    fam = pl.finite(families, x, y)
    styles = series_styles(pd.concat([d["series"], fam.get("series", pd.Series(dtype=str))]))
    with rc_context(STYLE):
        fig, (ax,) = pl.grid(1, w=5.2, h=3.6)
        s = np.linspace(0, 0.95, 100)
        ax.plot(s, 1 / (1 - s), **BOUND_STYLE, label="exact dedup ideal 1/(1 - share)")
        pl.mean_curves(ax, d, x, y, styles)
        for name, g in fam.groupby("series", sort=True):
            ax.plot(g[x], g[y], linestyle="none", **{k: v for k, v in styles[name].items() if k != "linestyle"},
                    label=f"{name} (one family)")
        for _, r in fam.iterrows():
            ax.annotate(str(r.get("workload", "")), (r[x], r[y]), xytext=(-4, 4), textcoords="offset points",
                        fontsize=6, ha="right")
        lo, hi = min(h for h, _ in PRODUCTION_HIT_RATES), max(h for h, _ in PRODUCTION_HIT_RATES)
        ax.axvspan(lo, hi, color="grey", alpha=0.25, lw=0,
                   label="production hit rates: " + ", ".join(name for _, name in PRODUCTION_HIT_RATES))
        ax.set_xlim(0, 1.0)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("share rate (fraction of tokens in a prefix seen before)")
        ax.set_ylabel(r"compression ratio vs 16-bit ($\times$)")
        ax.set_title(f"Exact prefix dedup: {_title(d)}")
    pl.legend(fig, [ax])
    return fig, ""


def prefix_sharing_budget(df: pd.DataFrame):
    """Token hit rate and KV held against the prefix cache's budget, per eviction policy; the unbounded cache's hit
    rate as the reference."""
    d = pl.finite(df, "prefix_cache.hit_rate", "prefix_cache.memory_held_mean_tokens")
    if d.empty:
        return None, "no run has prefix_cache statistics"
    budget = pd.to_numeric(d["prefix_cache.budget_tokens"], errors="coerce") if "prefix_cache.budget_tokens" in d \
        else pd.Series(np.nan, index=d.index)
    bounded, unbounded = d[budget.notna()].assign(budget=budget), d[budget.isna()]
    styles = series_styles(d["series"])
    with rc_context(STYLE):
        fig, (ax1, ax2) = pl.grid(2, w=4.0, h=3.0)
        pl.mean_curves(ax1, bounded, "budget", "prefix_cache.hit_rate", styles)
        pl.mean_curves(ax2, bounded, "budget", "prefix_cache.memory_held_mean_tokens", styles)
        if not unbounded.empty:
            ideal = float(unbounded["prefix_cache.hit_rate"].mean())
            ax1.axhline(ideal, **BOUND_STYLE, label=f"unbounded ({ideal:.3f})")
        for ax in (ax1, ax2):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("cache budget (tokens of KV)")
        ax2.set_yscale("log", base=2)
        ax1.set_ylabel("token hit rate (prefill saved)")
        ax2.set_ylabel("mean KV held (tokens)")
        fig.suptitle(f"Prefix cache under a budget: {_title(d)}")
    pl.legend(fig, [ax1, ax2])
    return fig, ""


def prefix_sharing_composition(df: pd.DataFrame):
    """Bits per token of each compressor alone and inside the trie, one panel per workload."""
    d = pl.finite(df, "bits_per_token", "compression_ratio")
    if d.empty or "workload" not in d:
        return None, "no workload run has bits_per_token"
    styles = series_styles(d["series"])
    workloads = list(dict.fromkeys(d["workload"].astype(str)))
    with rc_context(STYLE):
        fig, axes = pl.grid(len(workloads), w=4.2, h=3.4)
        for ax, wl in zip(axes, workloads):
            g = d[d["workload"].astype(str) == wl]
            pos = np.arange(len(g))
            ax.bar(pos, g["bits_per_token"], color=[styles[s]["color"] for s in g["series"]])
            for i, (b, r) in enumerate(zip(g["bits_per_token"], g["compression_ratio"])):
                ax.annotate(f"{b / 1000:.0f}k\n{r:.1f}x", (i, b), ha="center", va="bottom", fontsize=6)
            ax.set_xticks(pos, g["series"], rotation=45, ha="right")
            ax.set_yscale("log")
            ax.set_ylim(top=g["bits_per_token"].max() * 3)
            ax.set_ylabel("bits per token (all layers, K and V)")
            share = g["sharing.share_rate"].iloc[0] if "sharing.share_rate" in g else np.nan
            ax.set_title(f"{wl} (share rate {share:.2f})")
    return fig, ""


def end_to_end(lat: pd.DataFrame):
    """Decode throughput against the bytes the cache holds (a marker per context), and each compressed cache's
    tokens/s relative to the 16-bit cache of its own run against the context."""
    d = memory_rows(lat)
    if d.empty or "cache" not in d:
        return None, "no latency summary (python -m kvbench latency)"
    slow = pl.finite(lat[lat["cache"] == "compressed"], "ratio_tokens_per_s", "context")
    styles = series_styles(pd.concat([d["series"], slow.get("series", pd.Series(dtype=str))]))
    with rc_context(STYLE):
        fig, (ax, bx) = pl.grid(2, w=4.0, h=3.0)
        memory_panel(ax, d, styles, context_markers(d))
        ax.set_title("throughput against memory held")
        pl.mean_curves(bx, slow, "context", "ratio_tokens_per_s", styles)
        bx.axhline(1, color="black", linewidth=0.6)
        bx.set_xscale("log", base=2)
        pl.log_if_spans(bx, "y", slow["ratio_tokens_per_s"])
        bx.set_xlabel("context (tokens)")
        bx.set_ylabel("tokens/s, compressed / DynamicCache")
        bx.set_title("decode slowdown")
    pl.legend(fig, [ax, bx])
    return fig, ""


#: the loss a frontier figure can plot: column -> its y label
LOSSES = {"delta_nll": r"$\Delta$NLL (nats/token, held-out text), 95% CI",
          "delta_nll_recall": r"recall-probe $\Delta$NLL (nats/token on the copy), 95% CI"}


def nll_vs_stream_bits(df: pd.DataFrame, title: str, reference: set[str] = frozenset(), metric: str = "delta_nll"):
    """A loss (``metric``: next-token delta NLL, or the recall probe's) with its paired 95% interval against the
    stream bits per element (the bitstreams alone; codec parameters fitted on other text are the codec's), one curve
    per ``series``, the 1% NLL line on the next-token loss; ``reference`` curves drawn lighter. A series whose rows
    carry ``exact_tokens`` names them in its legend entry."""
    if metric not in LOSSES:
        raise ValueError(f"metric {metric!r}; one of {sorted(LOSSES)}")
    d = df.assign(x=pd.to_numeric(df.get("stream_bits_per_element"), errors="coerce")) if not df.empty else df
    if metric != "delta_nll" and not d.empty:
        d = d.assign(delta_nll=pd.to_numeric(d.get(metric), errors="coerce"), delta_nll_low=d.get(f"{metric}_low"),
                     delta_nll_high=d.get(f"{metric}_high"), nll_base=np.nan)
    d = pl.finite(d, "x", "delta_nll")
    if d.empty:
        return None, f"no run has stream_bits_per_element and {metric}"
    styles = series_styles(d["series"])
    with rc_context(STYLE):
        fig, (ax,) = pl.grid(1, w=5.6, h=3.8)
        for name, s in d.groupby("series", sort=True):
            s = s.sort_values("x")
            exact = s["exact_tokens"].dropna().astype(str).unique() if "exact_tokens" in s else []
            label = name + (f" (exact: {exact[0]})" if len(exact) == 1 and exact[0] not in ("none", "-") else "")
            style = {**styles[name], **({"alpha": 0.55, "linewidth": 0.9} if name in reference else {})}
            ax.plot(s["x"], s["delta_nll"], label=label + (" [reference]" if name in reference else ""), **style)
            lo = (s["delta_nll"] - pd.to_numeric(s.get("delta_nll_low"), errors="coerce")).clip(lower=0)
            hi = (pd.to_numeric(s.get("delta_nll_high"), errors="coerce") - s["delta_nll"]).clip(lower=0)
            if lo.notna().any():
                ax.errorbar(s["x"], s["delta_nll"], yerr=[lo.fillna(0), hi.fillna(0)], fmt="none",
                            ecolor=style["color"], elinewidth=0.8, capsize=2, alpha=style.get("alpha", 1.0))
        ys = list(d["delta_nll"]) + [v for c in ("delta_nll_low", "delta_nll_high") if c in d
                                     for v in pd.to_numeric(d[c], errors="coerce").dropna()]
        base = pd.to_numeric(d.get("nll_base"), errors="coerce").mean() if "nll_base" in d else np.nan
        if np.isfinite(base):
            ax.axhline(0.01 * base, color="grey", linestyle=":", linewidth=1, label=f"1% NLL ({0.01 * base:.3f} nats)")
            ys.append(0.01 * base)
        ax.axhline(0, color="black", linewidth=0.6)
        pl.log_if_spans(ax, "x", d["x"], base=2, span=4)
        pl.symlog_if_spans(ax, ys)
        ax.set_xlabel("stream bits per K/V element (16-bit cache = 16)")
        ax.set_ylabel(LOSSES[metric])
        ax.set_title(f"{title}: {_title(d)}" if _title(d) else title)
    pl.legend(fig, [ax])
    return fig, ""


def accuracy_vs_bits(d: pd.DataFrame):
    """RULER accuracy against bits per element held, one panel per task family (lengths pooled by examples), each
    compressor a point with its paired 95% interval; the 16-bit baseline as a dashed line."""
    d = pl.finite(d, "acc_comp", "bits_per_element")
    if d.empty:
        return None, "no RULER eval rows with bits per element"
    families = sorted(d["family"].astype(str).unique())
    styles = series_styles(d["compressor"])
    with rc_context(STYLE):
        fig, axes = pl.grid(len(families), ncols_max=4, w=3.0)
        for ax, fam in zip(axes, families):
            g = d[d["family"] == fam]
            for name, s in g.groupby("compressor", sort=False):
                p = pool_tasks(s)  # the family's lengths pooled by examples
                ax.errorbar(float(s["bits_per_element"].mean()), p["acc_comp"], yerr=1.96 * p["stderr_diff"], fmt="o",
                            capsize=2, label=name, color=styles[name]["color"])
                ax.axhline(p["acc_base"], color="grey", linestyle="--", linewidth=0.6)
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.05, 1.05)
            ax.set_title(fam.removeprefix("ruler_"), fontsize=8)
            ax.set_xlabel("bits / element held")
            ax.set_ylabel("accuracy (95% CI of the change)")
        pl.legend(fig, [ax for ax in fig.axes if ax.get_visible()])
        fig.suptitle(f"RULER accuracy vs bits, {_title(d)} (dashed: 16-bit)")
    return fig, ""


def pooled_accuracy_vs_bits(cells: pd.DataFrame):
    """RULER accuracy pooled over the families clear of chance against bits per element held, one line per coder
    family (its cells at several budgets joined; a ``series`` column, where given, names the lines instead, so that
    variants of one coder are lines of their own), each point with the 95% interval of its paired change around it;
    eviction methods are points at their byte cost. The 16-bit baseline as a dashed line."""
    return _pooled_accuracy(cells, "bits_per_element", "bits / element held", "bits", log=True)


def pooled_accuracy_vs_ratio(cells: pd.DataFrame):
    """RULER accuracy pooled over the families clear of chance against the compression ratio as kvpress's
    leaderboard states it (the fraction of the cache's tokens evicted: ``press_ratio``), one line per method, each
    point with the 95% interval of its paired change around it. The 16-bit baseline as a dashed line."""
    return _pooled_accuracy(cells, "press_ratio", "compression ratio (fraction of tokens evicted)",
                            "compression ratio", log=False)


def _pooled_accuracy(cells: pd.DataFrame, x_col: str, xlabel: str, what: str, log: bool):
    d = pl.finite(cells, "acc_comp", x_col)
    if d.empty:
        return None, f"no pooled RULER rows with {x_col}"
    family = d["series"].astype(str) if "series" in d else d["compressor"].astype(str).str.split(" ").str[0]
    styles = series_styles(family)
    with rc_context(STYLE):
        fig = Figure(figsize=(5.0, 3.4))
        ax = fig.add_subplot()
        for name, g in d.assign(family=family).groupby("family", sort=False):
            g = g.sort_values(x_col)
            x, y = g[x_col].astype(float), g["acc_comp"].astype(float)
            # the interval of the change, placed around the compressed accuracy (the baseline is the same examples')
            low = (g["acc_comp"] - (g["diff"] - g["ci95_low"])).astype(float)
            high = (g["acc_comp"] + (g["ci95_high"] - g["diff"])).astype(float)
            yerr = [np.clip(y - low, 0, None), np.clip(high - y, 0, None)]  # an interval must hold its point to be drawn
            ax.errorbar(x, y, yerr=yerr, fmt="o-", capsize=2, label=name, color=styles[name]["color"])
        for base in d["acc_base"].astype(float).unique():
            ax.axhline(base, color="grey", linestyle="--", linewidth=0.6)
        if log:
            ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("pooled accuracy (95% CI of the change)")
        ax.legend(fontsize=7)
        fig.suptitle(f"RULER pooled accuracy vs {what}, {_title(d)} (dashed: 16-bit)", fontsize=9)
    return fig, ""
