"""Prefix sharing (Layer 1): the cells behind results/prefix_sharing.md, and its figures and tables.

    .venv/bin/python scripts/prefix_sharing.py run       # runs every missing cell (as `python -m kvbench run` would)
    .venv/bin/python scripts/prefix_sharing.py figures   # reads results/runs, writes figures and tables

Cells (SmolLM2-135M-Instruct, SOTU text, BIG-bench tasks):
  sweep   trie (block 16 and 1) on workload=mixed at target share rates 0..0.6, 32 sessions
  budget  trie with policy lru | plt under budget_tokens on a 96-session mixed stream at share rate 0.5
  compose identity, trie, and each inner compressor alone and inside pipeline, on shared_system and mixed(0.5)
Figures go to results/figures/prefix_sharing_*.{png,pdf}; tables to results/prefix_sharing/tables.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from study_cells import compose, finished_run

from kvbench.paths import results_root
from kvbench.results import newest_per_cell, summaries

ROOT = Path(__file__).resolve().parent.parent
FIGS = ROOT / "results" / "figures"
OUT = ROOT / "results" / "prefix_sharing"

FAMILIES = ["shared_system", "fewshot", "doc_qa", "multiturn"]
TARGETS = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
BUDGETS = [256, 512, 1024, 2048, 4096, 8192, 16384]
BUDGET_STREAM = ["workload=mixed", "workload.n_sessions=96", "workload.target_share_rate=0.5"]
MIXED_HALF = ["workload=mixed", "workload.target_share_rate=0.5"]
INNERS = {  # name -> overrides of the compressor alone; the pipeline wraps the same config
    "kivi": ["compressor.bits=2", "compressor.residual=0"],
    "turboquant": ["compressor.bits=3"],
    "delta": [],
}
# Published production prefix-cache hit rates (token level), as reference points
PRODUCTION = [
    (0.51, "Mooncake (Kimi) trace 51%"),  # arXiv 2407.00079, Table 1, unbounded cache
    (0.563, "DeepSeek V3/R1 56.3%"),  # DeepSeek inference system overview, Feb 2025
]


def cells() -> list[list[str]]:
    out = []
    for t in TARGETS:
        for block in (16, 1):
            out.append(["+compressor=trie", f"compressor.block_size={block}", "workload=mixed",
                        f"workload.target_share_rate={t}", "metrics.nll=false"])
        # sharing on the token match alone (a serving cache's semantics), not verified bit-identical
        out.append(["+compressor=trie", "compressor.verify_kv=false", "workload=mixed",
                    f"workload.target_share_rate={t}", "metrics.nll=false"])
    for policy, weight in (("lru", 1.0), ("plt", 1.0), ("plt", 0.0)):
        for b in BUDGETS:
            # plt_weight=0: frequency alone (GreedyDual-Size-Frequency), the ablation of the model prior
            extra = [] if weight == 1.0 else [f"compressor.plt_weight={weight}"]
            out.append(["+compressor=trie", f"compressor.policy={policy}", f"compressor.budget_tokens={b}", *extra,
                        *BUDGET_STREAM, "metrics.nll=false"])
    out.append(["+compressor=trie", *BUDGET_STREAM, "metrics.nll=false"])  # unbounded reference
    for family in FAMILIES:  # each family on its own: the high-sharing end of the curve
        out.append(["+compressor=trie", f"workload={family}", "metrics.nll=false"])
    available = {p.stem for p in (ROOT / "configs" / "compressor").glob("*.yaml")}
    for wl in (["workload=shared_system"], MIXED_HALF):
        out.append(["+compressor=identity", *wl])
        out.append(["+compressor=trie", *wl])
        for name, over in INNERS.items():
            if name not in available:
                print(f"[prefix_sharing] no {name} compressor here; skipping its cells", file=sys.stderr)
                continue
            out.append([f"+compressor={name}", *over, *wl])
            inner = "{" + ",".join([f"name:{name}"] + [o.split(".", 1)[1].replace("=", ":") for o in over]) + "}"
            out.append(["+compressor=pipeline", f"compressor.inner={inner}", *wl])
    return out


def run_all() -> None:
    """Measure every cell without a finished run (of any code version) on one loaded model; a failing cell is
    reported and the others still run."""
    from kvbench.cells import run_cell
    from kvbench.models import ModelHandle

    root, handle = results_root(), None
    todo = cells()
    for i, args in enumerate(todo, 1):
        cfg = compose("run", args, root)
        if finished_run("run", cfg) is not None:
            continue
        print(f"[{i}/{len(todo)}] python -m kvbench run {' '.join(args)}", flush=True)
        handle = handle or ModelHandle(cfg.model, cfg.device)
        try:
            run_cell("run", cfg, handle)
        except Exception as e:  # noqa: BLE001 - one failing cell must not stop the sweep
            print(f"  failed: {type(e).__name__}: {e}", file=sys.stderr)


# ---- reading -----------------------------------------------------------------------------------------------
def load() -> list[dict]:
    """Workload summaries (each with its resolved ``config``): the newest run of each cell."""
    return [s for s in newest_per_cell(summaries([results_root() / "runs"], "run")) if "workload" in s]


def _wl(s: dict) -> dict:
    return s["config"]["workload"]


def _comp(s: dict) -> dict:
    """The compressor's every field, defaults included (what the cell is keyed by)."""
    return s["compressor_params"]


def _label(s: dict) -> str:
    c = _comp(s)
    if s["compressor"] == "pipeline":
        inner = c["inner"] if isinstance(c["inner"], str) else c["inner"].get("name", "?")
        return f"trie+{inner}"
    return s["compressor"]


def sweep_rows(rows: list[dict]) -> list[dict]:
    out = [s for s in rows if s["compressor"] == "trie" and _wl(s).get("n_sessions") == 32
           and "target_share_rate" in _wl(s) and _comp(s)["budget_tokens"] is None
           and not s["config"]["metrics"]["nll"]]
    return sorted(out, key=lambda s: (_variant(s), s["sharing"]["share_rate"]))


def _variant(s: dict) -> str:
    c = _comp(s)
    return f"block {c['block_size']}" + ("" if c["verify_kv"] else ", token match only")


def family_rows(rows: list[dict]) -> list[dict]:
    out = [s for s in rows if s["compressor"] == "trie" and s["workload"] in FAMILIES
           and _comp(s)["budget_tokens"] is None and _comp(s)["block_size"] == 16 and _comp(s)["verify_kv"]]
    best: dict[str, dict] = {}
    for s in out:  # one per family (a run with NLL on has the same bits)
        if s["workload"] not in best or not s["config"]["metrics"]["nll"]:
            best[s["workload"]] = s
    return sorted(best.values(), key=lambda s: s["sharing"]["share_rate"])


def budget_rows(rows: list[dict]) -> list[dict]:
    out = [s for s in rows if s["compressor"] == "trie" and _wl(s).get("n_sessions") == 96]
    return sorted(out, key=lambda s: (_policy(s), _comp(s)["budget_tokens"] or 1 << 60))


def _policy(s: dict) -> str:
    c = _comp(s)
    if c["policy"] == "lru":
        return "LRU"
    return "PLT" if c["plt_weight"] else "PLT, frequency only"


def compose_rows(rows: list[dict]) -> list[dict]:
    out = [s for s in rows if s["config"]["metrics"]["nll"] and (s["workload"] == "shared_system" or (
        s["workload"] == "mixed" and _wl(s).get("n_sessions") == 32 and _wl(s).get("target_share_rate") == 0.5))]
    order = ["identity", "trie", "kivi", "trie+kivi", "turboquant", "trie+turboquant", "delta", "trie+delta"]
    return sorted(out, key=lambda s: (s["workload"], order.index(_label(s)) if _label(s) in order else 99, _label(s)))


# ---- figures -----------------------------------------------------------------------------------------------
def _save(fig, name: str) -> None:
    FIGS.mkdir(parents=True, exist_ok=True)
    for ext in ("png", "pdf"):
        fig.savefig(FIGS / f"{name}.{ext}", dpi=200)
    print(f"-> results/figures/{name}.png / .pdf")


def figures(rows: list[dict]) -> None:
    import numpy as np
    from matplotlib.figure import Figure

    sw = sweep_rows(rows)
    if sw:
        fig = Figure(figsize=(5.2, 3.6), layout="constrained")
        ax = fig.subplots()
        s_grid = np.linspace(0, 0.95, 100)
        ax.plot(s_grid, 1 / (1 - s_grid), "k--", lw=1, label="exact dedup ideal 1/(1 - share)")
        for variant, marker in (("block 1", "o"), ("block 16", "s"), ("block 16, token match only", "^")):
            pts = [(s["sharing"]["share_rate"], s["compression_ratio"]) for s in sw if _variant(s) == variant]
            if pts:
                x, y = zip(*pts)
                exact = "exact" if "token" not in variant else "not bit-exact"
                ax.plot(x, y, marker=marker, label=f"trie, {variant} ({exact})")
        fam = family_rows(rows)
        if fam:
            ax.plot([s["sharing"]["share_rate"] for s in fam], [s["compression_ratio"] for s in fam], "D", color="tab:green",
                    label="trie, block 16, single-family workloads")
            for s in fam:
                ax.annotate(s["workload"], (s["sharing"]["share_rate"], s["compression_ratio"]), xytext=(-4, 4),
                            textcoords="offset points", fontsize=6, ha="right")
        lo, hi = min(h for h, _ in PRODUCTION), max(h for h, _ in PRODUCTION)
        ax.axvspan(lo, hi, color="grey", alpha=0.25, lw=0,
                   label="production hit rates: " + ", ".join(name for _, name in PRODUCTION))
        ax.set_xlabel("share rate (fraction of tokens in a prefix seen before)")
        ax.set_ylabel("compression ratio vs 16-bit KV")
        ax.set_title("Exact prefix dedup on the mixed workload (SmolLM2-135M, 32 sessions)", fontsize=8)
        ax.set_xlim(0, 1.0)
        ax.set_yscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
        _save(fig, "prefix_sharing_ratio")

    bu = budget_rows(rows)
    if bu:
        fig = Figure(figsize=(8.0, 3.2), layout="constrained")
        ax1, ax2 = fig.subplots(1, 2)
        ideal = next(s["sharing"]["ideal_hit_rate"] for s in bu)
        for policy, marker in (("LRU", "o"), ("PLT", "s"), ("PLT, frequency only", "^")):
            pts = [(s["prefix_cache"]["budget_tokens"], s["prefix_cache"]["hit_rate"], s["prefix_cache"]["memory_held_mean_tokens"])
                   for s in bu if _policy(s) == policy and _comp(s)["budget_tokens"] is not None]
            if pts:
                b, h, m = zip(*pts)
                ax1.plot(b, h, marker=marker, label=policy)
                ax2.plot(b, m, marker=marker, label=policy)
        ax1.axhline(ideal, color="k", ls="--", lw=1, label=f"unbounded ({ideal:.3f})")
        ax1.set_xscale("log", base=2)
        ax1.set_xlabel("cache budget (tokens of KV)")
        ax1.set_ylabel("token hit rate (prefill saved)")
        ax1.legend(fontsize=7)
        ax2.set_xscale("log", base=2)
        ax2.set_yscale("log", base=2)
        ax2.set_xlabel("cache budget (tokens of KV)")
        ax2.set_ylabel("mean KV held (tokens)")
        ax2.legend(fontsize=7)
        n = bu[0]["sharing"]["sessions"]
        fig.suptitle(f"Prefix cache under a budget: LRU vs PLT (mixed stream, {n} sessions, share rate "
                     f"{bu[0]['sharing']['share_rate']:.2f}, block 16)", fontsize=8)
        for ax in (ax1, ax2):
            ax.grid(alpha=0.3)
        _save(fig, "prefix_sharing_budget")

    co = compose_rows(rows)
    if co:
        wls = sorted({s["workload"] for s in co})
        fig = Figure(figsize=(4.2 * len(wls), 3.4), layout="constrained")
        axes = np.atleast_1d(fig.subplots(1, len(wls)))
        for ax, wl in zip(axes, wls):
            sub = [s for s in co if s["workload"] == wl]
            labels = [_label(s) for s in sub]
            vals = [s["bits_per_token"] for s in sub]
            colors = ["tab:orange" if lab.startswith("trie") else "tab:blue" for lab in labels]
            ax.bar(range(len(sub)), vals, color=colors)
            ax.set_xticks(range(len(sub)), labels, rotation=45, ha="right", fontsize=7)
            ax.set_yscale("log")
            ax.set_ylabel("bits / token (all layers, K and V)")
            share = sub[0]["sharing"]["share_rate"]
            ax.set_title(f"{wl} (share rate {share:.2f})", fontsize=8)
            for i, (v, r) in enumerate(zip(vals, [s["compression_ratio"] for s in sub])):
                ax.annotate(f"{v / 1000:.0f}k\n{r:.1f}x", (i, v), ha="center", va="bottom", fontsize=6)
            ax.set_ylim(8e3, 4e5)
            ax.grid(alpha=0.3, axis="y")
        _save(fig, "prefix_sharing_composition")


# ---- tables ------------------------------------------------------------------------------------------------
def tables(rows: list[dict]) -> str:
    lines = ["## Mixed-workload sweep (trie, unbounded)", "",
             "| target | share rate | ideal hit (block) | sessions | tokens | trie | bits/token | ratio | 1/(1-share) | lossless | max abs err | shared-prefix KV identical | tokens after first difference |",
             "|---:|---:|---:|---:|---:|:--|---:|---:|---:|:--:|---:|:--:|---:|"]
    for s in sweep_rows(rows):
        sh, kv = s["sharing"], s["shared_prefix_kv"]
        err = s.get("max_abs_err_k", float("nan"))
        lines.append(f"| {_wl(s)['target_share_rate']:.1f} | {sh['share_rate']:.3f} | {s['prefix_cache']['hit_rate']:.3f} | "
                     f"{sh['sessions']} | {sh['tokens']} | {_variant(s)} | {s['bits_per_token']:,.0f} | "
                     f"{s['compression_ratio']:.3f} | {sh['dedup_ratio']:.3f} | {s['lossless']} | {err:g} | "
                     f"{kv['identical_pairs']}/{kv['pairs']} (max diff {kv['max_abs_diff']:g}) | "
                     f"{kv.get('tokens_after_first_difference', '')} |")
    lines += ["", "## Single-family workloads (trie, block 16, unbounded)", "",
              "| workload | sessions | tokens | share rate | ideal hit (block 16) | bits/token | ratio | 1/(1-share) | lossless | shared-prefix KV identical |",
              "|:--|---:|---:|---:|---:|---:|---:|---:|:--:|:--:|"]
    for s in family_rows(rows):
        sh, kv = s["sharing"], s["shared_prefix_kv"]
        lines.append(f"| {s['workload']} | {sh['sessions']} | {sh['tokens']} | {sh['share_rate']:.3f} | "
                     f"{sh['ideal_hit_rate']:.3f} | {s['bits_per_token']:,.0f} | {s['compression_ratio']:.3f} | "
                     f"{sh['dedup_ratio']:.3f} | {s['lossless']} | {kv['identical_pairs']}/{kv['pairs']} (max diff {kv['max_abs_diff']:g}) |")
    lines += ["", "## Prefix cache under a budget (mixed, 96 sessions)", "",
              "| policy | budget (tokens) | hit rate | requests hit | prefill tokens saved | mean held | max held | bits/token | ratio |",
              "|:--|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in budget_rows(rows):
        c = s["prefix_cache"]
        lines.append(f"| {_policy(s)} | {c['budget_tokens'] if c['budget_tokens'] is not None else 'unbounded'} | "
                     f"{c['hit_rate']:.3f} | {c['request_hit_rate']:.3f} | {c['prefill_tokens_saved']} | "
                     f"{c['memory_held_mean_tokens']:.0f} | {c['memory_held_max_tokens']} | {s['bits_per_token']:,.0f} | "
                     f"{s['compression_ratio']:.3f} |")
    lines += ["", "## Composition: each compressor alone and under the trie", "",
              "| workload | compressor | bits/token | ratio | lossless | rel MSE K / V | delta NLL (nats) |",
              "|:--|:--|---:|---:|:--:|---:|---:|"]
    for s in compose_rows(rows):
        lines.append(f"| {s['workload']} | {_label(s)} | {s['bits_per_token']:,.0f} | {s['compression_ratio']:.3f} | "
                     f"{s['lossless']} | {s['rel_mse_k']:.2e} / {s['rel_mse_v']:.2e} | {s['delta_nll']:+.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["run", "figures", "cells"])
    args = p.parse_args()
    if args.what == "cells":
        for c in cells():
            print("python -m kvbench run " + " ".join(c))
        return
    if args.what == "run":
        run_all()
        return
    rows = load()
    figures(rows)
    OUT.mkdir(parents=True, exist_ok=True)
    text = tables(rows)
    (OUT / "tables.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
