"""The report's data: every run summary under some dirs read into tables, with the columns tables and figures share.

Run dirs hold one summary each per kind: compression cells (``summary.json``), task accuracy (``eval.json``,
``python -m kvbench eval``), end-to-end latency (``latency.json``, ``python -m kvbench latency``) and time to first
token restoring a stored cache (``restore.json``, ``python -m kvbench restore``), a model-running coder's step
against a plain decode step (``stepcost.json``, ``python -m kvbench stepcost``), what mutated streams did to a
compressor's decoder (``reliability.json``, scripts/reliability.py), the wall time and peak memory of each step of a
cell at one context length (``scale.json``, scripts/bench_scale.py) and what a memory budget holds of each coder's
cache, projected from measured figures (``capacity.json``, ``python -m kvbench capacity``). A bad or
partial run dir (no summary, unreadable JSON, not a kvbench summary, a killed run's staging dir) is listed as
skipped, never fatal.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from kvbench.measure.metrics.intervals import NLL_TOLERANCE, verdict
from kvbench.store.results import FILE_HASHES, KINDS, newest_per_cell

# A run dir's summary file names its kind (kvbench.store.results.KINDS): compression cells, task accuracy, latency.
SUMMARY_FILES = {k.summary: k.name for k in KINDS.values()}
# The Collection frame each kind's rows go to; every kind but ``run`` and ``eval`` lists its rows under ``rows``.
FRAMES = {"run": "table", "eval": "evals", "latency": "latency", "restore": "restore", "stepcost": "stepcost",
          "reliability": "reliability", "scale": "scale", "capacity": "capacity"}
# Files that mark a directory as a run, finished or not.
RUN_FILES = (*SUMMARY_FILES, *(k.table for k in KINDS.values()))
# Parameters that set a compressor's rate: points along one curve rather than separate curves.
RATE_KNOBS = ("bits", "step")


@dataclass
class Collection:
    table: pd.DataFrame  # one row per compression cell (summary.json)
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    evals: pd.DataFrame = field(default_factory=pd.DataFrame)  # one row per (eval run, task)
    latency: pd.DataFrame = field(default_factory=pd.DataFrame)  # one row per (latency run, context, cache)
    restore: pd.DataFrame = field(default_factory=pd.DataFrame)  # one row per (restore run, context, bandwidth)
    stepcost: pd.DataFrame = field(default_factory=pd.DataFrame)  # one row per (stepcost run, stage)
    reliability: pd.DataFrame = field(default_factory=pd.DataFrame)  # one row per (reliability run, mutation)
    scale: pd.DataFrame = field(default_factory=pd.DataFrame)  # one row per (scale run, step, compressor)
    capacity: pd.DataFrame = field(default_factory=pd.DataFrame)  # one row per (capacity run, coder, context)
    #: the folder a relative ``run_dir`` is under (committed evidence names its runs relative to the results root, so
    #: that what is built from it is the same in any checkout); None: the run dirs are paths as they stand
    root: Path | None = None

    def run_path(self, run_dir: str) -> Path:
        """Where the files of the run at ``run_dir`` (a row's ``run_dir``) are."""
        return Path(run_dir) if self.root is None else self.root / run_dir

    def frames(self) -> dict[str, pd.DataFrame]:
        """Each kind of run (:data:`FRAMES`) and its frame."""
        return {kind: getattr(self, attr) for kind, attr in FRAMES.items()}

    @property
    def empty(self) -> bool:
        return all(f.empty for f in self.frames().values())


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
    # file hashes guard the run's files; they are not measurements, so no table shows them
    row = _flatten({k: v for k, v in summary.items() if k not in ("config", "tasks", "rows", FILE_HASHES)})
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


def collect(dirs: Iterable[str | Path], newest_only: bool = True) -> Collection:
    """Read every run summary under ``dirs``; list the dirs that could not be read instead of failing. With
    ``newest_only``, a cell measured more than once (same ``cell_key``, e.g. at several code versions) is shown by
    its newest run."""
    found_runs, skipped, seen = [], [], set()
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
                skipped.append((run_dir, f"no {', '.join(SUMMARY_FILES)} (unfinished or killed run)"))
                continue
            for name in found:
                try:
                    row, raw = _read_summary(run_dir / name)
                except ValueError as e:
                    skipped.append((run_dir, str(e)))
                    continue
                row.update(run_dir=str(run_dir), run_id=run_dir.name, kind=SUMMARY_FILES[name])
                found_runs.append({**raw, "_row": row})
    if newest_only:
        found_runs = [r for kind in KINDS for r in newest_per_cell([r for r in found_runs if r["_row"]["kind"] == kind])]
    rows: dict[str, list[dict]] = {kind: [] for kind in FRAMES}
    for raw in found_runs:
        row = raw["_row"]
        kind = row["kind"]  # a kind of KINDS, each with its frame in FRAMES
        if kind == "eval":
            tasks = raw.get("tasks") if isinstance(raw.get("tasks"), dict) else {}
            rows[kind] += _explode(row, [{"task": t, **v} for t, v in tasks.items() if isinstance(v, dict)])
        elif kind == "run":
            rows[kind].append(row)
        else:
            rows[kind] += _explode(row, raw.get("rows") if isinstance(raw.get("rows"), list) else [])
    return Collection(skipped=skipped, **{FRAMES[k]: _derive(pd.DataFrame(v)) for k, v in rows.items()})


def numeric(df: pd.DataFrame, col: str) -> pd.Series:
    """A column as numbers (NaN where it is not one, all NaN where the column is missing)."""
    return pd.to_numeric(df[col], errors="coerce") if col in df else pd.Series(math.nan, index=df.index)


def fact(df: pd.DataFrame, name: str) -> pd.Series:
    """What each row's compressor says of itself under ``name`` (``compressor_facts`` of its run summary:
    :meth:`kvbench.core.compressor.Compressor.facts`); None where a run does not carry it."""
    col = f"compressor_facts.{name}"
    return df[col].astype(object).where(df[col].notna(), None) if col in df else pd.Series(None, index=df.index,
                                                                                          dtype=object)


def param_columns(df: pd.DataFrame) -> list[str]:
    return [c for c in df.columns if c.startswith("compressor_params.") and c != "compressor_params.name"]


def _params_text(row: pd.Series, cols: list[str]) -> str:
    parts = []
    for c in cols:
        v = row.get(c)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        parts.append(f"{c.removeprefix('compressor_params.')}={plain(v)}")
    return " ".join(parts)


def plain(v) -> str:
    """A value as text, whole floats without their ``.0`` (a parameter read back from a table column is a float)."""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _derive(df: pd.DataFrame) -> pd.DataFrame:
    """Columns every figure and table relies on: context length, distance to the bound, parameter text."""
    if df.empty:
        return df
    df = df.copy()
    seq = numeric(df, "cfg.dataset.seq_len")
    per_seq = numeric(df, "n_tokens") / numeric(df, "n_sequences")
    context = seq.fillna(per_seq).astype(float)
    if "workload" in df:  # sessions of a workload have their own lengths: the mean session
        multi = df["workload"].notna() & ~df["workload"].astype(str).isin(["none", ""])
        context = per_seq.astype(float).where(multi, context)
    df["context_len"] = context
    df["x_bound"] = numeric(df, "bits_per_token") / numeric(df, "bound_bits_per_token")
    for t in ("encode_s", "decode_s"):  # a run codes n_sequences windows (or sessions) one after another
        df[f"{t}_per_seq"] = numeric(df, t) / numeric(df, "n_sequences")
    df["eval_s_per_example"] = numeric(df, "eval_s") / numeric(df, "n_examples")  # an eval cell's wall time per example
    # an eval cell's encoder time per compressed context (KVzip's and the query scorers' model passes among it)
    df["encode_s_per_context"] = numeric(df, "encode_s") / numeric(df, "contexts_compressed")
    _quality(df)
    pcols = param_columns(df)
    df["params"] = df.apply(lambda r: _params_text(r, pcols), axis=1)
    sort = [c for c in ("model", "dataset", "compressor", "params", "context_len", "bits_per_element") if c in df]
    return df.sort_values(sort, kind="stable", na_position="last").reset_index(drop=True)


def interval_of(value) -> tuple[float, float]:
    """An interval as a summary stores it (a ``[low, high]`` list, or its JSON text in a table) as two floats;
    NaNs when it is missing or unreadable."""
    try:
        low, high = json.loads(value) if isinstance(value, str) else value
        return float(low), float(high)
    except (TypeError, ValueError):
        return math.nan, math.nan


def interval_text(low, high, fmt: str):
    """``[low, high]`` in ``fmt``, or NaN (a missing cell) when either end is missing."""
    try:
        lo, hi = float(low), float(high)
    except (TypeError, ValueError):
        return math.nan
    return f"[{lo:{fmt}}, {hi:{fmt}}]" if math.isfinite(lo) and math.isfinite(hi) else math.nan


def with_pooled(ev: pd.DataFrame, pooled: str = "all") -> pd.DataFrame:
    """Eval rows (one per run and task) followed, per run, by a row of its pooled statistics (``overall.*``) as a
    task named ``pooled``; each row gets its paired 95% interval of the accuracy difference as text."""
    if ev.empty or "run_id" not in ev:
        return ev
    runs = ev.drop_duplicates("run_id")
    stats = {c.removeprefix("overall."): runs[c] for c in runs.columns if c.startswith("overall.")}
    rows = pd.concat([ev, runs.assign(task=pooled, **stats)], ignore_index=True)
    order = {r: i for i, r in enumerate(ev["run_id"].drop_duplicates())}
    rows = rows.sort_values("run_id", key=lambda r: r.map(order), kind="stable").reset_index(drop=True)
    rows["diff_ci_text"] = [interval_text(lo, hi, "+.3f") for lo, hi in zip(numeric(rows, "ci95_low"), numeric(rows, "ci95_high"))]
    return rows


def pool_tasks(g: pd.DataFrame) -> dict:
    """Pooled paired statistics of eval rows (tasks) from their per-task ones: accuracies and the difference
    weighted by examples, its standard error and 95% interval from the per-task variances of the differences (tasks
    are independent sets of examples)."""
    from kvbench.measure.evaluation.stats import smallest_significant_flips

    n = numeric(g, "n")
    total = float(n.sum())
    if total == 0:
        return {"n": 0}
    w = n / total
    diff = float((w * numeric(g, "diff")).sum())
    se = math.sqrt(float((w**2 * numeric(g, "stderr_diff").fillna(0.0) ** 2).sum()))
    return {"n": int(total), "acc_base": float((w * numeric(g, "acc_base")).sum()),
            "acc_comp": float((w * numeric(g, "acc_comp")).sum()), "diff": diff, "stderr_diff": se,
            "ci95_low": max(diff - 1.96 * se, -1.0), "ci95_high": min(diff + 1.96 * se, 1.0), "mcnemar_p": math.nan,
            "smallest_significant_diff": smallest_significant_flips() / total}


def _quality(df: pd.DataFrame) -> None:
    """The delta-NLL interval as numbers and as text (the recall probe's as text), its verdict against 1% of the base
    NLL (summaries without an interval are ``unresolved``), and which evaluated windows a row was measured on (only
    rows on the same windows are compared with each other)."""
    def intervals(key: str) -> list[tuple[float, float]]:
        return [interval_of(t) for t in (df[key] if key in df else [None] * len(df))]

    ci = intervals("delta_nll_ci")
    df["delta_nll_low"] = [lo for lo, _ in ci]
    df["delta_nll_high"] = [hi for _, hi in ci]
    df["delta_nll_ci_text"] = [interval_text(lo, hi, "+.4f") for lo, hi in ci]
    recall = intervals("delta_nll_recall_ci")
    df["delta_nll_recall_low"] = [lo for lo, _ in recall]
    df["delta_nll_recall_high"] = [hi for _, hi in recall]
    df["delta_nll_recall_ci_text"] = [interval_text(lo, hi, "+.3f") for lo, hi in recall]
    base = numeric(df, "nll_base")
    df["nll_verdict"] = [verdict(c, NLL_TOLERANCE * b) if math.isfinite(b) else math.nan for c, b in zip(ci, base)]
    trace = df["trace"].astype(str).map(lambda t: Path(t).name) if "trace" in df else pd.Series("", index=df.index)
    if "workload" in df:
        wl = df["workload"].fillna("").astype(str)
        trace = trace.where(wl.isin(["", "none"]), trace + "/" + wl)
    df["windows"] = trace


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
    """Per (model, dataset, evaluated windows, curve): the highest compression ratio whose delta-NLL interval lies
    wholly at or below ``tol * nll_base`` (verdict ``within``). Cells on other windows (another context length,
    other text) are never compared: each set of windows gets its own rows."""
    need = {"compression_ratio", "delta_nll_high", "nll_base", "windows"}
    if df.empty or not need <= set(df.columns):
        return pd.DataFrame()
    d = df.assign(series=series_label(df), ratio=numeric(df, "compression_ratio"), high=numeric(df, "delta_nll_high"),
                  base=numeric(df, "nll_base"))
    ok = d[d["ratio"].notna() & d["base"].notna() & (d["high"] <= tol * d["base"])]
    if ok.empty:
        return pd.DataFrame()
    best = ok.loc[ok.groupby(["model", "dataset", "windows", "series"])["ratio"].idxmax()]
    cols = ["model", "dataset", "windows", "series", "params", "context_len", "bits_per_element", "bits_per_token",
            "x_bound", "compression_ratio", "delta_nll", "delta_nll_ci_text", "nll_base"]
    out = best[[c for c in cols if c in best]]
    return out.rename(columns={"series": "compressor"}).sort_values(["model", "dataset", "windows", "compression_ratio"],
                                                                   ascending=[True, True, True, False])
