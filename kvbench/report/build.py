"""``python -m kvbench report``: the run summaries under some dirs as tables and figures, and the published pages
rebuilt from committed evidence.

    python -m kvbench report DIR... [--sections overview,per_vector,...] [--out DIR]
    python -m kvbench report --export-evidence STUDY [RUN_DIR...] [--allow-mixed] [--wall-min MIN]
    python -m kvbench report --register PAGE [--study STUDY]
    python -m kvbench report --pages [PAGE...]
    python -m kvbench report --check

Tables and figures, one set per section (``kvbench.report.sections``), go into ``--out`` (default
``<results>/report``); the overview (the default section):
  runs.csv                      every key of every summary (nested keys flattened with dots), one row per cell
  runs.md, runs.tex             the headline columns (Markdown, and a booktabs LaTeX tabular)
  best_at_1pct_nll.md/.tex      per compressor, the highest compression ratio whose delta_nll is <= 1% of nll_base
  eval.md/.tex                  task accuracy per eval run and task (from eval.json, `python -m kvbench eval`)
  latency.md/.tex               per latency run, context and cache (from latency.json, `python -m kvbench latency`)
  restore.md/.tex               per restore run, context and link bandwidth (from restore.json, `python -m kvbench restore`)
  figures/*.png, figures/*.pdf  see ``kvbench.report.figures``
  skipped.txt                   run dirs that were not read, and why (only when there are any)
(stepcost runs, from ``python -m kvbench stepcost``, are the section ``stepcost``'s; reliability runs, filed by
scripts/reliability.py, the section ``reliability``'s; scale runs, filed by scripts/bench_scale.py, the section
``scale``'s) and a study section NAME its
tables in NAME.md/.tex (NAME.csv: the rows behind them) and its figures in figures/.
Writing them is :mod:`kvbench.report.writing`.

``--export-evidence`` copies a study's runs (the newest of each of its cells under the RUN_DIRs, default
``<results>/runs``) into ``<results>/evidence/<study>/`` (:mod:`kvbench.report.evidence`); ``--register`` makes a
page evidence-backed, ``--pages`` rebuilds those pages from the evidence (:mod:`kvbench.report.pages`) and
``--check`` rebuilds them into a temporary folder and fails on any difference from what is committed
(:mod:`kvbench.report.check`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvbench.report.sections import SECTIONS, section
from kvbench.report.writing import block, blocks, markdown, put_block, replace_block, write_report
from kvbench.store.paths import results_root

# the writer's functions, where scripts and tests have always found them
__all__ = ["block", "blocks", "main", "markdown", "put_block", "replace_block", "write_report"]


def _evidence_command(args: argparse.Namespace) -> int:
    from kvbench.report.check import FAILED, check, summary
    from kvbench.report.evidence import export, study_runs
    from kvbench.report.pages import register, write_pages

    if args.check:
        outcomes = check()
        print(summary(outcomes))
        return 1 if any(o.status in FAILED for o in outcomes) else 0
    if args.export_evidence:
        dirs = args.dirs or [results_root() / "runs"]
        runs = study_runs(args.export_evidence, dirs, args.override)
        if not runs:
            print(f"error: no finished run of study {args.export_evidence} under {' '.join(map(str, dirs))}",
                  file=sys.stderr)
            return 1
        out = export(args.export_evidence, runs, overrides=args.override, allow_mixed=args.allow_mixed,
                     wall_min=args.wall_min)
        print(f"{len(runs)} runs -> {out}")
        return 0
    if args.register:
        page = register(args.register, study=args.study, literals=args.literals)
        print(f"{page.name}: rebuilt from {page.source} ({page.builder}) by python -m kvbench report --pages")
        return 0
    rc = 0
    for b in write_pages(names=args.dirs):
        for err in b.errors:
            print(f"error: {b.page.name}: {err}", file=sys.stderr)
        for line, word in b.literals:
            print(f"error: {b.page.source}:{line}: {word!r} is typed by hand, not a reference", file=sys.stderr)
        rc |= bool(b.errors or b.literals)
        print(f"{b.page.name}: {'written' if b.text is not None else 'not written'}")
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbench report", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="*", help="run directories or roots to search for summary.json (e.g. results/runs); "
                    "with --export-evidence, where the study's runs are; with --pages, which pages")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: <results>/report)")
    ap.add_argument("--formats", default="png,pdf", help="figure formats, comma-separated (default: png,pdf)")
    ap.add_argument("--sections", default="overview",
                    help=f"comma-separated, of {', '.join(SECTIONS)} (default: overview)")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="an override the study sections' cells were run with (repeatable), e.g. dataset.seq_len=256")
    modes = ap.add_mutually_exclusive_group()
    modes.add_argument("--check", action="store_true",
                       help="rebuild every evidence-backed page from results/evidence/ and fail on any difference")
    modes.add_argument("--export-evidence", metavar="STUDY",
                       help="copy the study's runs (summaries, per-token NLLs) into results/evidence/STUDY/")
    modes.add_argument("--register", metavar="PAGE", help="make PAGE (under results/; ../README.md is the repository's) evidence-backed")
    modes.add_argument("--pages", action="store_true", help="rebuild the evidence-backed pages from the evidence")
    ap.add_argument("--allow-mixed", action="store_true",
                    help="with --export-evidence: publish runs of several code versions or a dirty tree (pages say so)")
    ap.add_argument("--wall-min", type=float, default=None, help="with --export-evidence: the measuring run's wall time")
    ap.add_argument("--study", default=None,
                    help="with --register: the study results/README.md shows, or a page's generated blocks show")
    ap.add_argument("--literals", default="all", choices=("all", "findings"),
                    help="with --register: check all of the page's hand-written text for typed figures, or only its "
                         "findings blocks (a page whose other prose is documentation: ../README.md)")
    args = ap.parse_args(argv)
    if args.check or args.export_evidence or args.register or args.pages:
        try:
            return _evidence_command(args)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    if not args.dirs:
        ap.error("give run directories (e.g. results/runs), or one of --check, --export-evidence, --register, --pages")
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    allowed = {"png", "pdf", "svg"}
    if not formats or set(formats) - allowed:
        print(f"error: --formats={args.formats!r}; allowed: {sorted(allowed)}", file=sys.stderr)
        return 2
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if not sections or set(sections) - set(SECTIONS):
        print(f"error: --sections={args.sections!r}; allowed: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    out = args.out or results_root() / "report"
    res = write_report(args.dirs, out, formats, sections, args.override)
    for p, why in res["skipped"]:
        print(f"skipped {p}: {why}", file=sys.stderr)
    print(f"{res['rows']} runs, {res['evals']} eval rows, {res['latency']} latency rows, {res['restore']} restore rows "
          f"-> {out}")
    for name, paths in res["figures"].items():
        print(f"  figure {name}: {', '.join(p.name for p in paths)}")
    for name, why in res["empty"].items():
        print(f"  figure {name}: nothing to plot ({why})")
    for name in (n for n in res["without_runs"] if section(n).presets):
        print(f"  section {name}: no run of its cells (run its driver in scripts/, or pass the --override it ran with)")
    if res["rows"] + res["evals"] + res["latency"] + res["restore"] == 0:
        print("error: no readable run summary under " + " ".join(map(str, args.dirs)), file=sys.stderr)
        return 1
    return 0
