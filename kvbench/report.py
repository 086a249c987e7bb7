"""``python -m kvbench report DIR...``: every ``summary.json`` under the dirs as one table, plus paper figures.

Writes into ``--out`` (default ``<results>/report``):
  runs.csv                      every key of every summary (nested keys flattened with dots), one row per cell
  runs.md, runs.tex             the headline columns (Markdown, and a booktabs LaTeX tabular)
  best_at_1pct_nll.md/.tex      per compressor, the highest compression ratio whose delta_nll is <= 1% of nll_base
  eval.md/.tex                  task accuracy per eval run and task (from eval.json, `python -m kvbench eval`)
  latency.md/.tex               per latency run, context and cache (from latency.json, `python -m kvbench latency`)
  figures/*.png, figures/*.pdf  see ``kvbench.figures``
  skipped.txt                   run dirs that were not read, and why (only when there are any)

A bad or partial run dir (no summary, unreadable JSON, not a kvbench summary, a killed run's staging dir) is
reported and skipped, never fatal; so are figures whose keys no summary carries. Reading the runs is
``kvbench.report_data``, the tables ``kvbench.report_tables``; this module writes them out.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from kvbench.atomic import write_with
from kvbench.figures import FIGURES
from kvbench.paths import results_root
from kvbench.report_data import best_at_tolerance, collect
from kvbench.report_tables import BEST_COLUMNS, COLUMNS, EVAL_COLUMNS, LATENCY_COLUMNS, to_latex, to_markdown


def write_report(dirs: Iterable[str | Path], out: Path, formats: tuple[str, ...] = ("png", "pdf")) -> dict:
    """Collect, write tables and figures into ``out``; return what was written and skipped."""
    got = collect(dirs)
    df = got.table
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def text(name: str, body: str) -> None:
        write_with(out / name, lambda p: p.write_text(body))
        written.append(out / name)

    def md_and_tex(stem: str, table: pd.DataFrame, columns, caption: str, empty_md: str | None = None) -> None:
        """``stem``.md and ``stem``.tex from the same columns."""
        text(f"{stem}.md", empty_md if empty_md is not None and table.empty else to_markdown(table, columns))
        text(f"{stem}.tex", to_latex(table, columns, caption))

    if not df.empty:
        df.to_csv(out / "runs.csv", index=False)
        written.append(out / "runs.csv")
    md_and_tex("runs", df, COLUMNS, f"{len(df)} runs")
    md_and_tex("best_at_1pct_nll", best_at_tolerance(df), BEST_COLUMNS, "highest ratio at <= 1% NLL regression",
           empty_md="_no run has both delta_nll and nll_base_\n")
    for name, table, columns in (("eval", got.evals, EVAL_COLUMNS), ("latency", got.latency, LATENCY_COLUMNS)):
        if not table.empty:
            md_and_tex(name, table, columns, f"{name}: {table['run_id'].nunique()} runs")
    if got.skipped:
        text("skipped.txt", "".join(f"{p}\t{why}\n" for p, why in got.skipped))
    elif (out / "skipped.txt").exists():
        (out / "skipped.txt").unlink()

    figures, empty = {}, {}
    fig_dir = out / "figures"
    tables = {"runs": df, "evals": got.evals, "latency": got.latency}
    for name, (table, make) in FIGURES.items():
        fig, why = make(tables[table])
        if fig is None:
            empty[name] = why
            continue
        fig_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for ext in formats:
            p = fig_dir / f"{name}.{ext}"
            fig.savefig(p, dpi=200, bbox_inches="tight")
            paths.append(p)
        figures[name] = paths
        written += paths
    return {"rows": len(df), "evals": len(got.evals), "latency": len(got.latency), "written": written,
            "skipped": got.skipped, "figures": figures, "empty": empty}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbench report", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="run directories or roots to search for summary.json (e.g. results/runs)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: <results>/report)")
    ap.add_argument("--formats", default="png,pdf", help="figure formats, comma-separated (default: png,pdf)")
    args = ap.parse_args(argv)
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    allowed = {"png", "pdf", "svg"}
    if not formats or set(formats) - allowed:
        print(f"error: --formats={args.formats!r}; allowed: {sorted(allowed)}", file=sys.stderr)
        return 2
    out = args.out or results_root() / "report"
    res = write_report(args.dirs, out, formats)
    for p, why in res["skipped"]:
        print(f"skipped {p}: {why}", file=sys.stderr)
    print(f"{res['rows']} runs, {res['evals']} eval rows, {res['latency']} latency rows -> {out}")
    for name, paths in res["figures"].items():
        print(f"  figure {name}: {', '.join(p.name for p in paths)}")
    for name, why in res["empty"].items():
        print(f"  figure {name}: nothing to plot ({why})")
    if res["rows"] + res["evals"] + res["latency"] == 0:
        print("error: no readable run summary under " + " ".join(map(str, args.dirs)), file=sys.stderr)
        return 1
    return 0
