"""Decode speed of the caches, interleaved: DynamicCache, CompressedCache (identity, KIVI 2-bit) and transformers'
QuantizedCache (HQQ 2-bit), one after another in every round on the same text, so that load drifting on a shared
machine slows every cache alike instead of whichever ran last (``python -m kvbench latency`` runs them in sequence).

    python scripts/bench_cache.py [--contexts 1024 4096] [--rounds 4] [--tokens 24] [--threads 1]

Prints the median per-token decode time of each cache per context and tokens/s ratios of medians: identity and
KIVI against DynamicCache, KIVI against QuantizedCache. Model in float32, caches storing float16, greedy tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from kvbench.cache.compressed import CompressedCache
from kvbench.core.config import compose, make_compressor
from kvbench.inputs.data import load_documents, sample_windows
from kvbench.inputs.models import ModelHandle
from kvbench.measure.baselines import TransformersQuantized


@torch.no_grad()
def per_token_ms(model, ids: torch.Tensor, cache, n: int) -> float:
    out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1:].argmax(-1)  # (1, 1)
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        out = model(nxt, cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        lat.append(time.perf_counter() - t)
    return 1e3 * statistics.median(lat)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default="smollm2_135m")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = compose([f"model={args.model}"])
    handle = ModelHandle(cfg.model)
    model = handle.model.float()
    text = sample_windows(load_documents(cfg.dataset), handle.tokenizer, 1, max(args.contexts), seed=0)[0]
    kivi = make_compressor(compose(["+compressor=kivi", "compressor.bits=2"]).compressor)
    identity = make_compressor(compose(["+compressor=identity"]).compressor)
    caches = {
        "dynamic": DynamicCache,
        "identity": lambda: CompressedCache(identity, residual=128, model=handle, dtype=torch.float16),
        "kivi2": lambda: CompressedCache(kivi, residual=128, model=handle, dtype=torch.float16),
        "hqq2": lambda: TransformersQuantized(nbits=2, q_group_size=64, residual_length=128).make(model.config),
    }
    for T in args.contexts:
        ids = text[:T].unsqueeze(0)
        got = {name: [] for name in caches}
        for _ in range(args.rounds):
            for name, make in caches.items():
                got[name].append(per_token_ms(model, ids, make(), args.tokens))
        med = {name: statistics.median(v) for name, v in got.items()}
        print(f"{T} tokens, {args.rounds} rounds x {args.tokens} decoded, {args.threads} thread(s): "
              + ", ".join(f"{n} {m:.1f} ms" for n, m in med.items()))
        print(f"  tokens/s ratios: identity/dynamic {med['dynamic'] / med['identity']:.3f}, kivi2/dynamic "
              f"{med['dynamic'] / med['kivi2']:.3f}, kivi2/QuantizedCache(HQQ 2-bit) {med['hqq2'] / med['kivi2']:.3f}")


if __name__ == "__main__":
    main()
