"""Task-accuracy regression of compressed caches at matched bits (SmolLM2-135M, configs/eval.yaml defaults).

    .venv/bin/python scripts/accuracy.py            # run the missing cells, then table and figure
    .venv/bin/python scripts/accuracy.py --no-run   # table and figure from the runs already there

Each cell is what ``python -m kvbench eval`` would run, through ``kvbench.cells.run_cell`` on one loaded model
(accuracy needs no lock: nothing in it is timed for publication); a finished run of the same cell, of any code
version, is reused. Writes ``results/figures/accuracy.{png,pdf}``,
``results/accuracy.csv`` (one row per compressor and task) and prints the Markdown table quoted in
``results/accuracy.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from study_cells import compose, finished_run

from kvbench.cells import formatter, run_cell
from kvbench.config import available
from kvbench.models import ModelHandle
from kvbench.paths import repo_root, results_root

STYLE = {"font.size": 8, "axes.titlesize": 9, "axes.labelsize": 8, "legend.fontsize": 7, "xtick.labelsize": 7,
         "ytick.labelsize": 7, "axes.grid": True, "grid.alpha": 0.3, "savefig.dpi": 200, "pdf.fonttype": 42}


def cells() -> list[tuple[str, list[str]]]:
    """(label, eval overrides) in display order; TurboQuant only where it is configured."""
    out = [("identity", ["+compressor=identity"]), ("kivi 2-bit", ["+compressor=kivi", "compressor.bits=2"])]
    if "turboquant" in available("compressor"):
        out.append(("turboquant 2.5-bit", ["+compressor=turboquant", "compressor.bits=2.5"]))
    return out


def run_all(runs: Path) -> None:
    """Measure every cell that has no finished run under ``runs``, on one loaded model."""
    handle = None
    for label, overrides in cells():
        print(f"== {label}", flush=True)
        cfg = compose("eval", overrides, runs)
        handle = handle or ModelHandle(cfg.model, cfg.device)
        out = run_cell("eval", cfg, handle)
        if out.reused:
            print(f"reusing finished run {out.path}")
        print(formatter("eval")(out.summary), flush=True)


def table(summaries: list[tuple[str, dict]]) -> pd.DataFrame:
    rows = []
    for label, s in summaries:
        for task, t in [*s["tasks"].items(), ("all", s["overall"])]:
            rows.append({"compressor": label, "task": task, "n": t["n"], "metric": t.get("metric", "mixed"),
                         "acc_base": t["acc_base"], "stderr_base": t["stderr_base"], "acc_comp": t["acc_comp"],
                         "stderr_comp": t["stderr_comp"], "diff": t["diff"],
                         # a difference of two accuracies lies in [-1, 1]; the normal interval can overshoot at small n
                         "ci95_low": max(t["ci95_low"], -1.0), "ci95_high": min(t["ci95_high"], 1.0), "mcnemar_p": t["mcnemar_p"],
                         "identical_responses": t.get("identical_responses", np.nan),
                         "bits_per_element": s["bits_per_element"], "limit": s["limit"]})
    return pd.DataFrame(rows)


def figure(df: pd.DataFrame) -> Figure:
    from matplotlib import rc_context

    with rc_context(STYLE):
        tasks = list(dict.fromkeys(df["task"]))
        comps = list(dict.fromkeys(df["compressor"]))
        fig = Figure(figsize=(7.0, 2.8), layout="constrained")
        ax = fig.add_subplot()
        width = 0.8 / len(comps)
        x = np.arange(len(tasks))
        for i, c in enumerate(comps):
            d = df[df["compressor"] == c].set_index("task").reindex(tasks)
            err = np.vstack([d["diff"] - d["ci95_low"], d["ci95_high"] - d["diff"]]).clip(min=0)
            bpe = d["bits_per_element"].iloc[0]
            ax.bar(x + (i - (len(comps) - 1) / 2) * width, d["diff"], width, yerr=err, capsize=2,
                   label=f"{c} ({bpe:.2f} bits/value held)")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(x, tasks, rotation=20, ha="right")
        ax.set_ylabel("accuracy change vs 16-bit cache\n(compressed - baseline, 95% CI)")
        n = int(df["limit"].iloc[0]) if pd.notna(df["limit"].iloc[0]) else "all"
        ax.set_title(f"SmolLM2-135M, whole prefix compressed (no 16-bit window), up to {n} examples per task, paired")
        ax.legend(loc="lower left")
        return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-run", action="store_true", help="only tabulate and plot the runs already there")
    args = ap.parse_args()
    results = repo_root() / "results"
    runs = results_root()
    if not args.no_run:
        run_all(runs)
    picked = []
    for label, overrides in cells():
        s = finished_run("eval", compose("eval", overrides, runs))
        if s is None:
            print(f"no eval run for {label}; run without --no-run", file=sys.stderr)
            continue
        picked.append((label, s))
    if not picked:
        return 1
    df = table(picked)
    df.to_csv(results / "accuracy.csv", index=False)
    out = results / "figures"
    out.mkdir(parents=True, exist_ok=True)
    fig = figure(df)
    for ext in ("png", "pdf"):
        fig.savefig(out / f"accuracy.{ext}")
    fmt = lambda a, s: f"{a:.3f} ± {s:.3f}"
    print("| compressor | task | n | baseline | compressed | difference [95% CI] | McNemar p | same responses |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in df.itertuples():
        print(f"| {r.compressor} | {r.task} | {r.n} | {fmt(r.acc_base, r.stderr_base)} | {fmt(r.acc_comp, r.stderr_comp)} | "
              f"{r.diff:+.3f} [{r.ci95_low:+.3f}, {r.ci95_high:+.3f}] | {r.mcnemar_p:.3g} | "
              f"{'' if pd.isna(r.identical_responses) else int(r.identical_responses)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
