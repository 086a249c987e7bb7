"""One figure style and the drawing helpers every kvbench figure shares (the report's overview and the per-part
studies): series colours by compressor family, panels per model and dataset, log axes where a range spans decades,
one legend per figure.

Figures are built on ``matplotlib.figure.Figure`` directly (no pyplot, no global backend).
"""

from __future__ import annotations

import math

import matplotlib
import numpy as np
import pandas as pd
from matplotlib import rc_context, ticker
from matplotlib.figure import Figure

STYLE = {
    "font.size": 8, "axes.titlesize": 9, "axes.labelsize": 8, "legend.fontsize": 7, "xtick.labelsize": 7,
    "ytick.labelsize": 7, "axes.grid": True, "grid.alpha": 0.3, "lines.markersize": 4, "lines.linewidth": 1.2,
    "savefig.dpi": 200, "pdf.fonttype": 42,  # TrueType in PDFs: editable text, accepted by publishers
}
BOUND_STYLE = {"color": "black", "linestyle": "--", "linewidth": 1.0}

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


def single_sequence_runs(df: pd.DataFrame) -> pd.DataFrame:
    """Runs on the dataset's windows, not multi-session workloads (those have their own figure)."""
    if "workload" not in df:
        return df
    return df[df["workload"].isna() | (df["workload"].astype(str).isin(["none", ""]))]


def finite(df: pd.DataFrame, *cols: str) -> pd.DataFrame:
    if df.empty or any(c not in df for c in cols):
        return df.iloc[0:0]
    num = df[list(cols)].apply(pd.to_numeric, errors="coerce")
    keep = np.isfinite(num.to_numpy(dtype=float)).all(axis=1)
    out = df.loc[keep].copy()
    out[list(cols)] = num.loc[keep]
    return out


def first(df: pd.DataFrame, keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if k in df and pd.to_numeric(df[k], errors="coerce").notna().any()), None)


def facets(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """One panel per model and dataset (and workload, for multi-session runs)."""
    keys = [c for c in ("model", "dataset", "workload") if c in df]
    if not keys:
        return [("", df)]
    title = df[keys].astype(str).where(df[keys].notna(), "").agg(lambda r: " / ".join(v for v in r if v), axis=1)
    return [(t, g) for t, g in df.groupby(title, sort=True)]


def grid(n: int, ncols_max: int = 3, w: float = 3.4, h: float = 2.7, sharey: bool = False):
    ncols = min(n, ncols_max)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(w * ncols, h * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=sharey).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def log_if_spans(ax, axis: str, values, base: float = 10, span: float = 10) -> None:
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


def legend(fig: Figure, axes) -> None:
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


def symlog_if_spans(ax, values) -> None:
    """Symmetric log on y when |values| span a decade (delta_nll can be 0 or slightly negative)."""
    raw = np.asarray(values, dtype=float)
    raw = raw[np.isfinite(raw)]
    pos = np.abs(raw[raw != 0])
    if pos.size and pos.max() / pos.min() >= 10:
        lin = 10 ** math.floor(math.log10(pos.min()))
        ax.set_yscale("symlog", linthresh=lin, linscale=0.5)
        lo = raw.min() * 2 if raw.min() < 0 else -lin
        ax.set_ylim(lo, raw.max() * 2)


def mean_curves(ax, g: pd.DataFrame, x: str, y: str, styles: dict[str, dict], x_scale: float = 1) -> None:
    """One line per series through its mean ``y`` at each ``x`` (repeated cells of a sweep are averaged)."""
    for name, s in g.groupby("series", sort=True):
        s = s.groupby(x, as_index=False)[y].mean()
        ax.plot(x_scale * s[x], s[y], label=name, **styles[name])


def reference_curve(ax, g: pd.DataFrame, x: str, y: str, label: str, x_scale: float = 1) -> list[float]:
    """The dashed reference (the entropy bound, ideal dedup) through the mean ``y`` at each ``x``; its y values,
    for the axis scale. Nothing when no row of the panel carries ``y``."""
    b = finite(g, y)
    if b.empty:
        return []
    b = b.groupby(x, as_index=False)[y].mean()
    ax.plot(x_scale * b[x], b[y], marker="s", **BOUND_STYLE, label=label)
    return list(b[y])
