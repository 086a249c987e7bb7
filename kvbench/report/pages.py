"""Evidence-backed pages: committed Markdown rebuilt from committed evidence alone (no model, no runs folder).

``<results>/evidence/pages.json`` registers them, by path under the results root::

    {"frontier.md": {"source": "evidence/pages/frontier.md"},
     "README.md": {"source": "evidence/pages/README.md", "builder": "readme", "study": "reproduce",
                   "report": "report/readme"}}

A page's source is what is written by hand; the build adds only what the evidence says:

- builder ``page`` (the default): the source is the page itself, hand-written Markdown whose figures are references
  (``{{ STUDY: KEY=VALUE ... | FIELD [FORMAT] }}``, :mod:`kvbench.report.refs`) and whose generated blocks
  (``<!-- generated:SECTION (...) -->`` ... ``<!-- /generated -->``, empty in the source) get report section
  SECTION's tables from the evidence of the study of that name; the section's report files (``SECTION.md``,
  ``.tex``, ``.csv``, figures) go to ``report`` (default ``report/``). After the title, a generated ``evidence``
  block names each study the page reads, its runs and the commit they were measured at.
- builder ``readme``: ``results/README.md`` (:func:`kvbench.report.readme.compose`) from the evidence of ``study``;
  the source holds its hand-written findings blocks, with references.

Every figure typed into a source's hand-written text that is not a reference fails the check
(:func:`kvbench.report.refs.literal_figures`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvbench.report import refs
from kvbench.report.evidence import NOT_BACKED, Evidence, evidence_root, load
from kvbench.report.readme import Figures, Provenance, compose
from kvbench.report.writing import BLOCK_CLOSE, block, blocks, replace_block, write_report
from kvbench.store.atomic import write_json, write_with
from kvbench.store.paths import results_root

REGISTRY = "pages.json"
SOURCES = "pages"  # evidence/pages/: the sources (so no study is named "pages")
HEADER = "evidence"  # the generated block after a page's title
README_SECTIONS = ("overview", "frontier", "eviction", "ruler")
BLOCK_WHY = "report section {key} from the evidence of study {study}: rebuilt by python -m kvbench report --pages"
HEADER_WHY = "which evidence this page is rebuilt from"
FINDINGS_WHY = "written by hand in {source}, each figure a reference into the evidence; rendered here"
SOURCE_WHY = "written by hand; figures only as references into the evidence (kvbench.report.refs)"


#: what of a source is checked for figures typed by hand: all of it, or only its findings blocks (a page whose other
#: prose is documentation, such as the repository's README)
LITERALS = ("all", "findings")


@dataclass(frozen=True)
class Page:
    name: str  # the page's path under the results root (``../README.md``: the repository's)
    source: str  # its source's, under the results root
    builder: str = "page"
    study: str | None = None  # the study whose evidence the readme builder, and a page's generated blocks, show
    report: str = "report"  # where its report files go, under the results root
    literals: str = "all"  # a key of LITERALS


def source_name(name: str) -> str:
    """Where a page's source lives under ``evidence/pages/``: its name, with a step out of the results root
    (``../``) as ``_up/``."""
    return "/".join("_up" if part == ".." else part for part in Path(name).parts)


@dataclass
class Built:
    """A page built from evidence: its text (None when it could not be built), the errors, the figures its source
    types by hand (line, word), and the report files written."""

    page: Page
    text: str | None
    errors: list[str] = field(default_factory=list)
    literals: list[tuple[int, str]] = field(default_factory=list)
    report_files: list[Path] = field(default_factory=list)
    studies: dict[str, Evidence] = field(default_factory=dict)


def registry(results: str | os.PathLike | None = None) -> dict[str, Page]:
    """The registered pages, by name."""
    f = evidence_root(results) / REGISTRY
    if not f.exists():
        return {}
    entries = json.loads(f.read_text())
    return {name: Page(name, **entry) for name, entry in entries.items()}


def hand_written(source: str) -> str:
    """A source with its generated blocks emptied: what is written by hand."""
    close = re.escape(BLOCK_CLOSE.format(tag="generated"))
    return re.sub(rf"(<!-- generated:\w+ .*?-->\n).*?\n?({close})", r"\1\2", source, flags=re.S)


def only_blocks(text: str, tag: str) -> str:
    """``text`` with every line outside its ``tag`` blocks' bodies emptied: what those blocks say, each on the line
    of the file it stands on (so that a typed figure is named by the file's line)."""
    close = re.escape(BLOCK_CLOSE.format(tag=tag))
    kept = [m.span(1) for m in re.finditer(rf"<!-- {re.escape(tag)}:\w+ .*?-->\n(.*?)\n?{close}", text, re.S)]
    out, at = [], 0
    for a, b in kept:
        out += ["\n" * text.count("\n", at, a), text[a:b]]
        at = b
    return "".join([*out, "\n" * text.count("\n", at)])


def source_from_page(text: str) -> str:
    """A page's hand-written part as a source: generated blocks emptied, the evidence header and the line saying
    the page is not rebuilt from evidence taken out."""
    text = text.replace(NOT_BACKED + "\n\n", "").replace(NOT_BACKED + "\n", "")
    close = re.escape(BLOCK_CLOSE.format(tag="generated"))
    text = re.sub(rf"<!-- generated:{HEADER} .*?-->\n.*?\n?{close}\n\n?", "", text, flags=re.S)
    return hand_written(text)


def register(name: str, results: str | os.PathLike | None = None, builder: str | None = None,
             study: str | None = None, report: str | None = None, literals: str = "all") -> Page:
    """Register the page ``name`` (under the results root) as evidence-backed; its source, unless there is one,
    is made from the page's hand-written text (for the readme builder, its findings blocks). ``study``: whose
    evidence the readme builder shows, or a page's generated blocks (default: the study named by each block);
    ``literals``: what of the source the check for typed figures reads (:data:`LITERALS`)."""
    root = results_root(results)
    builder = builder or ("readme" if Path(name).name == "README.md" and Path(name).parent == Path() else "page")
    if builder not in ("page", "readme"):
        raise ValueError(f"builder {builder!r}; one of page, readme")
    if builder == "readme" and not study:
        raise ValueError("the readme builder needs the study whose evidence it shows (e.g. reproduce)")
    if literals not in LITERALS:
        raise ValueError(f"literals {literals!r}; one of {', '.join(LITERALS)}")
    page = Page(name, f"{evidence_root(results).relative_to(root).as_posix()}/{SOURCES}/{source_name(name)}", builder,
                study, report or ("report/readme" if builder == "readme" else "report"), literals)
    src = root / page.source
    if not src.exists():
        text = (root / name).read_text() if (root / name).exists() else ""
        if builder == "readme":
            kept = blocks(text, "findings")
            text = "\n\n".join(block("findings", k, v, SOURCE_WHY) for k, v in kept.items()) + "\n"
        else:
            text = source_from_page(text)
        src.parent.mkdir(parents=True, exist_ok=True)
        write_with(src, lambda p: p.write_text(text))
    defaults = asdict(Page("", ""))
    entries = {n: {k: v for k, v in asdict(p).items()
                   if k != "name" and v is not None and not (k in ("literals",) and v == defaults[k])}
               for n, p in {**registry(results), name: page}.items()}
    write_json(evidence_root(results) / REGISTRY, dict(sorted(entries.items())))
    return page


def _rel(path: Path, page: Path) -> str:
    return os.path.relpath(path, page.parent)


def _provenance(e: Evidence, page: Path) -> str:
    where = _rel(e.path, page)
    mixed = " (published with `--allow-mixed`)" if e.commit.startswith("mixed") else ""
    return (f"study `{e.study}`: {e.runs} runs in [`{where}/`]({where}/), measured at commit `{e.commit}`{mixed} up "
            f"to {e.date} on {e.manifest.get('machine', 'an unrecorded machine')}"
            f"{f'; its {e.borrowed}' if e.borrowed else ''}")


def _with_header(text: str, body: str) -> str:
    """``text`` with the evidence header block after its title (or filled where the source places it)."""
    if f"<!-- generated:{HEADER} " in text:
        return replace_block(text, HEADER, body, HEADER_WHY)
    head = block("generated", HEADER, body, HEADER_WHY) + "\n"
    first, nl, rest = text.partition("\n")
    if first.startswith("# "):
        return f"{first}\n\n{head}\n{rest.lstrip(chr(10))}"
    return f"{head}\n{text}"


def build(page: Page, results: str | os.PathLike | None = None, report_out: Path | None = None,
          formats: Sequence[str] = ()) -> Built:
    """Build ``page`` from its source and the evidence; its report files go to ``report_out`` (default: the
    page's report folder) with figures in ``formats`` (none: figures are drawn to know which exist, not saved)."""
    root = results_root(results)
    out = root / page.name
    report_out = report_out or root / page.report
    built = Built(page, None)
    try:
        source = (root / page.source).read_text()
    except OSError as e:
        built.errors.append(f"source {page.source}: {e}")
        return built
    checked = hand_written(source)
    if page.literals == "findings":
        checked = only_blocks(checked, "findings")
    built.literals = refs.literal_figures(checked)

    def evidence(study: str) -> Evidence:
        if study not in built.studies:
            built.studies[study] = load(study, results)
        return built.studies[study]

    try:
        if page.builder == "readme":
            built.text = _readme(page, source, evidence, root, out, report_out, formats, built)
        else:
            built.text = _page(source, evidence, out, report_out, formats, built, page.study)
    except ValueError as e:  # no evidence, mixed code versions
        built.errors.append(str(e))
        built.text = None
    if built.errors:
        built.text = None
    return built


def _page(source: str, evidence, out: Path, report_out: Path, formats: Sequence[str], built: Built,
          study: str | None = None) -> str:
    text, errors = refs.render(source, lambda s: evidence(s).got)
    built.errors += errors
    for key in blocks(source, "generated"):
        if key == HEADER:
            continue
        e = evidence(study or key)
        res = write_report([], report_out, tuple(formats), sections=[key], overrides=e.overrides, got=e.got)
        built.report_files += res["written"]
        if not res["markdown"]:
            built.errors.append(f"generated block {key}: the evidence of study {e.study} has no run of its cells")
            continue
        # a section writes one table group per stem (the overview: runs, best points, evals, ...), in order
        body = res["markdown"].get(key) or "\n".join(res["markdown"].values())
        text = replace_block(text, key, body, BLOCK_WHY.format(key=key, study=e.study))
    studies = "; ".join(_provenance(e, out) for e in built.studies.values())
    header = (f"Rebuilt from committed evidence by `python -m kvbench report --pages` (`--check` rebuilds it and "
              f"compares): {studies}.")
    return _with_header(text, header)


def _readme(page: Page, source: str, evidence, root: Path, out: Path, report_out: Path, formats: Sequence[str],
            built: Built) -> str:
    e = evidence(page.study)
    kept = {}
    for key, body in blocks(source, "findings").items():
        kept[key], errors = refs.render(body, lambda s: evidence(s).got)
        built.errors += [f"findings {key}: {err}" for err in errors]
    res = write_report([], report_out, tuple(formats), sections=README_SECTIONS, overrides=e.overrides, got=e.got)
    built.report_files += res["written"]
    drawn = set(res["figures"])
    mixed = " Its runs are of several code versions, published with `--allow-mixed`." \
        if e.commit.startswith("mixed") else ""
    mixed += f" Of them, {e.borrowed}." if e.borrowed else ""
    note = (f" The runs are committed in `{_rel(e.path, out)}/`: `python -m kvbench report --check` rebuilds this page "
            f"from them and compares.{mixed}")
    prov = Provenance(_rel(e.path, out), e.commit, e.date, str(e.manifest.get("machine", "an unrecorded machine")),
                      e.manifest.get("wall_min"), note)
    figs = Figures(root / page.report, lambda name: name in drawn)
    return compose(e.got, prov, kept, figs, out, e.overrides, FINDINGS_WHY.format(source=page.source))


def write_pages(results: str | os.PathLike | None = None, names: Sequence[str] = (),
                formats: Sequence[str] = ("png", "pdf")) -> list[Built]:
    """Build the registered pages (``names``, default all) from evidence and write those that built."""
    pages = registry(results)
    unknown = [n for n in names if n not in pages]
    if unknown:
        raise ValueError(f"not registered in {evidence_root(results) / REGISTRY}: {', '.join(unknown)}; "
                         f"registered: {', '.join(pages) or 'none'}")
    done = []
    for name in names or list(pages):
        b = build(pages[name], results, formats=formats)
        if b.text is not None:
            text = b.text
            write_with(results_root(results) / name, lambda p, t=text: p.write_text(t))
        done.append(b)
    return done
