"""``python -m kvbench report --check``: every committed page is either rebuilt from committed evidence and equal
to what is committed, or says under its title that it is not (and is listed as not checked).

For each page registered in ``results/evidence/pages.json`` (:mod:`kvbench.report.pages`) the page and its report
files (``.md``, ``.tex``, ``.csv``: the tables and the data behind the figures; the figures' images are drawn, not
compared, since their bytes vary with the plotting library) are rebuilt from ``results/evidence/`` alone into a
temporary folder and compared with the committed ones; a difference is shown as a unified diff. A page fails too
when its source types a figure by hand instead of referencing the evidence, when a reference selects no run or
several, and when its evidence mixes code versions without ``--allow-mixed``. It fails as well when the evidence
itself disagrees: a run's delta NLL, interval or verdict (or its recall probe's) that its per-token arrays do not
give back, or a run two studies publish whose copies differ (:mod:`kvbench.report.rederive`). A committed page that
is not registered is not checked; it fails unless it carries :data:`kvbench.report.evidence.NOT_BACKED` under its
title.
"""

from __future__ import annotations

import difflib
import os
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.report.evidence import MANIFEST, NOT_BACKED, evidence_root
from kvbench.report.pages import build, registry
from kvbench.report.rederive import Verified, copies, verify_study
from kvbench.store.paths import repo_root, results_root

COMPARED = (".md", ".tex", ".csv")
MAX_DIFF_LINES = 120
FAILED = ("differs", "figures", "evidence", "error", "unmarked")


@dataclass
class Outcome:
    page: str  # as shown: relative to the working directory when it is under it
    status: str  # ok, not checked, or one of FAILED
    lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what could not be checked, said beside an ok


class EvidenceCheck:
    """Each study's evidence verified once per check (:func:`kvbench.report.rederive.verify_study`, and
    :func:`~kvbench.report.rederive.copies` across all studies), whichever pages read it."""

    def __init__(self, results: str | os.PathLike | None = None) -> None:
        self.root = evidence_root(results)
        self.done: dict[str, Verified] = {}
        self._copies: dict[str, list[str]] | None = None

    def studies(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if (p / MANIFEST).exists()) if self.root.is_dir() else []

    def __call__(self, study: str) -> Verified:
        if study not in self.done:
            if self._copies is None:
                self._copies = copies(self.root, self.studies())
            got = verify_study(self.root / study) if (self.root / study).is_dir() else Verified()
            got.problems += self._copies.get(study, [])
            self.done[study] = got
        return self.done[study]


def committed_pages(results: str | os.PathLike | None = None) -> list[Path]:
    """The pages a reader reads: ``<results>/*.md``, and the repository's README.md when the results root is the
    repository's; in a git checkout, those git tracks (a page being written is not committed yet)."""
    root = results_root(results)
    pages = sorted(root.glob("*.md"))
    if root.resolve() == (repo_root() / "results").resolve():
        pages.insert(0, repo_root() / "README.md")
    top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode == 0:
        top_dir = Path(top.stdout.strip())
        tracked = subprocess.run(["git", "-C", str(top_dir), "ls-files", "-z", "--", "*.md"], capture_output=True,
                                 text=True).stdout
        known = {(top_dir / f).resolve() for f in tracked.split("\0") if f}
        pages = [p for p in pages if p.resolve() in known]
    return [p for p in pages if p.exists()]


def _shown(p: Path) -> str:
    """``p`` relative to the working directory when it is under it."""
    p = Path(os.path.abspath(p))
    return str(p.relative_to(Path.cwd())) if p.is_relative_to(Path.cwd()) else str(p)


def _diff(committed: str | None, rebuilt: str, name: str) -> list[str]:
    if committed is None:
        return [f"{name}: not committed (the rebuild writes it)"]
    lines = list(difflib.unified_diff(committed.splitlines(keepends=True), rebuilt.splitlines(keepends=True),
                                      fromfile=f"{name} (committed)", tofile=f"{name} (rebuilt from evidence)"))
    if len(lines) > MAX_DIFF_LINES:
        lines = [*lines[:MAX_DIFF_LINES], f"... {len(lines) - MAX_DIFF_LINES} more diff lines\n"]
    return [ln.rstrip("\n") for ln in lines]


def _read(p: Path) -> str | None:
    return p.read_text() if p.exists() else None


def check_page(name: str, results: str | os.PathLike | None = None, evidence: EvidenceCheck | None = None) -> Outcome:
    """Rebuild one registered page from evidence into a temporary folder and compare; verify the evidence it
    reads (``evidence``: shared by the pages of one check)."""
    root = results_root(results)
    evidence = evidence or EvidenceCheck(results)
    page = registry(results)[name]
    shown = _shown(root / name)
    with tempfile.TemporaryDirectory(prefix="kvbench-check-") as tmp:
        built = build(page, results, report_out=Path(tmp) / "report", formats=())
        literals = [f"{page.source}:{line}: {figure!r} is typed by hand; quote it through a reference into the "
                    "evidence ({{ STUDY: KEY=VALUE ... | FIELD }})" for line, figure in built.literals]
        if built.errors:
            return Outcome(shown, "error", built.errors + literals)
        lines = [] if _read(root / name) == built.text else _diff(_read(root / name), built.text, shown)
        for f in sorted(built.report_files):
            if f.suffix not in COMPARED:
                continue
            rel = f.relative_to(Path(tmp) / "report")
            committed = root / page.report / rel
            text = f.read_text()
            if _read(committed) != text:
                lines += _diff(_read(committed), text, _shown(committed))
    verified = [evidence(s) for s in built.studies]
    wrong = [p for v in verified for p in v.problems]
    notes = [n for v in verified for n in v.notes]
    if wrong:
        return Outcome(shown, "evidence", wrong + literals + lines, notes)
    if literals or lines:
        return Outcome(shown, "figures" if literals else "differs", literals + lines, notes)
    studies = ", ".join(f"{e.study}: {e.runs} runs at {e.commit}" for e in built.studies.values())
    return Outcome(shown, "ok", [studies], notes)


def check(results: str | os.PathLike | None = None, pages: Sequence[Path] | None = None) -> list[Outcome]:
    """Every committed page's outcome (``pages``: default :func:`committed_pages`)."""
    root = results_root(results)
    registered = registry(results)
    evidence = EvidenceCheck(results)
    out = []
    for name in registered:
        out.append(check_page(name, results, evidence) if (root / name).exists() else
                   Outcome(_shown(root / name), "error", [f"registered in pages.json but not committed: {name}"]))
    for study in evidence.studies():  # evidence no page read (or could read): it must hold together all the same
        if study not in evidence.done and evidence(study).problems:
            out.append(Outcome(_shown(evidence.root / study), "evidence", evidence(study).problems))
    backed = {(root / n).resolve() for n in registered}
    for p in pages if pages is not None else committed_pages(results):
        if p.resolve() in backed:
            continue
        if NOT_BACKED in p.read_text():
            out.append(Outcome(_shown(p), "not checked"))
        else:
            out.append(Outcome(_shown(p), "unmarked", [
                "not rebuilt from committed evidence, and it does not say so: register it with its evidence "
                "(python -m kvbench report --register PAGE) or put this line under its title:", NOT_BACKED]))
    return out


def summary(outcomes: Sequence[Outcome]) -> str:
    """What ``--check`` prints."""
    lines, noted = [], set()
    for o in outcomes:
        if o.status == "not checked":
            continue
        lines.append(f"{o.status.upper() if o.status in FAILED else o.status:<10} {o.page}"
                     + (f"  ({o.lines[0]})" if o.status == "ok" and o.lines and o.lines[0] else ""))
        if o.status in FAILED:
            lines += [f"    {ln}" for ln in o.lines]
        lines += [f"    note: {n}" for n in o.notes if n not in noted]  # a study's, once: under its first page
        noted.update(o.notes)
    unchecked = [o.page for o in outcomes if o.status == "not checked"]
    if unchecked:
        lines.append(f"not checked (no committed evidence; each page says so): {', '.join(unchecked)}")
    failed = sum(o.status in FAILED for o in outcomes)
    rebuilt = sum(o.status not in ("not checked", "unmarked") and o.page.endswith(".md") for o in outcomes)
    lines.append(f"{rebuilt} page(s) rebuilt from evidence; {failed} failed; {len(unchecked)} not checked")
    return "\n".join(lines)
