"""Where recompute's seconds go: its per-token model step against a plain cached decode step of the same model.

    flock /tmp/kvbench-bench.lock .venv/bin/python scripts/bench_recompute.py [--tokens 256] [--threads 1]
                                                                            [--json out.json] [OVERRIDE ...]

Recompute (``compressors/exact/recompute.py``) codes a window's token ids under the model's own next-token
distribution, so its encoder and decoder both run the model one token at a time on a growing KV cache (a batched
prefill rounds differently, and the range decoder needs bit-identical rows). This script times, over the first
``--tokens`` ids of the first scored window of the configured trace, on ``--threads`` intra-op threads:

- ``step``: a plain cached decode step, ``model(ids, cache)`` with its logits (what greedy generation pays per
  token, the floor for any one-token-at-a-time decoder);
- ``row``: recompute's step, the same call plus the float64 softmax of the logits and their copy to NumPy;
- ``code``: the range coder's encoding and decoding of those rows, per token;
- ``encode`` / ``decode``: recompute's whole encode and decode of the window, per token (the decode adds the
  prefill that regenerates the KV from the ids).

Each is the median over ``--repeats`` passes after a warm-up pass. Prints the ratios to ``step``: a ``row`` near 1
means the model is what costs, not the harness around it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from compressors.exact.recompute import NextTokenModel, Recompute, intra_op_threads
from kvbench.coding.entropy import StreamDecoder, StreamEncoder
from kvbench.core.config import compose
from kvbench.core.kv import Context
from kvbench.inputs.capture import load_or_capture
from kvbench.inputs.models import ModelHandle
from kvbench.store.atomic import write_json


def per_token(fn, n: int, repeats: int) -> float:
    """Median seconds per token of ``fn()`` (which handles ``n`` tokens) over ``repeats`` passes after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256, help="ids of the window to run (default 256)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads, as recompute's field (default 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("override", nargs="*", help="Hydra overrides (model=..., dataset=...)")
    args = ap.parse_args(argv)

    cfg = compose(args.override)
    handle = ModelHandle(cfg.model, cfg.device)
    kv = load_or_capture(cfg, handle).eval[0].kv.slice_tokens(0, args.tokens)
    model = handle.model
    ids = kv.tokens.reshape(-1).to(torch.int64).numpy()  # (n,)
    n = int(ids.size) - 1  # the steps that yield a coded row

    def steps(row: bool):
        @torch.no_grad()
        def run():
            lm = NextTokenModel(model)
            for t in ids[:-1]:
                if row:
                    lm.after(int(t))
                else:
                    lm.model(torch.tensor([[int(t)]], device=lm.device), cache=lm.cache, use_cache=True)
        return run

    with intra_op_threads(args.threads):
        lm = NextTokenModel(model)
        probs = np.stack([lm.after(int(t)) for t in ids[:-1]])  # (n, V) float64
    symbols = ids[1:]

    def code():
        enc = StreamEncoder()
        enc.categorical(symbols, probs)
        StreamDecoder(enc.finish()[0]).categorical(n, probs)

    comp, ctx = Recompute(threads=args.threads), Context.for_kv(kv, handle)
    stream = comp.encode(kv, ctx)
    with intra_op_threads(args.threads):
        out = {"model": str(cfg.model.name), "tokens": int(ids.size), "threads": args.threads,
               "step_s": per_token(steps(False), n, args.repeats), "row_s": per_token(steps(True), n, args.repeats)}
    out["code_s"] = per_token(code, n, args.repeats)
    out["encode_s"] = per_token(lambda: comp.encode(kv, ctx), n, args.repeats)
    out["decode_s"] = per_token(lambda: comp.decode(stream, ctx), n, args.repeats)
    out["load_average_1min"] = os.getloadavg()[0]
    for k in ("row_s", "code_s", "encode_s", "decode_s"):
        out[k.replace("_s", "_over_step")] = out[k] / out["step_s"]
    print(f"{out['model']}, {n} coded tokens, {args.threads} thread(s), load {out['load_average_1min']:.2f}")
    for k in ("step", "row", "code", "encode", "decode"):
        ratio = "" if k == "step" else f"  ({out[f'{k}_over_step']:.2f}x step)"
        print(f"  {k:7s} {1e3 * out[f'{k}_s']:8.2f} ms/token{ratio}")
    if args.json:
        write_json(Path(args.json), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
