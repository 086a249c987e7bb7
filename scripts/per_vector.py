"""Per-vector quantizers on SmolLM2: TurboQuant (TQ_mse, TQ_prod) and KIVI across bit-widths.

    flock /tmp/kvbench-bench.lock .venv/bin/python scripts/per_vector.py [--force]

Runs each cell through ``kvbench.cells.run_cell`` on the default run config (SmolLM2-135M, SOTU, 4 x 1024-token
windows, NLL of 128 held-out tokens) and one loaded model, so every run lands under ``results/runs/`` as with
``python -m kvbench run`` (a finished run of the same cell, of any code version, is reused unless ``--force``),
then writes

    results/per_vector.json            one compact row per cell
    results/figures/per_vector.{png,pdf}
    results/per_vector.md              its table, between the markers (the findings around it are kept)

``--no-run`` redraws the figure and the table from per_vector.json. TurboQuant runs at 2, 2.5, 3, 3.5 and 4
bits; KIVI only at whole bits (its codes are integer-width), with its default 128-token 16-bit window and with
none (residual=0), since the window alone adds about 1.75 bits per element at 1024 tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from study_cells import compose

from kvbench.cells import run_cell
from kvbench.models import ModelHandle
from kvbench.paths import results_root
from kvbench.results import Outcome

TQ_BITS = (2, 2.5, 3, 3.5, 4)
KIVI_BITS = (2, 3, 4)

CELLS = [
    *[("TQ_mse", b, ["+compressor=turboquant", "compressor.variant=mse", f"compressor.bits={b}"]) for b in TQ_BITS],
    *[("TQ_prod", b, ["+compressor=turboquant", "compressor.variant=prod", f"compressor.bits={b}"]) for b in TQ_BITS],
    *[("KIVI", b, ["+compressor=kivi", f"compressor.bits={b}"]) for b in KIVI_BITS],
    *[("KIVI r=0", b, ["+compressor=kivi", f"compressor.bits={b}", "compressor.residual=0"]) for b in KIVI_BITS],
]
KEYS = ["bits_per_element", "rel_mse_k", "rel_mse_v", "nll_base", "delta_nll", "encode_MBps", "decode_MBps"]
STYLE = {"TQ_mse": ("C0", "o", "-"), "TQ_prod": ("C1", "s", "-"), "KIVI": ("C2", "^", "--"), "KIVI r=0": ("C3", "v", ":")}


def row(method: str, bits: float, out: Outcome) -> dict:
    """One compact row of per_vector.json. The load average says how shared the machine was while the cell was
    timed: read now for a cell just measured; a reused run has it only if its summary recorded it."""
    s = out.summary
    load = s.get("load_average_1min", None if out.reused else os.getloadavg()[0])
    return {"method": method, "bits": bits, **{k: s[k] for k in KEYS}, "run": out.path.name, "load_average_1min": load}


LABEL = {"TQ_mse": "TQ_mse", "TQ_prod": "TQ_prod", "KIVI": "KIVI (128-token window)", "KIVI r=0": "KIVI, no window"}
TABLE_OPEN, TABLE_CLOSE = "<!-- table: written by scripts/per_vector.py -->", "<!-- /table -->"


def markdown(rows: list[dict]) -> str:
    out = ["| method | nominal bits | bits/element | rel MSE K | rel MSE V | ΔNLL (nats) | encode MB/s | decode MB/s |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {LABEL.get(r['method'], r['method'])} | {r['bits']:g} | {r['bits_per_element']:.3f} "
                   f"| {r['rel_mse_k']:.4f} | {r['rel_mse_v']:.4f} | {r['delta_nll']:+.4f} | {r['encode_MBps']:.0f} "
                   f"| {r['decode_MBps']:.0f} |")
    return "\n".join(out)


def write_table(rows: list[dict], md: Path) -> None:
    """Put the table into ``md`` between its markers (the prose around it is kept), or start the file with it."""
    block = f"{TABLE_OPEN}\n{markdown(rows)}\n{TABLE_CLOSE}"
    text = md.read_text() if md.exists() else "# Per-vector quantizers: TurboQuant and KIVI\n\n"
    if TABLE_OPEN in text and TABLE_CLOSE in text:
        head, rest = text.split(TABLE_OPEN, 1)
        text = head + block + rest.split(TABLE_CLOSE, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    md.write_text(text)
    print(f"-> {md}")


def figure(rows: list[dict], out: Path) -> None:
    from matplotlib import rc_context
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    style = {"font.size": 8, "axes.titlesize": 9, "legend.fontsize": 7, "axes.grid": True, "grid.alpha": 0.3,
             "lines.markersize": 4, "savefig.dpi": 200, "pdf.fonttype": 42}
    panels = [  # (title, [(key, filled)], log y)
        ("relative MSE of K", [("rel_mse_k", True)], True),
        ("relative MSE of V", [("rel_mse_v", True)], True),
        ("Δ NLL of 128 held-out tokens (nats)", [("delta_nll", True)], True),
        ("MB/s of 16-bit KV (enc filled, dec open)", [("encode_MBps", True), ("decode_MBps", False)], False),
    ]
    with rc_context(style):
        fig = Figure(figsize=(12, 3.2), layout="constrained")
        for ax, (title, series, logy) in zip(fig.subplots(1, len(panels)), panels):
            for method, (color, marker, ls) in STYLE.items():
                pts = sorted((r["bits_per_element"], r) for r in rows if r["method"] == method)
                for key, filled in series:
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1][key] for p in pts], color=color, marker=marker, ls=ls,
                                mfc=color if filled else "none")
            ax.set_xlabel("bits per element (actual, all charged)")
            ax.set_title(title)
            if logy:
                ax.set_yscale("log")
        handles = [Line2D([], [], color=c, marker=m, ls=ls, label=name) for name, (c, m, ls) in STYLE.items()]
        fig.legend(handles=handles, loc="outside lower center", ncol=len(handles))
        fig.suptitle("SmolLM2-135M, SOTU, 4 x 1024-token windows: per-vector quantizers (KIVI r=0: no 16-bit window)")
        out.parent.mkdir(parents=True, exist_ok=True)
        for ext in ("png", "pdf"):
            fig.savefig(out.with_suffix(f".{ext}"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--force", action="store_true", help="recompute cells that already have a finished run")
    p.add_argument("--no-run", action="store_true", help="figure and table from results/per_vector.json alone")
    args = p.parse_args()
    root = results_root()
    if args.no_run:
        rows = json.loads((root / "per_vector.json").read_text())
        figure(rows, root / "figures" / "per_vector")
        write_table(rows, root / "per_vector.md")
        return
    handle = None
    rows = []
    for method, bits, overrides in CELLS:
        cfg = compose("run", overrides, root)
        handle = handle or ModelHandle(cfg.model, cfg.device)
        out = run_cell("run", cfg, handle, resume=False if args.force else None)
        r = row(method, bits, out)
        rows.append(r)
        print(f"{method:<9} {bits:>4}: {r['bits_per_element']:.3f} b/el  rel MSE K {r['rel_mse_k']:.4f} "
              f"V {r['rel_mse_v']:.4f}  dNLL {r['delta_nll']:+.4f}  enc {r['encode_MBps']:.0f} "
              f"dec {r['decode_MBps']:.0f} MB/s", flush=True)
    (root / "per_vector.json").write_text(json.dumps(rows, indent=2, default=lambda x: None if math.isnan(x) else x) + "\n")
    figure(rows, root / "figures" / "per_vector")
    write_table(rows, root / "per_vector.md")


if __name__ == "__main__":
    main()
