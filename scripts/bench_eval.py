"""Seconds per RULER example of ``python -m kvbench eval`` at one length, and where they go.

    python scripts/bench_eval.py [--compressor kivi] [--length 1024] [--per-family 2] [--families ruler_vt ruler_fwe ...]
                                 [--threads 2] [--protocol context_only] [--cells 2] [--prefills new|auto|none|DIR]
                                 [--json out.json]

Runs the evaluation as the CLI does (lm-eval's compressed pass, then the baseline's answers replayed through it) on
``per-family`` examples of each family at ``length`` tokens, and times each request's steps by wrapping the model
class's methods: the context's 16-bit prefill with its loading into both caches (the compressor's encode and the
decode of what it stored included), and the query and answer generated on each side. Prints seconds per example
in all and per step; the rest is lm-eval's own work (building tasks, filters and metrics, the replayed pass). The
task data is built first and not counted (it is written once per setting and then read). ``--cells 2`` runs the
cell again in the same process, as a sweep of eval cells does: there the baseline's answers are kept from the
first cell, so the second shows what every later cell of a sweep costs. ``--prefills`` is where the contexts' 16-bit
prefills and the baseline's answers are kept (``paths.prefills``): ``new`` (the default) a fresh folder, so the first
cell computes and keeps them and every later cell (``--cells 2``) loads them, as a cell of a later process would;
``auto`` the store under ``KVBENCH_HOME``; ``none`` keeps none (every cell prefills every context). ``--json``
also writes each cell's figures, the commit and the machine's load (``results/bench_eval.json``: taken on a quiet
machine, under the benchmark lock).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from kvbench.core.config import compose, make_compressor
from kvbench.core.machine import conditions, load_average
from kvbench.inputs.models import ModelHandle
from kvbench.measure.evaluation import ruler
from kvbench.measure.evaluation.evaluate import build_lm, pair_task, run_passes
from kvbench.measure.evaluation.tasks import task_specs
from kvbench.store.atomic import write_json
from kvbench.store.results import git_sha

FAMILIES = ("ruler_niah_single_number_essay", "ruler_niah_multivalue", "ruler_vt", "ruler_cwe", "ruler_fwe")


def timed(obj: Any, name: str, spent: dict[str, float], label: Any = None) -> None:
    """Replace ``obj.name`` by a wrapper that adds its wall time to ``spent[label(args) or name]``."""
    inner = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label(args) if label else name] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2_135m")
    p.add_argument("--compressor", default="kivi")
    p.add_argument("--set", nargs="*", default=["compressor.bits=2"], help="compressor overrides, e.g. compressor.bits=2")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--per-family", type=int, default=2)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(ruler.FAMILIES))
    p.add_argument("--protocol", default="context_only")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--cells", type=int, default=1)
    p.add_argument("--prefills", default="new", help="new (a fresh folder), auto (KVBENCH_HOME's), none, or a folder")
    p.add_argument("--json", type=Path, help="also write each cell's figures here")
    args = p.parse_args()
    fresh = tempfile.TemporaryDirectory(prefix="kvbench-prefills-") if args.prefills == "new" else None
    prefills = fresh.name if fresh else ("null" if args.prefills == "none" else args.prefills)
    torch.set_num_threads(args.threads)
    cfg = compose([f"model={args.model}", f"+compressor={args.compressor}", *args.set, f"protocol={args.protocol}",
                   f"ruler.lengths=[{args.length}]", f"limit={args.per_family}",
                   f"ruler.per_length={max(args.per_family, 1)}", "tasks=[" + ",".join(args.families) + "]",
                   f"paths.prefills={prefills}"], "eval")
    OmegaConf.set_struct(cfg, False)
    handle = ModelHandle(cfg.model, cfg.device)

    load = load_average()
    cells: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    specs = task_specs(list(cfg.tasks), cfg, handle.tokenizer)
    data_s = time.perf_counter() - t0
    for cell in range(args.cells):
        lm, fit_s = build_lm(cfg, make_compressor(cfg.compressor), handle, progress=False)
        spent: dict[str, float] = defaultdict(float)
        timed(lm, "caches", spent, lambda a: "prefill + code context")
        timed(lm, "generate", spent, lambda a: f"query + answer, {'compressed' if a[0].compressor is not None else 'baseline'}")
        t0 = time.perf_counter()
        passes = run_passes(lm, specs, cfg)
        total = time.perf_counter() - t0
        rows = [r for spec in specs for r in pair_task(spec, passes, lm)[1]]
        n = len(rows)
        acc = lm.accounting
        print(f"cell {cell + 1}: {args.compressor} {' '.join(args.set)} on {args.model}, {args.protocol}, {args.length} "
              f"tokens, {n} examples of {len(specs)} families, {args.threads} threads (data {data_s:.1f} s, fit "
              f"{fit_s:.1f} s, not counted)")
        print(f"  {'all':<34} {total / n:7.2f} s/example")
        for step, s in sorted(spent.items(), key=lambda kv: -kv[1]):
            print(f"  {step:<34} {s / n:7.2f} s/example")
        print(f"  {'  of which encode / decode':<34} {acc['encode_s'] / n:7.2f} / {acc['decode_s'] / n:.2f} s/example")
        print(f"  {'lm-eval and the rest':<34} {(total - sum(spent.values())) / n:7.2f} s/example")
        print(f"  contexts whose prefill was loaded from the store: {acc['stored_prefills']:.0f} of {acc['contexts']:.0f}")
        print(f"  generated tokens (compressed side) {acc['generated_tokens'] / n:.1f} per example; "
              f"accuracy base {sum(r['base'] for r in rows) / n:.2f}, compressed {sum(r['comp'] for r in rows) / n:.2f}")
        cells.append({"cell": cell + 1, "examples": n, "s_per_example": total / n,
                      "steps_s_per_example": {k: v / n for k, v in spent.items()},
                      "encode_s_per_example": acc["encode_s"] / n, "decode_s_per_example": acc["decode_s"] / n,
                      "contexts_from_store": int(acc["stored_prefills"]), "contexts": int(acc["contexts"]),
                      "fit_s": fit_s})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"model": args.model, "compressor": args.compressor, "set": args.set, "length": args.length,
                "families": args.families, "per_family": args.per_family, "protocol": args.protocol,
                "prefills": args.prefills, "git_sha": git_sha(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **conditions(args.threads, load)}
        write_json(args.json, {"meta": meta, "cells": cells})
        print(f"-> {args.json}")


if __name__ == "__main__":
    main()
