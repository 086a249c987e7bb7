"""``python -m kvbench report DIR...``: every ``summary.json`` under the dirs as one table, plus paper figures.

Writes into ``--out`` (default ``<results>/report``):
  runs.csv                      every key of every summary (nested keys flattened with dots), one row per cell
  runs.md, runs.tex             the headline columns (Markdown, and a booktabs LaTeX tabular)
  best_at_1pct_nll.md/.tex      per compressor, the highest compression ratio whose delta_nll is <= 1% of nll_base
  eval.md/.tex                  task accuracy per eval run and task (from eval.json, `python -m kvbench eval`)
  latency.md/.tex               per latency run, context and cache (from latency.json, `python -m kvbench latency`)
  figures/*.png, figures/*.pdf  see ``kvbench.figures``
  skipped.txt                   run dirs that were not read, and why (only when there are any)

A bad or partial run dir (no summary, unreadable JSON, not a kvbench summary, a killed run's staging dir) is
reported and skipped, never fatal; so are figures whose keys no summary carries.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from kvbench.paths import results_root

# A run dir's summary file names its kind: compression cells (`run`), task accuracy (`eval`), end-to-end latency.
SUMMARY_FILES = {"summary.json": "run", "eval.json": "eval", "latency.json": "latency"}
# Files that mark a directory as a run, finished or not.
RUN_FILES = (*SUMMARY_FILES, "rows.parquet", "eval.parquet", "latency.parquet")
# Headline columns: (summary key, Markdown header, LaTeX header, format). Missing keys are left out of the table.
COLUMNS = [
    ("model", "model", "model", "s"),
    ("dataset", "dataset", "dataset", "s"),
    ("compressor", "compressor", "compressor", "s"),
    ("params", "params", "params", "s"),
    ("workload", "workload", "workload", "s"),
    ("sharing.share_rate", "share rate", "share rate", ".2f"),
    ("context_len", "context", "context", "d"),
    ("bits_per_element", "bits/elt", "bits/elt", ".3f"),
    ("bits_per_token", "bits/token", "bits/token", ",.1f"),
    ("bound_bits_per_token", "bound bits/token", "bound bits/token", ".2f"),
    ("x_bound", "x bound", r"$\times$ bound", ",.0f"),
    ("compression_ratio", "ratio", "ratio", ".2f"),
    ("delta_nll", "dNLL (nats)", r"$\Delta$NLL (nats)", "+.4f"),
    ("rel_mse_k", "rel MSE K", "rel MSE K", ".2e"),
    ("rel_mse_v", "rel MSE V", "rel MSE V", ".2e"),
    ("encode_MBps", "enc MB/s", "enc MB/s", ",.0f"),
    ("decode_MBps", "dec MB/s", "dec MB/s", ",.0f"),
    ("lossless", "lossless", "lossless", "s"),
]
# Parameters that set a compressor's rate: points along one curve rather than separate curves.
RATE_KNOBS = ("bits", "step")
NLL_TOLERANCE = 0.01  # "at <= 1% NLL regression"


@dataclass
class Collection:
    table: pd.DataFrame  # one row per compression cell (summary.json)
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    evals: pd.DataFrame = field(default_factory=pd.DataFrame)  # one row per (eval run, task)
    latency: pd.DataFrame = field(default_factory=pd.DataFrame)  # one row per (latency run, context, cache)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, f"{key}."))
        elif isinstance(v, list | tuple):
            out[key] = json.dumps(v, default=str)
        else:
            out[key] = v
    return out


def _read_summary(path: Path) -> tuple[dict, dict]:
    """The flattened summary of one run dir, with its config (``cfg.*``) when ``config.json`` is there, and the raw
    summary (whose per-task and per-context lists become rows of their own tables)."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"unreadable {path.name} ({type(e).__name__}: {e})") from e
    if not isinstance(summary, dict) or "compressor" not in summary:
        raise ValueError("not a kvbench summary (no 'compressor' key)")
    row = _flatten({k: v for k, v in summary.items() if k not in ("config", "tasks", "rows")})
    cfg = summary.get("config")
    cfg_file = path.parent / "config.json"
    if not isinstance(cfg, dict) and cfg_file.exists():
        try:
            cfg = json.loads(cfg_file.read_text())
        except (OSError, json.JSONDecodeError):
            cfg = None
    if isinstance(cfg, dict):
        row.update(_flatten(cfg, "cfg."))
    return row, summary


def _explode(row: dict, items: list[dict]) -> list[dict]:
    return [{**row, **_flatten(item)} for item in items if isinstance(item, dict)]


def collect(dirs: Iterable[str | Path]) -> Collection:
    """Read every run summary under ``dirs``; list the dirs that could not be read instead of failing."""
    rows, evals, latency, skipped, seen = [], [], [], [], set()
    for d in map(Path, dirs):
        if not d.exists():
            skipped.append((d, "no such directory"))
            continue
        if d.is_file():
            d = d.parent
        for run_dir in sorted({p.parent for name in RUN_FILES for p in d.rglob(name)}):
            if run_dir.resolve() in seen:
                continue
            seen.add(run_dir.resolve())
            if any(part.startswith(".") for part in run_dir.relative_to(d).parts):
                # staged_dir() renames a finished run into place; a hidden one is a killed cell's leftovers
                skipped.append((run_dir, "staging directory of an unfinished or killed run"))
                continue
            found = [name for name in SUMMARY_FILES if (run_dir / name).exists()]
            if not found:
                skipped.append((run_dir, "no summary.json, eval.json or latency.json (unfinished or killed run)"))
                continue
            for name in found:
                try:
                    row, raw = _read_summary(run_dir / name)
                except ValueError as e:
                    skipped.append((run_dir, str(e)))
                    continue
                row.update(run_dir=str(run_dir), run_id=run_dir.name, kind=SUMMARY_FILES[name])
                if name == "eval.json":
                    tasks = raw.get("tasks") if isinstance(raw.get("tasks"), dict) else {}
                    evals += _explode(row, [{"task": t, **v} for t, v in tasks.items() if isinstance(v, dict)])
                elif name == "latency.json":
                    latency += _explode(row, raw.get("rows") if isinstance(raw.get("rows"), list) else [])
                else:
                    rows.append(row)
    return Collection(_derive(pd.DataFrame(rows)), skipped, _derive(pd.DataFrame(evals)), _derive(pd.DataFrame(latency)))


def _num(df: pd.DataFrame, col: str) -> pd.Series:
    return pd.to_numeric(df[col], errors="coerce") if col in df else pd.Series(math.nan, index=df.index)


def param_columns(df: pd.DataFrame) -> list[str]:
    return [c for c in df.columns if c.startswith("compressor_params.") and c != "compressor_params.name"]


def _params_text(row: pd.Series, cols: list[str]) -> str:
    parts = []
    for c in cols:
        v = row.get(c)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        parts.append(f"{c.removeprefix('compressor_params.')}={_plain(v)}")
    return " ".join(parts)


def _plain(v) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _derive(df: pd.DataFrame) -> pd.DataFrame:
    """Columns every figure and table relies on: context length, distance to the bound, parameter text."""
    if df.empty:
        return df
    df = df.copy()
    seq = _num(df, "cfg.dataset.seq_len")
    per_seq = _num(df, "n_tokens") / _num(df, "n_sequences")
    context = seq.fillna(per_seq).astype(float)
    if "workload" in df:  # sessions of a workload have their own lengths: the mean session
        multi = df["workload"].notna() & ~df["workload"].astype(str).isin(["none", ""])
        context = per_seq.astype(float).where(multi, context)
    df["context_len"] = context
    df["x_bound"] = _num(df, "bits_per_token") / _num(df, "bound_bits_per_token")
    pcols = param_columns(df)
    df["params"] = df.apply(lambda r: _params_text(r, pcols), axis=1)
    sort = [c for c in ("model", "dataset", "compressor", "params", "context_len", "bits_per_element") if c in df]
    return df.sort_values(sort, kind="stable", na_position="last").reset_index(drop=True)


def series_label(df: pd.DataFrame, exclude: Iterable[str] = RATE_KNOBS) -> pd.Series:
    """A curve label per row: the compressor plus whichever of its parameters vary among its runs, except
    ``exclude`` (the parameters that move a point along the curve)."""
    if df.empty:
        return pd.Series(dtype=str)
    labels = pd.Series(df["compressor"].astype(str), index=df.index)
    if "compressor_params.inner.name" in df:  # a pipeline is named by what it wraps: pipeline(turboquant)
        inner = df["compressor_params.inner.name"]
        labels = labels.where(inner.isna(), labels + "(" + inner.astype(str) + ")")
    pcols = [c for c in param_columns(df) if c.removeprefix("compressor_params.") not in set(exclude)]
    for _, idx in df.groupby("compressor").groups.items():
        sub = df.loc[idx]
        varying = [c for c in pcols if sub[c].astype(str).nunique(dropna=False) > 1]
        if varying:
            text = sub.apply(lambda r, v=varying: _params_text(r, v), axis=1)
            labels.loc[idx] = (labels.loc[idx] + " " + text).str.strip()
    return labels


def best_at_tolerance(df: pd.DataFrame, tol: float = NLL_TOLERANCE) -> pd.DataFrame:
    """Per (model, dataset, curve): the highest compression ratio whose delta_nll <= tol * nll_base."""
    need = {"compression_ratio", "delta_nll", "nll_base"}
    if df.empty or not need <= set(df.columns):
        return pd.DataFrame()
    d = df.assign(series=series_label(df), ratio=_num(df, "compression_ratio"), dnll=_num(df, "delta_nll"),
                  base=_num(df, "nll_base"))
    d = d[d["dnll"].notna() & d["base"].notna() & d["ratio"].notna()]
    ok = d[d["dnll"] <= tol * d["base"]]
    if ok.empty:
        return pd.DataFrame()
    best = ok.loc[ok.groupby(["model", "dataset", "series"])["ratio"].idxmax()]
    cols = ["model", "dataset", "series", "params", "bits_per_element", "bits_per_token", "x_bound", "compression_ratio",
            "delta_nll", "nll_base"]
    out = best[[c for c in cols if c in best]]
    return out.rename(columns={"series": "compressor"}).sort_values(["model", "dataset", "compression_ratio"],
                                                                   ascending=[True, True, False])


def format_ratio(x: float) -> str:
    """A ratio spanning decades: two decimals near 1 (1.08 x the bound), none far from it (36,360 x)."""
    return f"{x:.2f}" if abs(x) < 100 else f"{x:,.0f}"


def _fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if spec == "s":
        return _plain(v)
    if spec == "d":
        return f"{int(v)}"
    if spec == "x":
        return format_ratio(float(v))
    try:
        if isinstance(v, float) and math.isinf(v):
            return "inf"
        return format(float(v), spec)
    except (TypeError, ValueError):
        return str(v)


def _columns(df: pd.DataFrame, columns: list[tuple[str, str, str, str]]) -> list[tuple[str, str, str, str]]:
    return [c for c in columns if c[0] in df and df[c[0]].notna().any() and (df[c[0]].astype(str) != "").any()]


def to_markdown(df: pd.DataFrame, columns=COLUMNS) -> str:
    cols = _columns(df, columns)
    if not cols:
        return "_no runs_\n"
    esc = lambda s: s.replace("|", r"\|")
    lines = ["| " + " | ".join(h for _, h, _, _ in cols) + " |",
             "|" + "|".join("---" if f == "s" else "---:" for _, _, _, f in cols) + "|"]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(esc(_fmt(r[k], f)) for k, _, _, f in cols) + " |")
    return "\n".join(lines) + "\n"


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "#": r"\#", "_": r"\_", "{": r"\{", "}": r"\}",
        "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "$": r"\$", "|": r"\textbar{}"}


def _tex_escape(s: str) -> str:
    return "".join(_TEX.get(ch, ch) for ch in s)


def to_latex(df: pd.DataFrame, columns=COLUMNS, caption: str = "") -> str:
    """A booktabs ``tabular`` (needs ``\\usepackage{booktabs}``)."""
    cols = _columns(df, columns)
    if not cols:
        return "% no runs\n"
    spec = "".join("l" if f == "s" else "r" for _, _, _, f in cols)
    lines = [f"% {caption}" if caption else "% kvbench report", f"\\begin{{tabular}}{{{spec}}}", r"\toprule",
             " & ".join(h for _, _, h, _ in cols) + r" \\", r"\midrule"]
    for _, r in df.iterrows():
        lines.append(" & ".join(_tex_escape(_fmt(r[k], f)) for k, _, _, f in cols) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


BEST_COLUMNS = [
    ("model", "model", "model", "s"),
    ("dataset", "dataset", "dataset", "s"),
    ("compressor", "compressor", "compressor", "s"),
    ("params", "params", "params", "s"),
    ("context_len", "context", "context", "d"),
    ("bits_per_element", "bits/elt", "bits/elt", ".3f"),
    ("bits_per_token", "bits/token", "bits/token", ",.1f"),
    ("x_bound", "x bound", r"$\times$ bound", "x"),
    ("compression_ratio", "ratio", "ratio", ".2f"),
    ("delta_nll", "dNLL (nats)", r"$\Delta$NLL (nats)", "+.4f"),
    ("nll_base", "NLL base", "NLL base", ".3f"),
]


EVAL_COLUMNS = [
    ("model", "model", "model", "s"),
    ("compressor", "compressor", "compressor", "s"),
    ("params", "params", "params", "s"),
    ("bits_per_element", "bits/elt", "bits/elt", ".3f"),
    ("task", "task", "task", "s"),
    ("n", "n", "n", "d"),
    ("acc_base", "acc 16-bit", "acc 16-bit", ".3f"),
    ("acc_comp", "acc compressed", "acc compressed", ".3f"),
    ("diff", "diff", "diff", "+.3f"),
    ("stderr_diff", "stderr", "stderr", ".3f"),
    ("mcnemar_p", "McNemar p", "McNemar $p$", ".3g"),
]
LATENCY_COLUMNS = [
    ("model", "model", "model", "s"),
    ("compressor", "compressor", "compressor", "s"),
    ("params", "params", "params", "s"),
    ("context", "context", "context", "d"),
    ("cache", "cache", "cache", "s"),
    ("prefill_s", "prefill s", "prefill s", ".3f"),
    ("compress_s", "compress s", "compress s", ".3f"),
    ("decode_median_ms", "decode ms (median)", "decode ms (median)", ".1f"),
    ("decode_p95_ms", "decode ms (p95)", "decode ms (p95)", ".1f"),
    ("tokens_per_s", "tokens/s", "tokens/s", ".1f"),
    ("bytes_held", "bytes held", "bytes held", ",.0f"),
]


def write_report(dirs: Iterable[str | Path], out: Path, formats: tuple[str, ...] = ("png", "pdf")) -> dict:
    """Collect, write tables and figures into ``out``; return what was written and skipped."""
    from kvbench.atomic import write_with
    from kvbench.figures import FIGURES

    got = collect(dirs)
    df = got.table
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def text(name: str, body: str) -> None:
        write_with(out / name, lambda p: p.write_text(body))
        written.append(out / name)

    if not df.empty:
        df.to_csv(out / "runs.csv", index=False)
        written.append(out / "runs.csv")
    text("runs.md", to_markdown(df))
    text("runs.tex", to_latex(df, caption=f"{len(df)} runs"))
    best = best_at_tolerance(df)
    text("best_at_1pct_nll.md", to_markdown(best, BEST_COLUMNS) if not best.empty
         else "_no run has both delta_nll and nll_base_\n")
    text("best_at_1pct_nll.tex", to_latex(best, BEST_COLUMNS, "highest ratio at <= 1% NLL regression"))
    for name, table, columns in (("eval", got.evals, EVAL_COLUMNS), ("latency", got.latency, LATENCY_COLUMNS)):
        if not table.empty:
            text(f"{name}.md", to_markdown(table, columns))
            text(f"{name}.tex", to_latex(table, columns, f"{name}: {table['run_id'].nunique()} runs"))
    if got.skipped:
        text("skipped.txt", "".join(f"{p}\t{why}\n" for p, why in got.skipped))
    elif (out / "skipped.txt").exists():
        (out / "skipped.txt").unlink()

    figures, empty = {}, {}
    fig_dir = out / "figures"
    tables = {"runs": df, "evals": got.evals, "latency": got.latency}
    for name, (table, make) in FIGURES.items():
        fig, why = make(tables[table])
        if fig is None:
            empty[name] = why
            continue
        fig_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for ext in formats:
            p = fig_dir / f"{name}.{ext}"
            fig.savefig(p, dpi=200, bbox_inches="tight")
            paths.append(p)
        figures[name] = paths
        written += paths
    return {"rows": len(df), "evals": len(got.evals), "latency": len(got.latency), "written": written,
            "skipped": got.skipped, "figures": figures, "empty": empty}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbench report", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="run directories or roots to search for summary.json (e.g. results/runs)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: <results>/report)")
    ap.add_argument("--formats", default="png,pdf", help="figure formats, comma-separated (default: png,pdf)")
    args = ap.parse_args(argv)
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    allowed = {"png", "pdf", "svg"}
    if not formats or set(formats) - allowed:
        print(f"error: --formats={args.formats!r}; allowed: {sorted(allowed)}", file=sys.stderr)
        return 2
    out = args.out or results_root() / "report"
    res = write_report(args.dirs, out, formats)
    for p, why in res["skipped"]:
        print(f"skipped {p}: {why}", file=sys.stderr)
    print(f"{res['rows']} runs, {res['evals']} eval rows, {res['latency']} latency rows -> {out}")
    for name, paths in res["figures"].items():
        print(f"  figure {name}: {', '.join(p.name for p in paths)}")
    for name, why in res["empty"].items():
        print(f"  figure {name}: nothing to plot ({why})")
    if res["rows"] + res["evals"] + res["latency"] == 0:
        print("error: no readable run summary under " + " ".join(map(str, args.dirs)), file=sys.stderr)
        return 1
    return 0
