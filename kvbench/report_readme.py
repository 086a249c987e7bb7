"""``results/README.md`` drafted from the runs: the tables that answer the design's four questions, with the report's
figures, around hand-written findings that regenerating keeps (one marked block per section).

Every number comes from the summaries under the runs dir (``kvbench.report_data``); the figures are the overview's
(``python -m kvbench report RUNS --out REPORT`` writes them first).
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

import pandas as pd

from kvbench.paths import repo_root
from kvbench.report import block, blocks
from kvbench.report_data import best_at_tolerance, collect, numeric, series_label, with_pooled
from kvbench.report_tables import BEST_COLUMNS, format_ratio, pick, to_markdown

FINDINGS_WHY = "written by hand; kept when this file is regenerated"
FINDINGS_TODO = "_Findings: to be written from the tables and figures above._"
# The paper's per-vector arithmetic (arXiv 2604.15356) for a 70B-class config: 3 bits x 128 dims x 2 (K, V) x 64 heads
# x 80 layers per token, against its bound of log2(20) = 4.3 bits/token.
PAPER_PER_VECTOR_BITS = 3 * 128 * 2 * 64 * 80
PAPER_BOUND_BITS = 4.3

COST_COLUMNS = pick("model", "compressor", "params", "context_len", "bits_per_token", "x_bound", "compression_ratio",
                    "delta_nll", "lossless", "encode_ms_per_token", "decode_ms_per_token")
BOUND_COLUMNS = pick("model", "context_len", "n_sequences", "bound_bits_per_token", "compressor", "bits_per_token",
                     "x_bound", "paper_gap_closed", formats={"bits_per_token": ",.2f"})
SHARING_COLUMNS = pick("model", "workload", "compressor", "sharing.share_rate", "sharing.dedup_ratio",
                       "compression_ratio", "bits_per_token")
MEMORY_COLUMNS = pick("model", "compressor", "context", "bytes_ratio", "speed_ratio", "ms_compressed", "ms_dynamic")
ACCURACY_COLUMNS = pick("model", "compressor", "bits_per_element", "n", "acc_base", "acc_comp", "diff", "stderr_diff",
                        "mcnemar_p", formats={"bits_per_element": ".2f"})


def _machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else "?"
    import torch

    return f"{cpu}, {os.cpu_count()} CPU cores, torch {torch.__version__}, Python {platform.python_version()}"


def _sha() -> str:
    out = subprocess.run(["git", "-C", str(repo_root()), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def _lossless(df: pd.DataFrame) -> pd.Series:
    return df["lossless"].astype(str) == "True" if "lossless" in df else pd.Series(False, index=df.index)


def _figure(report: Path, out: Path, name: str, caption: str) -> str:
    png = report / "figures" / f"{name}.png"
    if not png.exists():
        return f"_(no {name} figure: no summary carries what it plots)_\n"
    return f"![{caption}]({os.path.relpath(png, out.parent)})\n\n_{caption}_ (PDF beside it)\n"


def cost_table(df: pd.DataFrame) -> pd.DataFrame:
    """Time per token beside bits per token, at each curve's best point within 1% NLL and for lossless runs."""
    best = best_at_tolerance(df)
    rows = df.loc[sorted(set(best.index) | set(df.index[_lossless(df)]))].copy()
    if rows.empty:
        return rows
    rows["compressor"] = series_label(df).loc[rows.index]
    tok = numeric(rows, "n_tokens")
    rows["encode_ms_per_token"] = 1e3 * numeric(rows, "encode_s") / tok
    rows["decode_ms_per_token"] = 1e3 * numeric(rows, "decode_s") / tok
    return rows.sort_values(["model", "bits_per_token"])


def stores_tokens(df: pd.DataFrame) -> pd.Series:
    """Runs whose bitstream carries token ids (recompute, speculative): they decode by running the model."""
    parts = [c for c in df.columns if c.startswith("bits_by_part.") and "token" in c.removeprefix("bits_by_part.")]
    return (df[parts].fillna(0).apply(pd.to_numeric, errors="coerce") > 0).any(axis=1) if parts \
        else pd.Series(False, index=df.index)


def bound_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per model and context: the bound, and the fewest bits/token measured within 1% NLL (or lossless), overall
    and among methods that store only KV (no token ids, no model run to decode)."""
    if df.empty or "bound_bits_per_token" not in df:
        return pd.DataFrame()
    d = df.assign(series=series_label(df), bpt=numeric(df, "bits_per_token"), dnll=numeric(df, "delta_nll"),
                  base=numeric(df, "nll_base"), tokens=stores_tokens(df))
    ok = d[((d["dnll"] <= 0.01 * d["base"]) | _lossless(d)) & d["bpt"].notna()]
    # one bound per set of windows: the same context length over a different number of windows is other text
    keys = [k for k in ("model", "context_len", "n_sequences") if k in d]
    if ok.empty:
        return pd.DataFrame()
    picks = []
    for which, sub in (("overall", ok), ("KV only", ok[~ok["tokens"]])):
        if not sub.empty:
            picks.append(sub.loc[sub.groupby(keys)["bpt"].idxmin()].assign(which=which))
    best = pd.concat(picks).sort_values([*keys, "which"], ascending=[True] * len(keys) + [False])
    best["compressor"] = best["which"] + ": " + best["compressor"].astype(str) + " " + best["params"].fillna("")
    paper = PAPER_PER_VECTOR_BITS / PAPER_BOUND_BITS
    best["paper_gap_closed"] = best["x_bound"].map(lambda x: f"{paper:,.0f}x -> {format_ratio(x)}x")
    return best


def sharing_table(df: pd.DataFrame) -> pd.DataFrame:
    if "sharing.share_rate" not in df:
        return pd.DataFrame()
    d = df[numeric(df, "sharing.share_rate").notna()].copy()
    d["compressor"] = series_label(d, exclude=())
    return d.sort_values(["model", "compressor", "sharing.share_rate"])


def memory_speed_table(lat: pd.DataFrame) -> pd.DataFrame:
    """Per latency run and context: the compressed cache's bytes and decode speed relative to the 16-bit cache
    measured in the same run."""
    need = {"run_id", "context", "cache", "bytes_held", "tokens_per_s"}
    if lat.empty or not need <= set(lat.columns):
        return pd.DataFrame()
    lat = lat.assign(compressor=series_label(lat, exclude=()))
    keys = ["model", "compressor", "run_id", "context"]
    wide = lat.pivot_table(index=keys, columns="cache", values=["bytes_held", "tokens_per_s", "decode_median_ms"],
                           aggfunc="mean")
    if ("bytes_held", "compressed") not in wide or ("bytes_held", "dynamic") not in wide:
        return pd.DataFrame()
    t = pd.DataFrame({
        "bytes_ratio": wide[("bytes_held", "dynamic")] / wide[("bytes_held", "compressed")],
        "speed_ratio": wide[("tokens_per_s", "compressed")] / wide[("tokens_per_s", "dynamic")],
        "ms_compressed": wide.get(("decode_median_ms", "compressed")),
        "ms_dynamic": wide.get(("decode_median_ms", "dynamic")),
    }).reset_index()
    return t.sort_values(["model", "context", "bytes_ratio"])


def accuracy_table(ev: pd.DataFrame) -> pd.DataFrame:
    """One row per eval run: its tasks pooled."""
    runs = with_pooled(ev)
    if runs.empty:
        return pd.DataFrame()
    runs = runs[runs["task"] == "all"].copy()
    runs["compressor"] = series_label(runs, exclude=())
    return runs.sort_values(["model", "bits_per_element"] if "bits_per_element" in runs else ["model"])


def render(runs: Path, report: Path, out: Path) -> str:
    kept = blocks(out.read_text(), "findings") if out.exists() else {}

    def findings(key: str) -> str:
        return block("findings", key, kept.get(key, FINDINGS_TODO), FINDINGS_WHY) + "\n"

    got = collect([runs])
    everything = got.table
    # multi-session (workload) runs depend on the share rate: they are compared in section 3 only
    single = everything["workload"].isna() | (everything["workload"].astype(str) == "none") if "workload" in everything \
        else pd.Series(True, index=everything.index)
    df = everything[single]
    others = sorted(p for p in out.parent.glob("*.md") if p.name != out.name)
    s = [
        "# kvbench: measured findings\n",
        f"Regenerated by `scripts/reproduce.sh` on {time.strftime('%Y-%m-%d')} at commit `{_sha()}`, on {_machine()}.",
        f"{len(got.table)} runs under `{runs}` ({len(everything)} distinct configs; the newest run of each is used); "
        "every number below is read from their `summary.json` (all runs: `results/report/runs.md`, `.csv`, `.tex`).\n",
        "## 1. Real compression ratio at <= 1% NLL regression\n",
        "Highest compression ratio (vs the 16-bit cache, every bit counted) whose held-out NLL rises by at most 1%:\n",
        to_markdown(best_at_tolerance(df), BEST_COLUMNS),
        _figure(report, out, "rate_distortion", "Rate-distortion: bits per element against delta NLL"),
        "Task accuracy with the compressed cache in the loop, paired with the 16-bit cache on the same examples "
        "(all tasks pooled; per task in `results/report/eval.md`):\n",
        to_markdown(accuracy_table(got.evals), ACCURACY_COLUMNS),
        _figure(report, out, "accuracy_regression", "Task-accuracy change per compressor and task"),
        findings("ratio"),
        "## 2. The latency and throughput price\n",
        "Coding time per token at each curve's best point within 1% NLL, and for the lossless coders:\n",
        to_markdown(cost_table(df), COST_COLUMNS),
        _figure(report, out, "throughput_vs_ratio", "Encode and decode throughput against compression ratio"),
        "End to end, the compressed cache in the decode loop against the 16-bit cache in the same run "
        "(all columns in `results/report/latency.md`):\n",
        to_markdown(memory_speed_table(got.latency), MEMORY_COLUMNS),
        _figure(report, out, "latency_vs_memory", "Decode throughput against the bytes the cache holds"),
        findings("price"),
        "## 3. Cross-session prefix sharing\n",
        to_markdown(sharing_table(everything), SHARING_COLUMNS),
        _figure(report, out, "prefix_sharing", "Compression ratio against the workload's share rate"),
        findings("sharing"),
        "## 4. Does the predictor's compute eat the memory saved?\n",
        "Compressors that decode by running the model (`recompute`, and `speculative`, which predicts KV with a copy of "
        "the model) against the rest: "
        "bits per token and decode time per token in section 2, memory saved against decode speed in the end-to-end "
        "table of section 2.\n",
        findings("predictor"),
        "## Distance to the entropy bound\n",
        f"The paper's per-vector arithmetic for a 70B-class config is {PAPER_PER_VECTOR_BITS:,} bits/token, "
        f"{PAPER_PER_VECTOR_BITS / PAPER_BOUND_BITS:,.0f}x its {PAPER_BOUND_BITS} bits/token bound. Measured here:\n",
        to_markdown(bound_table(df), BOUND_COLUMNS),
        _figure(report, out, "context_length", "Bits per token against context length, with the entropy bound"),
        findings("bound"),
    ]
    if others:
        s += ["## Detailed results\n", *[f"- [{p.stem}]({p.name})" for p in others], ""]
    if got.skipped:
        s += [f"{len(got.skipped)} run dirs were skipped (unfinished or unreadable); see `results/report/skipped.txt`.\n"]
    return "\n".join(s)
