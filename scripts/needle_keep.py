"""Which tokens of a RULER needle each eviction method keeps, under context-only and query-aware compression.

    python scripts/needle_keep.py [--model smollm2_135m] [--family ruler_niah_single_number_noise] [--n 5]
                                  [--length 1024] [--keep 0.5] [--methods snapkv streaming_llm ...]

For the first ``n`` examples of a single-needle family (the ones the RULER study scores), prefills the segment
each protocol compresses, scores it with each method at ``keep`` and prints the needle's depth and, per method
and protocol, the share of (layer, KV head) pairs that keep every token of the needle's value ("whole") and the
share that keep some of its tokens but not all ("part"). Nothing is timed. The mechanism it shows is asserted by
tests/test_needle.py.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvbench.core.config import compose, make_compressor
from kvbench.inputs.models import ModelHandle
from kvbench.measure.evaluation import ruler
from kvbench.measure.evaluation.needle import PROTOCOLS, needle_kept
from kvbench.measure.evaluation.tasks import uses_chat_template

METHODS = ("snapkv", "tova", "h2o", "expected_attention", "knorm", "streaming_llm")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2_135m")
    p.add_argument("--family", default="ruler_niah_single_number_noise")
    p.add_argument("--n", type=int, default=5)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--keep", type=float, default=0.5)
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    args = p.parse_args()
    cfg = compose([f"model={args.model}"], "eval")
    handle = ModelHandle(cfg.model, cfg.device)
    chat = uses_chat_template(cfg, handle.tokenizer)
    path = ruler.ruler_data(handle.tokenizer, args.family, args.length, max(args.n, cfg.ruler.per_length), cfg.seed, chat)
    rows = [json.loads(line) for line in path.read_text().splitlines()][: args.n]
    methods = {m: make_compressor(compose([f"model={args.model}", f"+compressor={m}", f"compressor.keep={args.keep}"],
                                          "eval").compressor) for m in args.methods}
    print(f"{args.model}, {args.family} at {args.length} tokens, keep {args.keep}: share of (layer, KV head) pairs "
          "keeping the needle's value whole / in part")
    print(f"{'example':>7} {'depth':>6} {'protocol':<13}" + "".join(f"{m:>22}" for m in methods))
    for r in rows:
        for protocol in PROTOCOLS:
            got = needle_kept(handle, methods, r, protocol)
            first = next(iter(got.values()))
            depth = first.needle[0] / first.tokens
            print(f"{r['id']:>7} {depth:>6.2f} {protocol:<13}"
                  + "".join(f"{g.whole:>14.2f} / {g.some:.2f}" for g in got.values()), flush=True)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
