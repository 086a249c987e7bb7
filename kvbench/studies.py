"""A per-part study end to end, for its driver in ``scripts/``: run the cells of its report section's presets that
have no finished run, publish the newest run of each cell as the study's evidence (``<results>/evidence/NAME/``:
:mod:`kvbench.report.evidence`), then write the section into the report (``<results>/report``: tables, and figures
in its ``figures/``) from that evidence and, for a study with a findings file, that page: rebuilt from its source
and the evidence when it is registered as evidence-backed (:mod:`kvbench.report.pages`), else with the section's
table put between its markers.

    python scripts/NAME.py [--no-run] [--force] [--cells] [--no-lock] [--allow-mixed] [--only "OVERRIDE ..."]... [OVERRIDE ...]

The evidence holds runs of one code version of a clean tree: runs of several, or of a dirty tree, are refused
unless ``--allow-mixed`` (the page then says so).

OVERRIDEs (Hydra syntax) apply to every cell and replace a preset's axis of the same key, e.g.
``compressor.bits=3 dataset.seq_len=256``; a preset they do not apply to is left out (``compressor.variant=mse``
leaves out KIVI's); the report then shows the cells as run with them. ``paths.results=DIR`` (or KVBENCH_RESULTS)
puts the runs, the report and the findings file under DIR instead of results/.

``--only`` keeps the cells that carry every override it names (a bare name is a preset's name), so a subset of a
study measures the very cells of the whole study (same cell keys) and its report shows them alone, e.g.
``--only "frontier_kivi model=gemma3_270m compressor.bits=2"``; given more than once, a cell matching any is kept.
"""

from __future__ import annotations

import argparse
import sys

from kvbench.report.evidence import MixedCodeVersions, export, load, study_runs
from kvbench.report.pages import build, registry
from kvbench.report.sections import section
from kvbench.report.writing import write_report
from kvbench.store.atomic import write_with
from kvbench.store.paths import results_root
from kvbench.sweep.presets import Cell, cells, run_in_process, run_isolated

#: what a findings file's generated block says of itself


def matching(todo: list[Cell], patterns: list[str]) -> list[Cell]:
    """The cells that carry every override of one of ``patterns`` (whitespace-separated; a token without ``=`` is a
    preset name); a pattern that matches no cell is an error naming the cells there are."""
    if not patterns:
        return todo
    def wanted(tokens: list[str]) -> list[Cell]:
        return [c for c in todo if all(t in c.overrides if "=" in t else f"+experiment={t}" in c.overrides
                                       for t in tokens)]
    keep: set[int] = set()
    for p in patterns:
        got = wanted(p.split())
        if not got:
            listing = "\n  ".join(" ".join(c.overrides) for c in todo)
            raise SystemExit(f"--only {p!r} matches no cell; the cells are:\n  {listing}")
        keep |= {id(c) for c in got}
    return [c for c in todo if id(c) in keep]


def main(name: str, description: str, argv: list[str] | None = None, runs: str = "", lock: bool = False,
         isolate: bool = False, slow: tuple[str, ...] = (), findings: str | None = None) -> int:
    """The study of report section ``name``. ``runs``: where under the results root its cells' runs go (default: the
    root itself, so results/runs); ``lock``: each measured cell under the benchmark lock; ``isolate``: one process
    per cell; ``slow``: compressor configs to run last (minutes per window); ``findings``: the Markdown file under
    the results root whose marked block gets the section's table."""
    ap = argparse.ArgumentParser(description=description, epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-run", action="store_true", help="only write the report from the runs already there")
    ap.add_argument("--force", action="store_true", help="measure cells again that already have a finished run")
    ap.add_argument("--cells", action="store_true", help="print each cell's command and stop")
    ap.add_argument("--only", action="append", default=[], metavar="OVERRIDES",
                    help="keep the cells that carry every one of these overrides (a bare name: the preset)")
    ap.add_argument("--no-lock", action="store_true",
                    help="measure without the benchmark lock, so that two drivers (one per model) run side by side; "
                         "timed figures then carry the load they ran under, which every run summary records")
    ap.add_argument("--allow-mixed", action="store_true",
                    help="publish runs of several code versions or of a dirty tree as the evidence (the page says so)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every cell")
    args = ap.parse_intermixed_args(argv)  # overrides may stand on either side of the --only options
    # paths.results= moves everything, as KVBENCH_RESULTS does: the runs, the report and the findings file
    given = [o.split("=", 1)[1] for o in args.overrides if o.startswith("paths.results=")]
    overrides = [o for o in args.overrides if not o.startswith("paths.results=")]
    base = results_root(given[-1] if given else None)
    root = base / runs
    todo = cells(section(name).presets, overrides, root,
                 unfit=lambda p, e: print(f"{p.name}: left out ({str(e).splitlines()[0]})", file=sys.stderr))
    if not todo:
        print(f"no cell of {name} takes {' '.join(overrides)}", file=sys.stderr)
        return 2
    todo = matching(todo, args.only)
    if args.cells:
        print("\n".join(c.command for c in todo))
        return 0
    failed = []
    if not args.no_run:
        todo.sort(key=lambda c: any(f"+compressor={s}" in c.overrides for s in slow))  # stable: the rest keep order
        lock = lock and not args.no_lock
        failed = run_isolated(todo, lock) if isolate else run_in_process(todo, args.force, lock)
    page = registry(base).get(findings) if findings else None
    # results/report/ holds only what --pages rebuilds and --check compares (a page's report, written by build):
    # the section's own tables go beside the study's runs, git-ignored
    out = base / "sweeps" / name / "report"
    runs = study_runs(name, [root / "runs"], overrides)
    if not runs:
        print(f"no finished run of any {name} cell under {root / 'runs'}", file=sys.stderr)
        return 1
    try:
        evidence = export(name, runs, base, overrides, args.allow_mixed)
    except MixedCodeVersions as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"evidence: {len(runs)} runs -> {evidence}")
    res = write_report([], out, sections=[name], overrides=overrides, got=load(name, base).got)
    for stem, text in res["markdown"].items():
        print(f"== {out / stem}.md\n{text}")
    for fig, why in res["empty"].items():
        print(f"figure {fig}: nothing to plot ({why})", file=sys.stderr)
    if page is not None:  # evidence-backed: the whole page from its source and the evidence
        built = build(page, base, formats=("png", "pdf"))
        for err in built.errors + [f"{page.source}:{ln}: {w!r} typed by hand, not a reference" for ln, w in built.literals]:
            print(f"error: {err}", file=sys.stderr)
        if built.text is None:
            return 1
        text = built.text
        write_with(base / findings, lambda p: p.write_text(text))
        print(f"-> {base / findings}")
    else:  # a page is published only when rebuilt from committed evidence (report --check compares it)
        print(f"no page is written: a study's page is published once registered with its evidence "
              f"(python -m kvbench report --register PAGE --study {name}); the section's tables are in {out}")
    if failed:
        print(f"{len(failed)} cell(s) failed:\n" + "\n".join(c.command for c in failed), file=sys.stderr)
    return 1 if failed or (page is not None and built.literals) else 0
