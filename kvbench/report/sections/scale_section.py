"""The scale section: wall time and peak resident memory of each step of a cell (capture, encode, decode, score)
against the context length, per model and compressor, from the runs scripts/bench_scale.py files (one per model and
length, one row per step), with the growth fitted to them and the longest context each model reaches.

Wall time is fitted as ``a + b T + c T^2`` (T the context in thousands of tokens: the linear term is the weights and
the KV, the quadratic one attention over the whole prefix), peak memory as ``a + b T``, both by ordinary least
squares over the measured lengths; a term lost in the machine's noise can come out negative, and the table shows the
fit's largest relative error at the measured points so that a poor fit is seen as one.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvbench.report import plotting
from kvbench.report.collect import Collection, numeric
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

STEPS = ("capture", "encode", "decode", "score")
STEP_COLUMNS = pick("model", "dataset", "context", "windows_held", "step", "compressor", "wall_s", "rss_before_gb", "step_peak_rss_gb",
                    "estimate_gb", "bits_per_element", "nll", "torch_threads")
FIT_COLUMNS = pick("model", "dataset", "windows_held", "step", "compressor", "lengths", "context_max", "wall_fixed_s", "wall_s_per_1k",
                   "wall_s_per_1k_sq", "wall_fit_max_rel_err", "quadratic_share_at_max", "rss_fixed_gb",
                   "rss_gb_per_1k")
REACH_COLUMNS = pick("model", "lengths", "context_max", "dataset_at_max", "windows_at_max", "peak_at_max_gb", "rss_gb_per_1k", "position_limit",
                     "machine_memory_gb", "reach_extrapolated")
STEP_NOTE = ("One evaluated window and one calibration window per length, each window scored on its next held-out "
             "tokens; every step runs in a process of its own, so its peak is its own: capture prefills both windows "
             "into a trace, encode fits the compressor on the calibration window and encodes the evaluated one, "
             "decode decodes the stored bytes with a decoder rebuilt from the fitted state alone, score scores the "
             "continuation on the decoded cache. RSS before: the process when the step began (interpreter, weights "
             "where the step loads the model, its inputs); step peak: the kernel's high-water mark reset as the step "
             "began; estimated peak: what the footprint check (kvbench/inputs/footprint.py) predicted before the "
             "model ran. Wall time on the machine named above, with the other work it ran beside in its load "
             "averages.")
FIT_NOTE = ("Least squares over the measured lengths, T in thousands of tokens: wall s = fixed + b T + c T^2 and "
            "step peak GB = fixed + b T. Quadratic share: the c T^2 term's part of the fitted time at the largest "
            "length. A fit needs three lengths for the wall time, two for the memory.")
REACH_NOTE = ("Largest context: the longest window measured; its peak is the highest step peak there, with the "
              "text and the windows its trace held. Lengths and the memory fit: the text and windows-held setting "
              "measured at the most lengths. Context at machine memory: where the memory fit (the highest step peak "
              "at each length against the length) reaches the measuring machine's memory, extrapolated past the "
              "lengths measured and not capped by the model's positions, which bound what a window may hold.")


def _ordered(d: pd.DataFrame) -> pd.DataFrame:
    order = {s: i for i, s in enumerate(STEPS)}
    held = numeric(d, "n_sequences") + numeric(d, "n_calib")  # the windows a capture prefills and a trace holds
    return (d.assign(_o=d["step"].map(order).fillna(len(STEPS)), context=numeric(d, "context"), windows_held=held)
            .sort_values(["model", "context", "_o", "compressor"], kind="stable", na_position="first")
            .drop(columns="_o").reset_index(drop=True))


def fit(x: np.ndarray, y: np.ndarray, degree: int) -> np.ndarray:
    """Least-squares coefficients (constant first) of a polynomial of ``degree`` in ``x``."""
    return np.linalg.lstsq(np.vander(x, degree + 1, increasing=True), y, rcond=None)[0]


def fits(d: pd.DataFrame) -> pd.DataFrame:
    """Per model, windows held, step and compressor: the wall-time and peak-memory fits over the measured lengths
    (a capture of one window is not a point on the curve of a capture of two, nor one text's on another's)."""
    d, rows = _ordered(d), []
    for (model, ds, held, step, comp), g in d.groupby(["model", "dataset", "windows_held", "step",
                                                       d["compressor"].fillna("")], sort=False):
        g = g.assign(wall_s=numeric(g, "wall_s"), peak=numeric(g, "step_peak_rss_gb")).dropna(subset=["context"])
        t = g["context"].to_numpy(float) / 1000
        row = {"model": model, "dataset": ds, "windows_held": held, "step": step, "compressor": comp or math.nan,
               "lengths": len(set(t)),
               "context_max": float(t.max() * 1000) if t.size else math.nan}
        ok = np.isfinite(g["wall_s"].to_numpy(float))
        if len(set(t[ok])) >= 3:
            a, b, c = fit(t[ok], g["wall_s"].to_numpy(float)[ok], 2)
            got = a + b * t[ok] + c * t[ok] ** 2
            top = t[ok].max()
            row.update(wall_fixed_s=a, wall_s_per_1k=b, wall_s_per_1k_sq=c,
                       wall_fit_max_rel_err=float(np.max(np.abs(got / g["wall_s"].to_numpy(float)[ok] - 1))),
                       quadratic_share_at_max=c * top ** 2 / (a + b * top + c * top ** 2))
        ok = np.isfinite(g["peak"].to_numpy(float))
        if len(set(t[ok])) >= 2:
            a, b = fit(t[ok], g["peak"].to_numpy(float)[ok], 1)
            row.update(rss_fixed_gb=a, rss_gb_per_1k=b)
        rows.append(row)
    return pd.DataFrame(rows)


def reach(d: pd.DataFrame) -> pd.DataFrame:
    """Per model: the longest window measured, the highest step peak there, and where the memory fit over every
    length's highest step peak meets the machine's memory (fitted on the text and windows-held setting measured at
    the most lengths)."""
    d, rows = _ordered(d), []
    for model, g in d.groupby("model", sort=False):
        top = g[g["context"] == g["context"].max()]
        counts = g.groupby(["dataset", "windows_held"])["context"].nunique()
        if len(counts):
            ds, held = counts.idxmax()
            g = g[(g["dataset"] == ds) & (g["windows_held"] == held)]
        peaks = numeric(g, "step_peak_rss_gb").groupby(g["context"]).max().dropna()
        t = peaks.index.to_numpy(float) / 1000
        memory = numeric(g, "machine_memory_gb").max()
        row = {"model": model, "lengths": len(peaks), "context_max": float(top["context"].max()),
               "windows_at_max": numeric(top, "windows_held").max(),
               "dataset_at_max": ", ".join(sorted(set(top["dataset"].astype(str)))),
               "peak_at_max_gb": float(numeric(top, "step_peak_rss_gb").max()),
               "position_limit": numeric(g, "position_limit").max(), "machine_memory_gb": memory}
        if len(peaks) >= 2:
            a, b = fit(t, peaks.to_numpy(float), 1)
            row["rss_gb_per_1k"] = b
            row["reach_extrapolated"] = (memory - a) / b * 1000 if b > 0 and math.isfinite(memory) else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def _figure(d: pd.DataFrame, y: str, label: str):
    panels = [(m, g) for m, g in d.groupby("model", sort=True)]
    if not panels or plotting.finite(d, "context", y).empty:
        return None, f"no {y} in the scale runs"
    alone = d["windows_held"].map(lambda n: f" ({n:g} window{'s' if n != 1 else ''})" if n != 2 else "")
    d = d.assign(series=d["step"] + d["compressor"].map(lambda c: f" {c}" if isinstance(c, str) and c else "") + alone)
    styles = plotting.series_styles(d["series"])
    with plotting.rc_context(plotting.STYLE):
        fig, axes = plotting.grid(len(panels))
        for ax, (model, _) in zip(axes, panels):
            g = plotting.finite(d[d["model"] == model], "context", y)
            plotting.mean_curves(ax, g, "context", y, styles)
            plotting.log_if_spans(ax, "x", g["context"], base=2, span=4)
            plotting.log_if_spans(ax, "y", g[y])
            ax.set_title(model)
            ax.set_xlabel("context tokens")
            ax.set_ylabel(label)
        plotting.legend(fig, axes)
    return fig, ""


def scale(got: Collection) -> tuple[list[Table], Figures]:
    d = got.scale
    if d.empty:
        return [Table("scale", d, STEP_COLUMNS, "each step against the context", STEP_NOTE,
                      empty="_no scale runs_\n")], {}
    d = _ordered(d)
    # one stem: the page shows the three tables together, the reach first
    return ([Table("scale", reach(d), REACH_COLUMNS, "the longest context each model reaches", REACH_NOTE),
             Table("scale", fits(d), FIT_COLUMNS, "the growth fitted to each step", FIT_NOTE),
             Table("scale", d, STEP_COLUMNS, "each step against the context", STEP_NOTE, csv=True)],
            {"scale_wall": _figure(d, "wall_s", "wall s"), "scale_rss": _figure(d, "step_peak_rss_gb",
                                                                                 "step peak RSS GB")})
