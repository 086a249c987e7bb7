"""Draft ``results/README.md`` from the runs: the tables that answer the four questions, with the report's figures.

    python scripts/results_readme.py [--runs results/runs] [--report results/report] [--out results/README.md]

Expects ``python -m kvbench report RUNS --out REPORT`` to have written the figures. The prose findings are written by
hand after reading the tables, between each section's markers; regenerating keeps them (kvbench.report_readme).
"""

import argparse
from pathlib import Path

from kvbench.paths import repo_root
from kvbench.report_readme import render

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=repo_root() / "results" / "runs")
    ap.add_argument("--report", type=Path, default=repo_root() / "results" / "report")
    ap.add_argument("--out", type=Path, default=repo_root() / "results" / "README.md")
    args = ap.parse_args()
    args.out.write_text(render(args.runs, args.report.resolve(), args.out.resolve()))
    print(f"wrote {args.out}")
