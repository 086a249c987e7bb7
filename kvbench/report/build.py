"""``python -m kvbench report DIR... [--sections overview,per_vector,...]``: the run summaries under the dirs as
tables and figures, one set per section (``kvbench.report.sections``).

Writes into ``--out`` (default ``<results>/report``); the overview (the default section):
  runs.csv                      every key of every summary (nested keys flattened with dots), one row per cell
  runs.md, runs.tex             the headline columns (Markdown, and a booktabs LaTeX tabular)
  best_at_1pct_nll.md/.tex      per compressor, the highest compression ratio whose delta_nll is <= 1% of nll_base
  eval.md/.tex                  task accuracy per eval run and task (from eval.json, `python -m kvbench eval`)
  latency.md/.tex               per latency run, context and cache (from latency.json, `python -m kvbench latency`)
  restore.md/.tex               per restore run, context and link bandwidth (from restore.json, `python -m kvbench restore`)
  figures/*.png, figures/*.pdf  see ``kvbench.report.figures``
  skipped.txt                   run dirs that were not read, and why (only when there are any)
and a study section NAME its tables in NAME.md/.tex (NAME.csv: the rows behind them) and its figures in figures/.

A bad or partial run dir (no summary, unreadable JSON, not a kvbench summary, a killed run's staging dir) is
reported and skipped, never fatal; so are figures whose keys no summary carries. A section without runs (a study
section none of whose cells has one) writes nothing, leaving what an earlier report wrote. Reading the runs is ``kvbench.report.collect``, the tables ``kvbench.report.tables``; this module
writes them out, and puts a generated block into hand-written Markdown between markers (:func:`put_block`).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvbench.report.collect import collect
from kvbench.report.sections import SECTIONS, Table, section, select
from kvbench.report.tables import to_latex, to_markdown
from kvbench.store.atomic import write_with
from kvbench.store.paths import results_root


def markdown(tables: Sequence[Table]) -> str:
    """The Markdown of tables that share a file: each under its title when there are several, its note above it."""
    parts = []
    for t in tables:
        head = f"## {t.title[:1].upper()}{t.title[1:]}\n\n" if len(tables) > 1 and t.title else ""
        note = f"{t.note}\n\n" if t.note else ""
        body = t.empty if t.frame.empty and t.empty is not None else to_markdown(t.frame, t.columns)
        parts.append(head + note + body)
    return "\n".join(parts)


def _shown(tables: Iterable[Table]) -> list[Table]:
    return [t for t in tables if not (t.frame.empty and t.empty is None)]


def write_report(dirs: Iterable[str | Path], out: Path, formats: tuple[str, ...] = ("png", "pdf"),
                 sections: Sequence[str] = ("overview",), overrides: Sequence[str] = ()) -> dict:
    """Collect, write each section's tables and figures into ``out``; return what was written and skipped.
    ``overrides``: those the study sections' cells were run with."""
    got = collect(dirs)
    chosen = [section(name) for name in sections]
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    figures, empty, without_runs, markdowns = {}, {}, [], {}

    def text(name: str, body: str) -> None:
        write_with(out / name, lambda p: p.write_text(body))
        written.append(out / name)

    for sec in chosen:
        part = select(got, sec.presets, overrides) if sec.presets else got
        if part.table.empty and part.evals.empty and part.latency.empty and part.restore.empty:  # keep what an earlier report wrote
            without_runs.append(sec.name)
            continue
        tables, figs = sec.build(part)
        stems = dict.fromkeys(t.stem for t in _shown(tables))
        for stem in stems:
            group = [t for t in _shown(tables) if t.stem == stem]
            markdowns[stem] = markdown(group)
            text(f"{stem}.md", markdowns[stem])
            text(f"{stem}.tex", "\n".join(to_latex(t.frame, t.columns, t.title) for t in group))
            for t in group:
                if t.csv and not t.frame.empty:
                    t.frame.to_csv(out / f"{stem}.csv", index=False)
                    written.append(out / f"{stem}.csv")
        for name, (fig, why) in figs.items():
            if fig is None:
                empty[name] = why
                continue
            figures[name] = [out / "figures" / f"{name}.{ext}" for ext in formats]
            for p in figures[name]:
                p.parent.mkdir(parents=True, exist_ok=True)
                fig.savefig(p, dpi=200, bbox_inches="tight")
            written += figures[name]
    if "overview" in sections and "overview" not in without_runs:
        if got.skipped:
            text("skipped.txt", "".join(f"{p}\t{why}\n" for p, why in got.skipped))
        elif (out / "skipped.txt").exists():
            (out / "skipped.txt").unlink()
    return {"rows": len(got.table), "evals": len(got.evals), "latency": len(got.latency), "restore": len(got.restore),
            "written": written,
            "skipped": got.skipped, "figures": figures, "empty": empty, "without_runs": without_runs,
            "markdown": markdowns}


BLOCK_OPEN = "<!-- {tag}:{key} ({why}) -->"
BLOCK_CLOSE = "<!-- /{tag} -->"


def blocks(text: str, tag: str) -> dict[str, str]:
    """The marked blocks of a Markdown text, by key: what stands between ``<!-- TAG:KEY (...) -->`` and
    ``<!-- /TAG -->``."""
    close = re.escape(BLOCK_CLOSE.format(tag=tag))
    return {m.group(1): m.group(2) for m in re.finditer(rf"<!-- {re.escape(tag)}:(\w+) .*?-->\n(.*?)\n{close}", text, re.S)}


def block(tag: str, key: str, body: str, why: str) -> str:
    """One marked block (see :func:`blocks`)."""
    return f"{BLOCK_OPEN.format(tag=tag, key=key, why=why)}\n{body.rstrip()}\n{BLOCK_CLOSE.format(tag=tag)}"


def put_block(path: Path, key: str, body: str, why: str, tag: str = "generated") -> None:
    """Put ``body`` into the Markdown file ``path`` between its markers for ``key``, keeping the hand-written text
    around them; a file without them gets the block at its end."""
    text = path.read_text() if path.exists() else ""
    new = block(tag, key, body, why)
    pattern = rf"<!-- {re.escape(tag)}:{re.escape(key)} .*?-->\n.*?\n{re.escape(BLOCK_CLOSE.format(tag=tag))}"
    if re.search(pattern, text, re.S):
        text = re.sub(pattern, lambda _: new, text, count=1, flags=re.S)
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + new + "\n"
    write_with(path, lambda p: p.write_text(text))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbench report", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="run directories or roots to search for summary.json (e.g. results/runs)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: <results>/report)")
    ap.add_argument("--formats", default="png,pdf", help="figure formats, comma-separated (default: png,pdf)")
    ap.add_argument("--sections", default="overview",
                    help=f"comma-separated, of {', '.join(SECTIONS)} (default: overview)")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="an override the study sections' cells were run with (repeatable), e.g. dataset.seq_len=256")
    args = ap.parse_args(argv)
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
