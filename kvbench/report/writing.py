"""Writing a report: each section's tables (Markdown, LaTeX, CSV) and figures into a folder
(:func:`write_report`), and a generated block into hand-written Markdown between markers (:func:`put_block`).

A bad or partial run dir (no summary, unreadable JSON, not a kvbench summary, a killed run's staging dir) is
reported and skipped, never fatal; so are figures whose keys no summary carries. A section without runs (a study
section none of whose cells has one) writes nothing, leaving what an earlier report wrote. Reading the runs is
``kvbench.report.collect``, the tables ``kvbench.report.tables``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvbench.report.collect import Collection, collect
from kvbench.report.sections import Table, section, select
from kvbench.report.tables import to_latex, to_markdown
from kvbench.store.atomic import write_with


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
                 sections: Sequence[str] = ("overview",), overrides: Sequence[str] = (),
                 got: Collection | None = None) -> dict:
    """Collect, write each section's tables and figures into ``out``; return what was written and skipped.
    ``overrides``: those the study sections' cells were run with; ``got``: runs already read (``dirs`` unread).
    With no ``formats`` the figures are drawn (to know which have data) but not saved."""
    got = collect(dirs) if got is None else got
    chosen = [section(name) for name in sections]
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    figures, empty, without_runs, markdowns = {}, {}, [], {}

    def text(name: str, body: str) -> None:
        write_with(out / name, lambda p: p.write_text(body))
        written.append(out / name)

    for sec in chosen:
        part = select(got, sec.presets, overrides) if sec.presets else got
        if part.empty:  # keep what an earlier report wrote
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
            "stepcost": len(got.stepcost), "written": written,
            "skipped": got.skipped, "figures": figures, "empty": empty, "without_runs": without_runs,
            "markdown": markdowns}


BLOCK_OPEN = "<!-- {tag}:{key} ({why}) -->"
BLOCK_CLOSE = "<!-- /{tag} -->"


def blocks(text: str, tag: str) -> dict[str, str]:
    """The marked blocks of a Markdown text, by key: what stands between ``<!-- TAG:KEY (...) -->`` and
    ``<!-- /TAG -->``."""
    close = re.escape(BLOCK_CLOSE.format(tag=tag))
    return {m.group(1): m.group(2)
            for m in re.finditer(rf"<!-- {re.escape(tag)}:(\w+) .*?-->\n(.*?)\n?{close}", text, re.S)}


def block(tag: str, key: str, body: str, why: str) -> str:
    """One marked block (see :func:`blocks`)."""
    return f"{BLOCK_OPEN.format(tag=tag, key=key, why=why)}\n{body.rstrip()}\n{BLOCK_CLOSE.format(tag=tag)}"


def replace_block(text: str, key: str, body: str, why: str, tag: str = "generated") -> str:
    """``text`` with ``body`` between its markers for ``key``, the text around them kept; a text without them gets
    the block at its end."""
    new = block(tag, key, body, why)
    pattern = rf"<!-- {re.escape(tag)}:{re.escape(key)} .*?-->\n.*?\n?{re.escape(BLOCK_CLOSE.format(tag=tag))}"
    if re.search(pattern, text, re.S):
        return re.sub(pattern, lambda _: new, text, count=1, flags=re.S)
    return (text.rstrip("\n") + "\n\n" if text else "") + new + "\n"


def put_block(path: Path, key: str, body: str, why: str, tag: str = "generated") -> None:
    """Put ``body`` into the Markdown file ``path`` between its markers for ``key`` (:func:`replace_block`),
    keeping the hand-written text around them."""
    text = replace_block(path.read_text() if path.exists() else "", key, body, why, tag)
    write_with(path, lambda p: p.write_text(text))
