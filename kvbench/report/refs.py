"""Figures bound to data: the references a hand-written page quotes its numbers through, and the check that it
quotes none any other way.

A reference names a study's committed evidence (``results/evidence/<study>/``), selects exactly one run by its
summary or config fields, and names a field and, optionally, a format::

    {{ frontier: model=smollm2_135m compressor=kvtc compressor.window=0 compressor.bits=2 | delta_nll_ci }}
    {{ frontier: model=smollm2_135m compressor=kvtc compressor.bits=2 | stream_bits_per_element .3f }}
    {{ reproduce/latency: model=smollm2_135m context=1024 cache=compressed | tokens_per_s }}
    {{ frontier: model=gemma3_270m * | nll_base .4f }}

``STUDY/TABLE`` reads one of the report's tables of the study's runs: ``runs`` (the default; one row per run),
``evals`` (per eval run and task), ``latency`` (per latency run, context and cache), ``restore`` (per restore run,
context and link bandwidth), ``stepcost`` (per stepcost run and stage), ``reliability`` (per compressor's fuzz
run and mutation), ``scale`` (per scale run, step and compressor) or ``capacity`` (per capacity run, coder and
context, and the published figures it quotes). A selector ``KEY=VALUE`` (quoted with ``"..."`` when it holds
spaces) matches a column of that table: the summary's key (nested keys joined with dots), else the run config's
(``cfg.KEY``), else, for ``compressor.X``, the compressor's full hyperparameters (``compressor_params.X``); numbers
compare as numbers. A
reference that selects no row, or several, is an error that names them; ``*`` accepts several rows that agree on the
field (a setting or a baseline every selected run shares). The field is a column of the same table, derived ones
included (``delta_nll_ci_text``, ``nll_verdict``, ``x_bound``); the format is a ``format()`` spec or one of the
report tables' (``x``: a ratio spanning decades, ``d``, ``s``), by default the format the report's tables show that
column in. A two-number interval (``delta_nll_ci``) is written ``[low, high]``, each end in the format
(default ``+.4f``).

Every other figure typed into hand-written text is an error (:func:`literal_figures`), except the few that are not
data (:data:`ALLOWED`): a tolerance or confidence level, a year, a bit width, an ordinal, a paper's arXiv id, a list
item's or heading's number, and a ``KEY=VALUE`` override inside a code span. Digits inside a name (SmolLM2-135M,
gemma3_270m, fp8) are not figures.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from kvbench.report.collect import FRAMES, Collection, plain
from kvbench.report.tables import CATALOGUE, format_value

REFERENCE = re.compile(r"\{\{(.*?)\}\}", re.S)
_FENCE_OR_CODE = re.compile(r"^```.*?^```|`[^`\n]+`", re.S | re.M)
#: a reference's table name -> the Collection frame it reads: ``runs`` for compression cells, else the frame's own name
TABLES = {("runs" if kind == "run" else frame): frame for kind, frame in FRAMES.items()}
INTERVAL_FORMAT = "+.4f"


class ReferenceError(ValueError):
    """A reference that does not parse, or does not select exactly one row, or names a field its row lacks."""


@dataclass(frozen=True)
class Reference:
    study: str
    table: str  # a key of TABLES
    selectors: tuple[tuple[str, str], ...]
    many: bool  # ``*``: several rows may match if they agree on the field
    field: str
    fmt: str | None
    text: str  # as written, for messages

    @classmethod
    def parse(cls, text: str) -> Reference:
        inner = text.strip()
        head, sep, tail = inner.partition("|")
        where, colon, selectors = head.partition(":")
        if not sep or not colon:
            raise ReferenceError(f"{{{{{inner}}}}}: a reference is {{{{ STUDY[/TABLE]: KEY=VALUE ... | FIELD [FORMAT] }}}}")
        study, _, table = where.strip().partition("/")
        table = table or "runs"
        if not re.fullmatch(r"[\w-]+", study):
            raise ReferenceError(f"{{{{{inner}}}}}: study {study!r} is not a name of results/evidence/<study>/")
        if table not in TABLES:
            raise ReferenceError(f"{{{{{inner}}}}}: table {table!r}; one of {', '.join(TABLES)}")
        try:
            tokens = shlex.split(selectors)
        except ValueError as e:
            raise ReferenceError(f"{{{{{inner}}}}}: {e}") from e
        many = "*" in tokens
        pairs = []
        for t in (t for t in tokens if t != "*"):
            key, eq, value = t.partition("=")
            if not eq or not key:
                raise ReferenceError(f"{{{{{inner}}}}}: selector {t!r} is not KEY=VALUE")
            pairs.append((key, value))
        field_fmt = tail.split()
        if not 1 <= len(field_fmt) <= 2:
            raise ReferenceError(f"{{{{{inner}}}}}: after '|' comes one field and at most one format")
        return cls(study.strip(), table, tuple(pairs), many, field_fmt[0], field_fmt[1] if len(field_fmt) > 1 else None,
                   inner)


def _column(df: pd.DataFrame, key: str) -> str | None:
    """The column ``key`` names: itself, the config's (``cfg.KEY``), or a compressor hyperparameter."""
    for c in (key, f"cfg.{key}", f"compressor_params.{key.removeprefix('compressor.')}"
              if key.startswith("compressor.") else None):
        if c is not None and c in df.columns:
            return c
    return None


def _number(v) -> float | None:
    if isinstance(v, bool):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _matches(v, text: str) -> bool:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return text.lower() in ("none", "null", "nan")
    a, b = _number(v), _number(text)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(v, bool) or str(v) in ("True", "False"):
        return str(v).lower() == text.lower()
    return plain(v) == text


def _name(row: pd.Series) -> str:
    run = row.get("run_id", "?")
    extra = [f"{k}={plain(row[k])}" for k in ("task", "context", "cache", "bandwidth_gbps") if k in row and pd.notna(row[k])]
    return " ".join([str(run), *extra])


def select_one(ref: Reference, df: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``df`` the reference selects: one, or several that ``*`` accepts; else :class:`ReferenceError`."""
    rows = df
    for key, value in ref.selectors:
        col = _column(df, key)
        if col is None:
            near = difflib.get_close_matches(key, [str(c) for c in df.columns], n=3)
            raise ReferenceError(f"{{{{{ref.text}}}}}: no field {key!r} in {ref.study}/{ref.table}"
                                 + (f" (near: {', '.join(near)})" if near else ""))
        kept = rows[[_matches(v, value) for v in rows[col]]]
        if kept.empty:
            values = sorted({plain(v) for v in rows[col] if not (isinstance(v, float) and math.isnan(v))}, key=str)
            raise ReferenceError(f"{{{{{ref.text}}}}}: selects no row of {ref.study}/{ref.table}: {key}={value} leaves "
                                 f"none of the {len(rows)} rows selected so far (their {key}: {', '.join(values) or '-'})")
        rows = kept
    if len(rows) > 1 and not ref.many:
        listing = "; ".join(_name(r) for _, r in rows.head(12).iterrows())
        raise ReferenceError(f"{{{{{ref.text}}}}}: selects {len(rows)} rows of {ref.study}/{ref.table}, not one: "
                             f"{listing}{' ...' if len(rows) > 12 else ''}")
    return rows


def _interval(v) -> tuple[float, float] | None:
    if isinstance(v, str) and v.startswith("["):
        try:
            low, high = json.loads(v)
            return float(low), float(high)
        except (TypeError, ValueError):
            return None
    return None


def format_field(v, fmt: str | None, field: str) -> str:
    """One value as a page shows it (see the module docstring for the formats)."""
    interval = _interval(v)
    if interval is not None:
        spec = fmt or INTERVAL_FORMAT
        return f"[{format_value(interval[0], spec)}, {format_value(interval[1], spec)}]"
    spec = fmt or (CATALOGUE[field].fmt if field in CATALOGUE else None)
    if spec is None:
        if isinstance(v, float) and not v.is_integer():
            spec = ".4g"
        elif _number(v) is not None and not isinstance(v, str):
            return f"{int(float(v)):,}"
        else:
            spec = "s"
    try:
        return format_value(v, spec)
    except (TypeError, ValueError) as e:
        raise ReferenceError(f"format {spec!r} does not apply to {field}={v!r} ({e})") from e


def resolve(ref: Reference, got: Collection) -> str:
    """The reference's value in ``got`` (a study's evidence), formatted."""
    df = getattr(got, TABLES[ref.table])
    if df.empty:
        raise ReferenceError(f"{{{{{ref.text}}}}}: {ref.study} has no {ref.table} rows")
    rows = select_one(ref, df)
    col = _column(df, ref.field)
    if col is None:
        near = difflib.get_close_matches(ref.field, [str(c) for c in df.columns], n=3)
        raise ReferenceError(f"{{{{{ref.text}}}}}: no field {ref.field!r} in {ref.study}/{ref.table}"
                             + (f" (near: {', '.join(near)})" if near else ""))
    shown = {}
    for _, r in rows.iterrows():
        v = r[col]
        if v is None or (isinstance(v, float) and math.isnan(v)):
            raise ReferenceError(f"{{{{{ref.text}}}}}: {_name(r)} has no {ref.field}")
        try:
            shown.setdefault(format_field(v, ref.fmt, ref.field), []).append(_name(r))
        except ReferenceError as e:
            raise ReferenceError(f"{{{{{ref.text}}}}}: {e}") from e
    if len(shown) > 1:
        listing = "; ".join(f"{v} ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''})" for v, names in shown.items())
        raise ReferenceError(f"{{{{{ref.text}}}}}: the {len(rows)} rows selected differ in {ref.field}: {listing}")
    return next(iter(shown))


def render(text: str, evidence: Callable[[str], Collection]) -> tuple[str, list[str]]:
    """``text`` with every reference replaced by its value, and the errors (one per reference that failed, which is
    left as written). ``evidence(study)`` gives a study's runs, or raises ValueError when it has none. A reference
    inside a code span or fence is an example of the syntax, shown as written."""
    errors: list[str] = []
    code = [(c.start(), c.end()) for c in _FENCE_OR_CODE.finditer(text)]

    def one(m: re.Match) -> str:
        if any(a <= m.start() < b for a, b in code):
            return m.group(0)
        try:
            ref = Reference.parse(m.group(1))
            return resolve(ref, evidence(ref.study))
        except ValueError as e:
            errors.append(f"line {text.count(chr(10), 0, m.start()) + 1}: {e}")
            return m.group(0)

    return REFERENCE.sub(one, text), errors


# ---- literal figures --------------------------------------------------------------------------------------------
#: what a figure typed by hand may be, because it is not data; each with why
ALLOWED = (
    (r"(?<![\d.,])(?:1|5|95|99|100)%", "a tolerance or confidence level"),
    (r"(?<![\w.])(?<!\d,)(?:199\d|20[0-3]\d)(?![\w.]|,\d)", "a year"),
    (r"(?<![\w.])(?<!\d,)\d+-bit\b", "a number format's width"),
    (r"(?<![\w.])(?<!\d,)\d+(?:st|nd|rd|th)\b", "an ordinal"),
    (r"\barXiv[: ]\s*\d{4}\.\d{4,5}(?:v\d+)?", "a paper's arXiv id"),
    (r"(?m)^[ \t]*(?:#+[ \t]*|[-*][ \t]+)?\d+\.(?=[ \t])", "a list item's or heading's number"),
)
_ALLOWED = [re.compile(p) for p, _ in ALLOWED]
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_LINK = re.compile(r"\]\([^)\s]*\)")
_CODE = re.compile(r"`[^`\n]+`")
_OVERRIDE = re.compile(r"[\w.+~/\-]+=\S+")
_LEAD, _TRAIL = "([{\"'*_~<>|`", ")]}\"'*_~,;:!?.>|`"


def _blank(text: str, pattern: re.Pattern, inside: Callable[[str], str] | None = None) -> str:
    """``text`` with each match of ``pattern`` replaced by spaces (newlines kept), or by ``inside(match)``."""
    def sub(m: re.Match) -> str:
        s = m.group(0)
        return inside(s) if inside else re.sub(r"[^\n]", " ", s)
    return pattern.sub(sub, text)


def _figures(word: str) -> list[str]:
    """The figures in a whitespace-separated word of prose: its parts that hold a digit and are not names."""
    found = []
    for part in re.split(r"[/–—]", word):
        part = part.lstrip(_LEAD).rstrip(_TRAIL)
        if "=" in part:
            part = part.rsplit("=", 1)[1].lstrip(_LEAD)
        if not any(ch.isdigit() for ch in part):
            continue
        if part[0].isalpha() or part[0] in "_\\":
            continue  # a name with digits in it: SmolLM2-135M, gemma3_270m, fp8, log2
        found.append(part)
    return found


def literal_figures(text: str) -> list[tuple[int, str]]:
    """Each figure typed into hand-written Markdown that is not a reference: (line, figure). References, HTML comments
    (the block markers among them), link targets and :data:`ALLOWED` figures are not."""
    t = _blank(text, REFERENCE)
    t = _blank(t, _COMMENT)
    t = _blank(t, _LINK)
    t = _blank(t, _CODE, inside=lambda s: _blank(s, _OVERRIDE))
    for p in _ALLOWED:
        t = _blank(t, p)
    found = []
    for i, line in enumerate(t.split("\n"), start=1):
        found += [(i, f) for w in line.split() for f in _figures(w)]
    return found
