"""Decode throughput against bytes held: CompressedCache with each compressor vs the plain DynamicCache
(SmolLM2-135M, configs/latency.yaml defaults: contexts 512/2048/4096, 64 decoded tokens).

    .venv/bin/python scripts/latency.py            # run the missing cells, then table and figure
    .venv/bin/python scripts/latency.py --no-run   # table and figure from the runs already there

Each cell is one ``python -m kvbench latency`` (``kvbench.cells.run_cell`` in a process of its own: the peak-memory
column is the whole process's, which earlier cells in the same process would inflate) under
``flock /tmp/kvbench-bench.lock``; the table reads the newest finished run of each cell. Compressors whose decoder
re-runs the model (recompute, speculative) cost a model pass per decoded token, so their cells use a short context
and few tokens (listed in ``CELLS``). Writes ``results/figures/latency.{png,pdf}``,
``results/latency.csv`` and prints the Markdown table quoted in ``results/latency.md``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from study_cells import LOCK, compose, finished_run

from kvbench.config import available
from kvbench.paths import repo_root, results_root

STYLE = {"font.size": 8, "axes.titlesize": 9, "axes.labelsize": 8, "legend.fontsize": 7, "xtick.labelsize": 7,
         "ytick.labelsize": 7, "axes.grid": True, "grid.alpha": 0.3, "savefig.dpi": 200, "pdf.fonttype": 42}
SLOW = ["latency.contexts=[512]", "latency.decode_tokens=8"]
CELLS = [  # (label, config name, overrides)
    ("identity", "identity", []),
    ("kivi 2-bit", "kivi", ["compressor.bits=2"]),
    ("turboquant 2.5-bit", "turboquant", ["compressor.bits=2.5"]),
    ("lossless", "lossless", ["latency.contexts=[512,2048]", "latency.decode_tokens=16"]),
    # delta coding against the model's own prediction, under the label of the delta family it belongs to
    ("delta model exact", "speculative", ["compressor.step=0", *SLOW]),
    ("recompute", "recompute", SLOW),
]


def cells() -> list[tuple[str, str, list[str]]]:
    have = set(available("compressor"))
    return [c for c in CELLS if c[1] in have]


def table(picked: list[tuple[str, dict]]) -> pd.DataFrame:
    rows = []
    for label, s in picked:
        for r in s["rows"]:
            ratio = s["ratios"][str(r["context"])]
            rows.append({"compressor": label if r["cache"] == "compressed" else f"DynamicCache (run of {label})",
                         "cache": r["cache"], "context": r["context"], "decode_tokens": s["decode_tokens"],
                         "prefill_s": r["prefill_s"], "compress_s": r["compress_s"],
                         "decode_median_ms": r["decode_median_ms"], "decode_p95_ms": r["decode_p95_ms"],
                         "tokens_per_s": r["tokens_per_s"], "decompress_s": r["decode_decompress_s"],
                         "bytes_held": r["bytes_held"], "peak_mem_bytes": r["peak_mem_bytes"],
                         "peak_mem_delta_bytes": r["peak_mem_delta_bytes"],
                         "tokens_match_dynamic": r.get("tokens_match_dynamic"),
                         "ratio_bytes": ratio["bytes_held"], "ratio_tokens_per_s": ratio["tokens_per_s"],
                         "load_1m": float(np.mean(s.get("loadavg_1m", [np.nan]))), "model_dtype": s["model_dtype"]})
    return pd.DataFrame(rows)


def figure(df: pd.DataFrame) -> Figure:
    from matplotlib import rc_context, ticker

    with rc_context(STYLE):
        fig = Figure(figsize=(8.0, 3.0), layout="constrained")
        ax, bx = fig.subplots(1, 2)
        comp = df[df["cache"] == "compressed"]
        dyn = df[df["cache"] == "dynamic"].groupby("context", as_index=False)[["bytes_held", "tokens_per_s"]].median()
        markers = {512: "o", 2048: "s", 4096: "^"}
        colors = {c: f"C{i}" for i, c in enumerate(dict.fromkeys(comp["compressor"]))}
        ax.scatter(dyn["bytes_held"] / 1e6, dyn["tokens_per_s"], c="black", marker="*", s=50, label="DynamicCache (16-bit)")
        for (c, T), g in comp.groupby(["compressor", "context"], sort=False):
            ax.scatter(g["bytes_held"] / 1e6, g["tokens_per_s"], color=colors[c], marker=markers.get(T, "D"), s=22,
                       label=c if T == comp[comp["compressor"] == c]["context"].min() else None)
        for T, m in markers.items():
            ax.scatter([], [], color="gray", marker=m, s=22, label=f"{T} tokens")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bytes held after decoding (MB, log)")
        ax.set_ylabel("decode tokens/s (log)")
        ax.set_title("throughput vs memory held")
        fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", fontsize=6)
        for c, g in comp.groupby("compressor", sort=False):
            g = g.sort_values("context")
            bx.plot(g["context"], g["ratio_tokens_per_s"], marker="o", color=colors[c], label=c)
        bx.axhline(1, color="black", linewidth=0.8)
        bx.set_xscale("log", base=2)
        bx.set_yscale("log")
        bx.set_xlabel("context tokens")
        bx.set_ylabel("tokens/s, compressed / DynamicCache")
        bx.set_title("decode slowdown")
        for a in (ax, bx):
            a.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
            a.yaxis.set_minor_formatter(ticker.NullFormatter())
        return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-run", action="store_true", help="only tabulate and plot the runs already there")
    ap.add_argument("--only", nargs="*", help="labels of the cells to run (default: all)")
    args = ap.parse_args()
    root = repo_root()
    results, runs = root / "results", results_root()
    if not args.no_run:
        for label, name, overrides in cells():
            if args.only and label not in args.only:
                continue
            print(f"== {label}", flush=True)
            subprocess.run(["flock", LOCK, sys.executable, "-m", "kvbench", "latency", f"+compressor={name}", *overrides,
                            f"paths.results={runs}"], cwd=root, check=True)
    picked = []
    for label, name, overrides in cells():
        s = finished_run("latency", compose("latency", [f"+compressor={name}", *overrides], runs))
        if s is None:
            print(f"no latency run for {label}", file=sys.stderr)
            continue
        picked.append((label, s))
    if not picked:
        return 1
    df = table(picked)
    df.to_csv(results / "latency.csv", index=False)
    out = results / "figures"
    out.mkdir(parents=True, exist_ok=True)
    fig = figure(df)
    for ext in ("png", "pdf"):
        fig.savefig(out / f"latency.{ext}")
    print("| cache | context | prefill s | compress s | decode p50 ms | p95 ms | tokens/s | MB held | peak RSS MB | "
          "tok/s ratio | bytes ratio | same tokens | load |")  # peak: whole process (model included)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in df.itertuples():
        ratio = f"{r.ratio_tokens_per_s:.3f} | {r.ratio_bytes:.3f}" if r.cache == "compressed" else "|"
        print(f"| {r.compressor} | {r.context} | {r.prefill_s:.2f} | {r.compress_s:.2f} | {r.decode_median_ms:.0f} | "
              f"{r.decode_p95_ms:.0f} | {r.tokens_per_s:.2f} | {r.bytes_held / 1e6:.2f} | {r.peak_mem_bytes / 1e6:.0f} | "
              f"{ratio} | {r.tokens_match_dynamic:.2f} | {r.load_1m:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
