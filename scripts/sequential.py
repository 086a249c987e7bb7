"""Sequential compressors on the default trace (SmolLM2-135M, SOTU, 4 x 1024 tokens): bits per token against
the entropy bound, and what each costs in time.

    .venv/bin/python scripts/sequential.py            # run the missing cells, then tables and figure
    .venv/bin/python scripts/sequential.py --no-run   # tables and figure from the runs already there

Every cell runs through ``kvbench.cells.run_cell`` under ``/tmp/kvbench-bench.lock`` (one timing at a time on a
shared machine), single-threaded, with its run directory under ``results/sweeps/sequential/runs`` (git-ignored).
A cell already there (the newest finished run of its cell key, any code version) is not run again. Writes
``results/figures/sequential.{png,pdf}`` and ``results/sequential_tables.md`` (the tables quoted in
``results/sequential.md``). The ideal -log2 p column is the coder's own model estimate, recorded beside the coded
size in ``compressor_stats``; the rate itself is always the harness's count of the bitstream.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from study_cells import LOCK, bench_lock, compose, finished_run

from kvbench.cells import formatter, run_cell
from kvbench.config import available
from kvbench.models import ModelHandle
from kvbench.paths import repo_root
from kvbench.report_tables import format_ratio

STEPS = (0.1, 0.5)
#: this study's runs, apart from other sweeps (git-ignored): every cell here is timed under the same conditions
RUNS = repo_root() / "results" / "sweeps" / "sequential"
#: one thread per cell: on a 2-core machine shared with other jobs, two threads spin against each other and
#: one-token-at-a-time passes (recompute, speculative) run several times slower than on one
THREADS = "1"
#: compressors whose decoder runs the model one token at a time (minutes per sequence)
SLOW = ("recompute", "speculative")
#: the compressors that code residuals, whose bitstream parts the second table breaks down
RESIDUAL_CODERS = ("delta", "speculative")


def _step_label(name: str, step: float) -> str:
    return name + (" exact" if step == 0 else f" step {step:g}")


def cells() -> list[tuple[str, str, list[str]]]:
    """(label, config name, overrides), in display order; only compressors configured here."""
    out = [("identity", "identity", []), ("lossless", "lossless", [])]
    for pred in ("previous", "linear", "cross_layer"):
        for step in (0.0, *STEPS):
            out.append((_step_label(f"delta {pred}", step), "delta",
                        [f"compressor.predictor={pred}", f"compressor.step={step}"]))
    # delta coding against the model's own prediction (its own compressor); labelled as the delta family it is
    for step in (0.0, *STEPS):
        out.append((_step_label("delta model", step), "speculative", [f"compressor.step={step}"]))
    # a step per channel from calibration (bits=): one fixed step is far too coarse for layers whose values are
    # small (SmolLM2's layer-0 values have an RMS of 0.04)
    for pred, bits in (("previous", 2.0), ("previous", 3.0), ("linear", 3.0), ("cross_layer", 3.0)):
        out.append((f"delta {pred} bits {bits:g}", "delta", [f"compressor.predictor={pred}", f"compressor.bits={bits}"]))
    out.append(("delta model step 0.1 plain ids", "speculative", ["compressor.step=0.1", "compressor.token_coding=plain"]))
    out.append(("recompute", "recompute", []))
    out.append(("kivi 2-bit", "kivi", []))
    out.append(("turboquant 3-bit", "turboquant", []))
    have = set(available("compressor"))
    return [c for c in out if c[1] in have]


def cell_config(name: str, overrides: list[str], root: Path):
    return compose("run", [f"+compressor={name}", *overrides], root)


def run_missing(rows: list[tuple[str, str, list[str]]], root: Path) -> None:
    """Measure every cell without a finished run, each alone under the benchmark lock, on one loaded model."""
    handle = None
    # the cells that decode one token at a time take minutes per sequence: run them last
    slow = [r for r in rows if r[1] in SLOW]
    for label, name, ov in [r for r in rows if r not in slow] + slow:
        cfg = cell_config(name, ov, root)
        if finished_run("run", cfg) is not None:
            continue
        handle = handle or ModelHandle(cfg.model, cfg.device)
        print(f"== {label}: +compressor={name} {' '.join(ov)} (one thread, under {LOCK})", flush=True)
        with bench_lock():
            out = run_cell("run", cfg, handle)
        print(formatter("run")(out.summary), flush=True)


def one_thread(argv: list[str]) -> None:
    """Re-run this script with ``OMP_NUM_THREADS=THREADS`` unless it has it: torch and numpy read the thread
    count once, when they load, so it cannot be lowered from inside."""
    if os.environ.get("OMP_NUM_THREADS") != THREADS:
        os.execve(sys.executable, [sys.executable, __file__, *argv], {**os.environ, "OMP_NUM_THREADS": THREADS})


def load(rows: list[tuple[str, str, list[str]]], root: Path) -> list[tuple[str, list[str], dict]]:
    found = []
    for label, name, ov in rows:
        s = finished_run("run", cell_config(name, ov, root))
        if s is None:
            print(f"missing: {label}", file=sys.stderr)
        else:
            found.append((label, ov, s))
    return found


def _fmt(x: float, digits: int = 3) -> str:
    return "–" if x != x else f"{x:,.{digits}f}"


def tables(found: list[tuple[str, list[str], dict]]) -> str:
    s0 = found[0][2]
    n_seq, T = s0["n_sequences"], s0["n_tokens"] // s0["n_sequences"]
    lines = [
        f"Trace: {s0['model']} / {s0['dataset']}, {n_seq} sequences x {T} tokens, {s0['dtype']} cache; "
        f"bound H(token | history) = {s0['bound_bits_per_token']:.3f} bits/token. Times are per {T}-token sequence.",
        "",
        "| cell | bits/token | x bound | ratio vs 16-bit | bits/element | exact | rel MSE K / V | delta NLL (nats) "
        "| encode s/seq | decode s/seq |",
        "|---|---:|---:|---:|---:|:-:|---:|---:|---:|---:|",
    ]
    for label, _, s in found:
        lines.append(
            f"| {label} | {s['bits_per_token']:,.1f} | {format_ratio(s['bits_per_token'] / s['bound_bits_per_token'])} "
            f"| {s['compression_ratio']:,.2f} | {s['bits_per_element']:.3f} | {'yes' if s['lossless'] else 'no'} "
            f"| {s['rel_mse_k']:.2e} / {s['rel_mse_v']:.2e} | {_fmt(s['delta_nll'], 4)} "
            f"| {s['encode_s'] / s['n_sequences']:.2f} | {s['decode_s'] / s['n_sequences']:.2f} |")
    lines += [
        "",
        "Where the delta bits go, per token (coded = the bitstream parts; ideal = the coder's model, sum of -log2 p; "
        "side info = fitted weights / steps, charged once per run and here amortised over the run's tokens):",
        "",
        "| cell | K residual coded / ideal | V residual coded / ideal | scales | tokens coded / ideal | frame+bounds "
        "| side info (bits, once) | side info / token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, _, s in found:
        if s["compressor"] not in RESIDUAL_CODERS:
            continue
        n, p, st = s["n_tokens"], s["bits_by_part"], s.get("compressor_stats", {})
        # plain ids have no model estimate: ceil(log2 V) bits each is both their size and their ideal
        ideal_tok = st.get("tokens.ideal_token_bits", p.get("tokens", math.nan))
        tok = (f"{p['tokens'] / n:.2f} / {ideal_tok / n:.2f}" if "tokens" in p else "–")
        lines.append(
            f"| {label} | {p['k.residual'] / n:,.1f} / {st.get('ideal_bits.k.residual', float('nan')) / n:,.1f} "
            f"| {p['v.residual'] / n:,.1f} / {st.get('ideal_bits.v.residual', float('nan')) / n:,.1f} "
            f"| {p['scales'] / n:.1f} | {tok} | {(p['frame'] + p.get('bounds', 0)) / n:.2f} "
            f"| {s['side_info_bits']:,} | {s['side_info_bits'] / n:,.1f} |")
    return "\n".join(lines) + "\n"


def family(label: str) -> str:
    if label.startswith("delta"):
        return label.split()[1] if "bf16-compute" not in label else "model"
    return label.split()[0]


COLORS = {"identity": "#7f7f7f", "lossless": "#8c564b", "previous": "#1f77b4", "linear": "#2ca02c",
          "cross_layer": "#9467bd", "model": "#d62728", "recompute": "#ff7f0e", "kivi": "#17becf",
          "turboquant": "#bcbd22"}


def figure(found: list[tuple[str, list[str], dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f[0] for f in found]
    bits = [f[2]["bits_per_token"] for f in found]
    dec = [f[2]["decode_s"] / f[2]["n_sequences"] for f in found]
    bound = found[0][2]["bound_bits_per_token"]
    colors = [COLORS.get(family(lab), "#333333") for lab in labels]
    y = list(range(len(found)))[::-1]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.38 * len(found) + 1.6), sharey=True,
                                   gridspec_kw={"width_ratios": [3, 2]})
    ax1.barh(y, bits, color=colors)
    ax1.set_xscale("log")
    ax1.axvline(bound, color="k", ls="--", lw=1)
    ax1.text(bound * 1.1, y[0] + 0.6, f"bound {bound:.2f} bits/token", fontsize=8, va="bottom")
    for yi, b, (_, _, s) in zip(y, bits, found):
        note = (f"{b:,.1f}" if b < 100 else f"{b:,.0f}") + ("" if s["lossless"] else f"   ΔNLL {s['delta_nll']:+.4f}")
        ax1.text(b * 1.08, yi, note, va="center", fontsize=7)
    ax1.set_xlim(bound / 2, max(bits) * 12)
    ax1.set_yticks(y, labels, fontsize=8)
    ax1.set_xlabel("bits per token, all 30 layers, K and V (log scale)")
    ax2.barh(y, dec, color=colors)
    ax2.set_xscale("log")
    for yi, d in zip(y, dec):
        ax2.text(d * 1.08, yi, f"{d:.2f} s", va="center", fontsize=7)
    ax2.set_xlim(min(dec) / 2, max(dec) * 8)
    ax2.set_xlabel("decode s per 1024-token sequence (log; 1 CPU thread)")
    s0 = found[0][2]
    fig.suptitle(f"Sequential KV coding on {s0['model']} / {s0['dataset']} ({s0['dtype']} cache)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    for ext in ("png", "pdf"):
        fig.savefig(out.with_suffix(f".{ext}"), dpi=150)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-run", action="store_true", help="only read finished runs")
    args = ap.parse_args(argv)
    rows, root = cells(), RUNS
    if not args.no_run:
        one_thread(sys.argv[1:] if argv is None else argv)
        run_missing(rows, root)
    found = load(rows, root)
    if not found:
        print("no finished runs", file=sys.stderr)
        return 1
    text = tables(found)
    out = repo_root() / "results"
    (out / "sequential_tables.md").write_text(text)
    figure(found, out / "figures" / "sequential")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
