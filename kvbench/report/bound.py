"""``python -m kvbench bound``: the entropy bound next to what per-vector coding and each measured run spend.

    python -m kvbench bound [model=NAME dataset=NAME dtype=... ...] [DIR ...] [--out FILE] [--bits 16,4,3,2]

Three tables, in bits per token (all layers, K and V):

1. The paper's per-vector arithmetic ("Sequential KV Cache Compression via Probabilistic Language Tries",
   arXiv 2604.15356): ``bits per component x head_dim x 2 (K, V) x heads x layers``, counted with the query-head
   and with the KV-head count, for the model's own config and for a 70B-class config (80 layers, 64 heads, 8 KV
   heads, head_dim 128), against the paper's 4.3 bits/token (perplexity ~20) and against the measured bound.
2. The measured bound: the model's cross-entropy H(token | history) on the dataset, from the trace's token
   log-probabilities (the same tokens every run's ``bound_bits_per_token`` is measured on).
3. Every run (``summary.json``) under DIR (default ``<results>/runs``): its bits/token and its ratio to the bound
   measured on its own tokens.

The tables are printed and written to ``<results>/bound.md`` (or ``--out``). Overrides (``KEY=VALUE``) are the
``run`` command's; the trace is reused from the cache or captured as ``run`` would.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the paper's example bound: perplexity ~20, log2(20) = 4.32 bits per token
PAPER_BOUND_BITS = 4.3
#: bits per component: the uncompressed cache, then 4/3/2-bit per-vector quantizers (TurboQuant ~3, KIVI 2)
DEFAULT_BITS = (16.0, 4.0, 3.0, 2.0)


@dataclass(frozen=True)
class AttentionShape:
    name: str
    layers: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int


#: the paper's 70B-class example (Llama-2/3-70B attention: 80 layers, 64 query heads, 8 KV heads, head_dim 128)
SEVENTY_B = AttentionShape("70B-class (paper)", 80, 64, 8, 128)


def per_vector_bits(shape: AttentionShape, bits_per_component: float, heads: int) -> float:
    """Bits per token of a per-vector code: every component of K and V in every head and layer."""
    return bits_per_component * shape.head_dim * 2 * heads * shape.layers


def arithmetic_rows(shape: AttentionShape, bits: Iterable[float], measured: float | None) -> list[dict[str, Any]]:
    """One row per (head count, bits per component): bits/token and its multiple of the bound(s)."""
    rows = []
    for label, heads in (("query heads", shape.heads), ("KV heads", shape.kv_heads)):
        for b in bits:
            per_token = per_vector_bits(shape, b, heads)
            rows.append({
                "config": shape.name,
                "counted": f"{heads} {label}",
                "bits/component": b,
                "bits/token": per_token,
                "x paper bound (4.3)": per_token / PAPER_BOUND_BITS,
                "x measured bound": per_token / measured if measured else math.nan,
            })
    return rows


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    if math.isnan(v):
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 or float(v).is_integer() else f"{v:,.2f}"


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "_none_\n"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" if isinstance(rows[0][c], str) else "---:" for c in cols) + "|"]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


#: run columns: (flattened summary key, header, format)
RUN_COLUMNS = [
    ("model", "model", "s"),
    ("dataset", "dataset", "s"),
    ("dtype", "dtype", "s"),
    ("compressor", "compressor", "s"),
    ("params", "params", "s"),
    ("n_tokens", "tokens", "d"),
    ("bits_per_token", "bits/token", ",.2f"),
    ("bound_bits_per_token", "bound (bits/token)", ".3f"),
    ("x_bound", "x bound", ",.3f"),
    ("compression_ratio", "ratio vs 16-bit", ",.2f"),
    ("lossless", "lossless", "s"),
    ("decode_s", "decode s", ".2f"),
]


def runs_table(dirs: Iterable[str | Path]) -> tuple[str, list[tuple[Path, str]], int]:
    """Markdown table of every run under ``dirs`` (sorted by bits/token), the skipped dirs, the run count."""
    from kvbench.report.collect import collect
    from kvbench.report.tables import to_markdown

    got = collect(dirs)
    df = got.table
    if df.empty or "bits_per_token" not in df:
        return "_no runs found_\n", got.skipped, 0
    df = df.sort_values(["model", "dataset", "bits_per_token"], kind="stable").reset_index(drop=True)
    cols = [(k, h, h, f) for k, h, f in RUN_COLUMNS]
    return to_markdown(df, cols), got.skipped, len(df)


def measured_bound(cfg: Any, handle: Any = None) -> tuple[AttentionShape, float, int]:
    """The model's attention shape and H(token | history) in bits/token over the trace's evaluated tokens."""
    from kvbench.inputs.capture import load_or_capture
    from kvbench.inputs.models import ModelHandle
    from kvbench.measure.metrics.rate import bound_bits_per_token

    trace = load_or_capture(cfg, handle or ModelHandle(cfg.model, cfg.device))
    m = trace.manifest["model"]
    shape = AttentionShape(m["name"], m["n_layers"], m["n_heads"], m["n_kv_heads"], m["head_dim"])
    lp = [x for s in trace.eval for x in s.logprobs.tolist()]
    return shape, bound_bits_per_token(lp, len(lp)), len(lp)


def build_report(cfg: Any, dirs: Sequence[str | Path], bits: Sequence[float] = DEFAULT_BITS, handle: Any = None) -> str:
    shape, h_bits, n = measured_bound(cfg, handle)
    ds = cfg.dataset
    runs_md, skipped, n_runs = runs_table(dirs)
    out = [
        "# The entropy bound and what per-vector coding spends",
        "",
        "Generated by `python -m kvbench bound`. Bits per token count every layer's K and V.",
        "",
        "## Measured bound",
        "",
        f"H(token | history) of **{shape.name}** on **{ds.name}** ({n:,} predicted tokens, "
        f"{ds.n_sequences} x {ds.seq_len}-token windows): **{h_bits:.3f} bits/token** "
        f"(perplexity {2 ** h_bits:.1f}).",
        "",
        "## Per-vector arithmetic (the paper's)",
        "",
        "bits/token = bits per component x head_dim x 2 (K, V) x heads x layers.",
        "",
        f"{shape.name}: {shape.layers} layers, {shape.heads} query heads, {shape.kv_heads} KV heads, "
        f"head_dim {shape.head_dim}.",
        "",
        markdown_table(arithmetic_rows(shape, bits, h_bits)),
        f"{SEVENTY_B.name}: {SEVENTY_B.layers} layers, {SEVENTY_B.heads} query heads, {SEVENTY_B.kv_heads} KV heads, "
        f"head_dim {SEVENTY_B.head_dim} (the measured bound above is {shape.name}'s, so only the paper's 4.3 "
        "applies here).",
        "",
        markdown_table([{k: v for k, v in r.items() if k != "x measured bound"}
                        for r in arithmetic_rows(SEVENTY_B, bits, None)]),
        "## Measured runs",
        "",
        f"Each run's bits/token against the bound measured on its own tokens (`bound_bits_per_token`); "
        f"{n_runs} run(s) from {', '.join(map(str, dirs))}.",
        "",
        runs_md,
    ]
    if skipped:
        out += ["Skipped:", ""] + [f"- `{p}`: {why}" for p, why in skipped] + [""]
    return "\n".join(out)


def _parse_bits(text: str) -> list[float]:
    try:
        bits = [float(b) for b in text.split(",") if b.strip()]
    except ValueError:
        bits = []
    if not bits or any(not 0 < b <= 32 for b in bits):
        raise ValueError(f"--bits={text!r}: give bits per component as a comma-separated list in (0, 32], e.g. 16,4,3,2")
    return bits


def main(argv: list[str] | None = None) -> int:
    from hydra.errors import HydraException

    from kvbench.core.config import compose
    from kvbench.inputs.assets import AssetError
    from kvbench.store.paths import results_root

    ap = argparse.ArgumentParser(prog="python -m kvbench bound", description=__doc__.split("\n\n")[0])
    ap.add_argument("args", nargs="*", help="KEY=VALUE overrides as for `run` (model=, dataset=, dtype=, ...) "
                    "and directories to search for summary.json (default: <results>/runs)")
    ap.add_argument("--out", type=Path, default=None, help="Markdown output (default: <results>/bound.md)")
    ap.add_argument("--bits", default=",".join(f"{b:g}" for b in DEFAULT_BITS),
                    help="bits per component for the per-vector arithmetic (default: 16,4,3,2)")
    a = ap.parse_args(argv)
    overrides = [x for x in a.args if "=" in x and not Path(x).exists()]
    dirs = [x for x in a.args if x not in overrides]
    try:
        bits = _parse_bits(a.bits)
        cfg = compose(overrides)
        root = results_root(cfg.paths.results)
        text = build_report(cfg, dirs or [root / "runs"], bits)
    except (ValueError, AssetError, FileNotFoundError, HydraException) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = a.out or root / "bound.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"-> {out}")
    return 0
