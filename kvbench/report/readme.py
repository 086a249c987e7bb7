"""``results/README.md`` from the runs of ``scripts/reproduce.sh``: the tables that answer the findings' questions, with
the report's figures, around hand-written findings that regenerating keeps (one marked block per section).

Every number comes from the summaries under the runs dir (``kvbench.report.collect``), through the same report
sections as the per-part studies (frontier, eviction, RULER); the figures are the report's (``python -m kvbench
report RUNS --out REPORT --sections overview,frontier,eviction,ruler`` writes them first). ``quoted_not_generated``
lists the figures a hand-written finding quotes that no generated table shows.

:func:`render` reads a runs folder and keeps the findings of the file it overwrites (the page then says it is not
rebuilt from committed evidence); :func:`compose` is the page itself, which :mod:`kvbench.report.pages` builds from
the study's committed evidence and the findings' source, each figure in them a reference into that evidence.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from kvbench.report.collect import Collection, collect, numeric, plain, series_label
from kvbench.report.evidence import NOT_BACKED, machine
from kvbench.report.sections import Table, section, select
from kvbench.report.sections.decode_section import MEMORY_COLUMNS, memory_speed_table
from kvbench.report.tables import format_ratio, pick, to_markdown
from kvbench.report.writing import block, blocks, markdown
from kvbench.store.paths import repo_root

FINDINGS_WHY = "written by hand; kept when this file is regenerated"
FINDINGS_TODO = "_Findings: to be written from the tables and figures above._"
# The paper's per-vector arithmetic (arXiv 2604.15356) for a 70B-class config: 3 bits x 128 dims x 2 (K, V) x 64 heads
# x 80 layers per token, against its bound of log2(20) = 4.3 bits/token.
PAPER_PER_VECTOR_BITS = 3 * 128 * 2 * 64 * 80
PAPER_BOUND_BITS = 4.3
PAPER_FACTOR = PAPER_PER_VECTOR_BITS / PAPER_BOUND_BITS

SHARING_COLUMNS = pick("model", "compressor", "sharing.share_rate", "sharing.dedup_ratio", "compression_ratio",
                       "bits_per_token")
RESTORE_COLUMNS = pick("model", "compressor", "params", "context", "bytes_ratio", "encode_s", "decode_s",
                       "first_token_s", "prefill_s", "crossover_16bit_gbps", "crossover_16bit_spread",
                       "crossover_prefill_gbps", "crossover_prefill_spread", "first_token_matches_prefill",
                       formats={"crossover_16bit_gbps": ".2f", "crossover_prefill_gbps": ".4f"})
DISTANCE_COLUMNS = pick("model", "which", "compressor", "windows_text", "bits_per_token", "bound_bits_per_token",
                        "x_bound_text", "delta_nll_ci_text", "nll_verdict", "eval_documents_n", formats={"bits_per_token": ",.1f"})
PAPER_ARITHMETIC_COLUMNS = pick("model", "elements_per_token", "bound_bits_per_token", "paper_x_bound_text",
                                formats={"elements_per_token": ",.0f"})
RULER_POOLED_COLUMNS = pick("model", "compressor", "compressor_params.bits", "compressor_params.keep", "bits_per_element", "n", "acc_base", "acc_comp", "diff",
                            "diff_ci_text", "p_value", "detectable_diff", formats={"bits_per_element": ".2f"})


def _sha() -> str:
    out = subprocess.run(["git", "-C", str(repo_root()), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


@dataclass(frozen=True)
class Provenance:
    """What the README's header says of its runs."""

    runs: str  # where they are, as the header names them
    commit: str  # the code version they were measured at
    date: str
    machine: str
    wall_min: float | None = None
    note: str = ""  # a sentence after the header's first: how the page is rebuilt, what it mixes


@dataclass(frozen=True)
class Figures:
    """Where the report's figures are (``report/figures/NAME.png``) and which of them exist."""

    report: Path
    exists: Callable[[str], bool]


def _figure(figs: Figures, out: Path, name: str, caption: str) -> str:
    if not figs.exists(name):
        return f"_(no {name} figure: no run carries what it plots)_\n"
    png = figs.report / "figures" / f"{name}.png"
    return f"![{caption}]({os.path.relpath(png, out.parent)})\n\n_{caption}_ (PDF beside it)\n"


def _figures(figs: Figures, out: Path, stem: str, models: list[str], caption: str) -> list[str]:
    return [_figure(figs, out, f"{stem}_{m}", f"{caption}, {m}") for m in models]


def _section_tables(got: Collection, name: str, overrides: Sequence[str] = ()) -> list[Table]:
    sec = section(name)
    tables, _ = sec.build(select(got, sec.presets, overrides))
    return tables


def _table(tables: list[Table], title: str) -> str:
    """One of a section's tables by title, with its note, as Markdown."""
    for t in tables:
        if t.title == title:
            return markdown([t]) + "\n"
    return f"_(no runs for the table {title!r})_\n"


def stores_tokens(df: pd.DataFrame) -> pd.Series:
    """Runs whose bitstream carries token ids (recompute, speculative): they decode by running the model."""
    parts = [c for c in df.columns if c.startswith("bits_by_part.") and "token" in c.removeprefix("bits_by_part.")]
    return (df[parts].fillna(0).apply(pd.to_numeric, errors="coerce") > 0).any(axis=1) if parts \
        else pd.Series(False, index=df.index)


def _lossless(df: pd.DataFrame) -> pd.Series:
    return df["lossless"].astype(str) == "True" if "lossless" in df else pd.Series(False, index=df.index)


def short_label(d: pd.DataFrame) -> pd.Series:
    """A row's coder and the settings that place it: ``kvtc bits=2 window=0``, ``snapkv keep=0.5 + turboquant 3-bit``."""
    def one(r: pd.Series) -> str:
        parts = [str(r["compressor"])]
        for k in ("bits", "keep", "window", "entropy_coding", "predictor", "step"):
            v = r.get(f"compressor_params.{k}")
            if v is not None and not (isinstance(v, float) and pd.isna(v)) and not (k == "entropy_coding" and not v):
                parts.append(f"{k}={plain(v)}")
        inner = r.get("compressor_params.inner.name")
        if isinstance(inner, str):
            parts.append(f"+ {inner} {plain(r.get('compressor_params.inner.bits'))}-bit")
        return " ".join(parts)
    return d.apply(one, axis=1) if not d.empty else pd.Series(dtype=str)


def distance_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per model, the fewest bits per token measured relative to the bound of the windows each run was measured on:
    among coders that decode without running the model, and among those that run it (token ids in the stream); a run
    counts when it is lossless or its delta-NLL interval lies within 1% of the base NLL."""
    if df.empty or "bound_bits_per_token" not in df:
        return pd.DataFrame()
    d = df.assign(compressor=short_label(df), x_bound=numeric(df, "x_bound"), runs_model=stores_tokens(df))
    verdict = d["nll_verdict"].astype(str) if "nll_verdict" in d else pd.Series("", index=d.index)
    ok = d[(_lossless(d) | (verdict == "within")) & d["x_bound"].notna()]
    picks = []
    for which, sub in (("decodes without the model", ok[~ok["runs_model"]]), ("runs the model to decode",
                                                                               ok[ok["runs_model"]])):
        if not sub.empty:
            picks.append(sub.loc[sub.groupby("model")["x_bound"].idxmin()].assign(which=which))
    if not picks:
        return pd.DataFrame()
    best = pd.concat(picks).sort_values(["model", "which"], ascending=[True, True])
    best["windows_text"] = [f"{int(n)} x {int(t) // int(n)}" for n, t in zip(numeric(best, "n_sequences"),
                                                                          numeric(best, "n_tokens"))]
    best["x_bound_text"] = best["x_bound"].map(lambda x: f"{format_ratio(x)}x")
    best["nll_verdict"] = best["nll_verdict"].where(~_lossless(best), "exact")
    return best


def paper_arithmetic(df: pd.DataFrame) -> pd.DataFrame:
    """Per model, the paper's own arithmetic (3 bits per K and V element over the bound) on the measured bound of the
    default windows (the most windows of any run)."""
    need = {"n_elements", "n_tokens", "bound_bits_per_token", "n_sequences"}
    if df.empty or not need <= set(df.columns):
        return pd.DataFrame()
    d = df[numeric(df, "bound_bits_per_token").notna()]
    d = d[numeric(d, "n_sequences") == numeric(d, "n_sequences").groupby(d["model"]).transform("max")]
    rows = d.drop_duplicates("model").copy()
    rows["elements_per_token"] = numeric(rows, "n_elements") / numeric(rows, "n_tokens")
    x = 3 * rows["elements_per_token"] / numeric(rows, "bound_bits_per_token")
    rows["paper_x_bound_text"] = x.map(lambda v: f"{format_ratio(v)}x")
    return rows


def sharing_table(df: pd.DataFrame) -> pd.DataFrame:
    if "sharing.share_rate" not in df:
        return pd.DataFrame()
    d = df[numeric(df, "sharing.share_rate").notna()].copy()
    d["compressor"] = series_label(d, exclude=())
    return d.sort_values(["model", "compressor", "sharing.share_rate"])


def restore_table(rs: pd.DataFrame) -> pd.DataFrame:
    """Per restore run and context (the bandwidth rows collapsed): stored bytes against 16-bit KV, the measured
    times and the two crossover bandwidths."""
    if rs.empty or not {"run_id", "context"} <= set(rs.columns):
        return pd.DataFrame()
    d = rs.drop_duplicates(["run_id", "context"]).copy()
    d["bytes_ratio"] = numeric(d, "bytes_16bit") / numeric(d, "bytes")
    d["params"] = short_label(d).str.replace(r"^\S+\s*", "", regex=True)
    for key, fmt in (("crossover_16bit", ".2f"), ("crossover_prefill", ".4f")):
        lo, hi = numeric(d, f"{key}_gbps_lo"), numeric(d, f"{key}_gbps_hi")
        d[f"{key}_spread"] = [f"{a:{fmt}}–{b:{fmt}}" if a == a and b == b else "-" for a, b in zip(lo, hi)]
    return d.sort_values(["model", "compressor", "context"])


RULER_TASKS_TITLE = "accuracy with the compressed cache, per task and pooled"


def ruler_pooled(ruler: list[Table]) -> pd.DataFrame:
    """The pooled rows of the RULER section's per-task table."""
    d = next((t.frame for t in ruler if t.title == RULER_TASKS_TITLE), pd.DataFrame())
    return d[d["family"] == "pooled"] if not d.empty else d


def _run_count(got: Collection) -> int:
    return len(got.table) + sum(f["run_id"].nunique() for kind, f in got.frames().items()
                                if kind != "run" and "run_id" in f)


def render(runs: Path, report: Path, out: Path, wall_min: float | None = None, overrides: Sequence[str] = (),
           commit: str | None = None) -> str:
    """The README's text from a runs folder, keeping ``out``'s hand-written findings; ``overrides``: those the study
    cells were run with (as ``kvbench report --override``); ``commit``: the one the runs were made at (default: the
    checkout's)."""
    kept = blocks(out.read_text(), "findings") if out.exists() else {}
    prov = Provenance(str(runs), commit or _sha(), time.strftime("%Y-%m-%d"), machine(), wall_min)
    figs = Figures(report, lambda name: (report / "figures" / f"{name}.png").exists())
    return compose(collect([runs]), prov, kept, figs, out, overrides, backed=False)


def compose(got: Collection, prov: Provenance, kept: dict[str, str], figs: Figures, out: Path,
            overrides: Sequence[str] = (), why: str = FINDINGS_WHY, backed: bool = True) -> str:
    """The README's text for the runs ``got``, with the findings ``kept`` (by section key) in their blocks, for the
    file ``out`` (figure links are relative to it); ``backed``: built from committed evidence (else the page says it
    is not)."""
    def findings(key: str) -> str:
        return block("findings", key, kept.get(key, FINDINGS_TODO), why) + "\n"

    everything = got.table
    single = everything["workload"].isna() | (everything["workload"].astype(str) == "none") \
        if "workload" in everything else pd.Series(True, index=everything.index)
    df = everything[single]
    models = list(dict.fromkeys(df["model"].astype(str))) if "model" in df else []
    frontier, eviction, ruler = (_section_tables(got, n, overrides) for n in ("frontier", "eviction", "ruler"))
    wall = f" in {prov.wall_min:.0f} min of wall time" if prov.wall_min is not None else ""
    others = sorted(p for p in out.parent.glob("*.md") if p.name != out.name)
    report = figs.report
    s = [
        "# kvbench: measured findings\n",
        *([] if backed else [NOT_BACKED + "\n"]),
        f"Regenerated by `scripts/reproduce.sh`{wall} on {prov.date} at commit `{prov.commit}`, on "
        f"{prov.machine}. {_run_count(got)} runs under `{prov.runs}`; every number below is read from their summaries "
        f"(all runs: `{os.path.relpath(report, out.parent)}/runs.md`, `.csv`, `.tex`).{prov.note} Timed cells ran one torch thread each, "
        "under the benchmark lock, beside one single-thread accuracy job on the other core. Quality is the held-out "
        "NLL change with its paired 95% interval (block bootstrap over windows x token blocks); \"within 1%\" means "
        "the whole interval lies at or below 1% of the base NLL, \"unresolved\" that it straddles that line.\n",
        "## The answers\n",
        findings("answers"),
        "## 1. Which coder family wins at <= 1% NLL, and does any reach about 1 bit per element?\n",
        "Each coder's fewest stream bits per element whose interval lies within 1% (the per-part study with more "
        "rates per coder: `results/frontier.md`):\n",
        _table(frontier, "fewest stream bits per element within 1% NLL, per coder and model"),
        "Every cell:\n",
        _table(frontier, "every cell"),
        *_figures(figs, out, "frontier", models, "Held-out NLL change against stream bits per element"),
        findings("frontier"),
        "## 2. Long-context accuracy: RULER\n",
        "Accuracy with the compressed cache in the generation loop, paired with the 16-bit cache on the same "
        "examples, pooled over the task families clear of chance (per task: "
        f"`{os.path.relpath(report, out.parent)}/ruler.md`):\n",
        to_markdown(ruler_pooled(ruler), RULER_POOLED_COLUMNS),
        *_figures(figs, out, "ruler_pooled", models, "RULER pooled accuracy against bits per element"),
        _table(ruler, "16-bit baseline per task"),
        *_figures(figs, out, "ruler", models, "RULER accuracy change against bits per element"),
        findings("ruler"),
        "## 3. Eviction or coding at equal bytes?\n",
        _table(eviction, "every eviction cell"),
        _table(eviction, "eviction against quantization at similar stored bits"),
        *_figures(figs, out, "eviction", models, "Eviction beside the quantizers"),
        findings("eviction"),
        "## 4. When does a stored compressed cache beat re-running prefill, and what does it cost per token?\n",
        "Restoring a stored session: encode, decode, the first token's forward and the prefill are measured (each the "
        "median of the run's rounds; beside each crossover its lowest and highest over the rounds); the "
        "transfer is modelled as bits over link bandwidth. The compressed cache is the fastest way to the first token "
        "between the two crossovers (below `crossover_prefill` re-running prefill from the token ids wins, above "
        "`crossover_16bit` sending 16-bit KV does):\n",
        to_markdown(restore_table(got.restore), RESTORE_COLUMNS),
        _figure(figs, out, "restore_ttft", "Time to first token against link bandwidth"),
        "Decoding with the cache resident (KIVI: a layer's packed codes unpacked when its attention runs), against "
        "transformers' DynamicCache and QuantizedCache (HQQ) in the same run:\n",
        to_markdown(memory_speed_table(got.latency), MEMORY_COLUMNS),
        findings("latency"),
        "## 5. Cross-session prefix sharing\n",
        to_markdown(sharing_table(everything), SHARING_COLUMNS),
        _figure(figs, out, "prefix_sharing", "Compression ratio against the workload's share rate"),
        findings("sharing"),
        "## 6. Distance to the entropy bound, and to the paper's 914,000x\n",
        f"The paper's figure is its per-vector arithmetic for a 70B-class config, {PAPER_PER_VECTOR_BITS:,} "
        f"bits/token, over its {PAPER_BOUND_BITS} bits/token bound: {PAPER_FACTOR:,.0f}x. The same arithmetic on "
        "these models (3 bits per K and V element over the bound measured on the default windows):\n",
        to_markdown(paper_arithmetic(df), PAPER_ARITHMETIC_COLUMNS),
        "Measured: the fewest bits per token within 1% NLL (or exact), as a multiple of the bound of the windows "
        "each was measured on:\n",
        to_markdown(distance_table(df), DISTANCE_COLUMNS),
        _figure(figs, out, "bits_vs_decode_time", "Stream bits against the decoder's seconds per token: coders that "
                "decode from KV alone beside speculative and recompute, which run the model"),
        findings("bound"),
    ]
    if others:
        s += ["## Detailed results\n", *[f"- [{p.stem}]({p.name})" for p in others], ""]
    if got.skipped:
        s += [f"{len(got.skipped)} run dirs were skipped (unfinished or unreadable); see `{report}/skipped.txt`.\n"]
    return "\n".join(s)


#: a decimal figure as findings quote it: 2.126, +0.0052, -0.208, 0.82, 1,093.5 (integers and percentages are prose)
_FIGURE = re.compile(r"(?<![\w.])[+\-−]?\d{1,3}(?:,\d{3})*\.\d+|(?<![\w.])[+\-−]?\d+\.\d+")


def quoted_not_generated(text: str) -> list[str]:
    """The decimal figures quoted in the hand-written findings blocks of ``text`` that appear nowhere in its
    generated part, as written there (sign aside): a finding may only quote what the tables show."""
    found = blocks(text, "findings")
    generated = re.sub(r"<!-- findings:.*?<!-- /findings -->", "", text, flags=re.S)
    missing = []
    for body in found.values():
        for m in _FIGURE.finditer(body):
            figure = m.group(0).lstrip("+-−")
            if figure not in generated:
                missing.append(m.group(0))
    return missing
