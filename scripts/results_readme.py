"""Write ``results/README.md`` from the runs: the tables that answer the findings' questions, with the report's figures.

    python scripts/results_readme.py [--runs results/runs] [--report results/report] [--out results/README.md]
                                     [--wall-min MIN] [--commit SHA] [--override KEY=VALUE]... [--check]

Expects ``python -m kvbench report RUNS --out REPORT --sections overview,frontier,eviction,ruler`` to have written the
figures (``scripts/reproduce.sh`` runs both, and passes its wall time). The prose findings are written by hand after
reading the tables, between each section's markers; regenerating keeps them (kvbench.report.readme). ``--check``
only lists the figures a finding quotes that no generated table shows (exit 1 when there are any).
"""

import argparse
import sys
from pathlib import Path

from kvbench.report.readme import quoted_not_generated, render
from kvbench.store.paths import repo_root

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=repo_root() / "results" / "runs")
    ap.add_argument("--report", type=Path, default=repo_root() / "results" / "report")
    ap.add_argument("--out", type=Path, default=repo_root() / "results" / "README.md")
    ap.add_argument("--wall-min", type=float, default=None, help="the wall time of the run that made the runs")
    ap.add_argument("--commit", default=None, help="the commit the runs were made at (default: HEAD)")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="an override the study cells were run with (as for kvbench report)")
    ap.add_argument("--check", action="store_true", help="only check the findings' quoted figures")
    args = ap.parse_args()
    if not args.check:
        args.out.write_text(render(args.runs, args.report.resolve(), args.out.resolve(), args.wall_min,
                                        args.override, args.commit))
        print(f"wrote {args.out}")
    missing = quoted_not_generated(args.out.read_text())
    if missing:
        print(f"{args.out}: findings quote figures no generated table shows: {', '.join(missing)}", file=sys.stderr)
    sys.exit(1 if missing and args.check else 0)
