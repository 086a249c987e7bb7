"""Radix-trie scaling: insert and lookup time and memory for synthetic request streams of up to 100,000 sessions.

Each session is one of ``--prompts`` shared prompts (Zipf popularity, ``--prompt-len`` tokens) followed by its
own tokens (uniform length in [32, 2 * --tail-len - 32]). Timings are wall-clock on this machine; run it alone:

    flock /tmp/kvbench-bench.lock .venv/bin/python scripts/bench_trie.py

Writes results/prefix_sharing/trie_scaling.json and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import tracemalloc
from pathlib import Path

import numpy as np

from kvbench.core.prefix_cache import replay
from kvbench.core.radix import RadixTrie


def stream(n: int, prompts: int, prompt_len: int, tail_len: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    heads = rng.integers(0, 49152, (prompts, prompt_len))
    pick = np.minimum(rng.zipf(1.2, n) - 1, prompts - 1)
    lens = rng.integers(32, 2 * tail_len - 32 + 1, n)
    return [np.concatenate([heads[pick[i]], rng.integers(0, 49152, lens[i])]) for i in range(n)]


def build(seqs: list[np.ndarray], block: int) -> tuple[RadixTrie, float]:
    trie = RadixTrie(block)
    t0 = time.perf_counter()
    for i, s in enumerate(seqs):
        trie.insert(s, owner=i)
    return trie, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, nargs="+", default=[10_000, 30_000, 100_000])
    p.add_argument("--prompts", type=int, default=1000)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--tail-len", type=int, default=100)
    p.add_argument("--out", default="results/prefix_sharing/trie_scaling.json")
    args = p.parse_args()
    rows = []
    for n in args.sessions:
        seqs = stream(n, args.prompts, args.prompt_len, args.tail_len)
        tokens = int(sum(s.size for s in seqs))
        for block in (1, 16):
            gc.collect()
            trie, t_ins = build(seqs, block)
            t0 = time.perf_counter()
            hit = sum(trie.match(s).tokens for s in seqs)
            t_look = time.perf_counter() - t0
            unique, nodes = trie.n_tokens, trie.n_nodes
            del trie
            gc.collect()
            tracemalloc.start()
            trie, _ = build(seqs, block)  # the same build, measured for memory (slower under tracemalloc)
            mem, _ = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            del trie
            row = {"sessions": n, "tokens": tokens, "block_size": block, "unique_tokens": unique, "nodes": nodes,
                   "insert_s": t_ins, "lookup_s": t_look, "insert_Mtok_per_s": tokens / t_ins / 1e6,
                   "lookup_Mtok_per_s": tokens / t_look / 1e6, "lookup_hit_tokens": hit, "memory_bytes": mem,
                   "bytes_per_unique_token": mem / unique}
            rows.append(row)
            print(f"{n:>7} sessions {tokens / 1e6:6.1f}M tok  block {block:>2}: insert {t_ins:6.2f} s "
                  f"({row['insert_Mtok_per_s']:5.1f} M tok/s)  lookup {t_look:6.2f} s  unique {unique / 1e6:6.2f}M "
                  f"nodes {nodes:>7}  memory {mem / 1e6:7.1f} MB ({row['bytes_per_unique_token']:.1f} B/unique tok)")
        # cache replays on the largest stream: throughput of LRU and PLT under a budget
        if n == max(args.sessions):
            lps = [np.full(s.size, -2.0) for s in seqs]
            budget = args.prompts * args.prompt_len // 4
            for policy in ("lru", "plt"):
                t0 = time.perf_counter()
                r = replay(seqs, 16, budget, policy, logprobs=lps)
                dt = time.perf_counter() - t0
                rows.append({"sessions": n, "tokens": tokens, "replay_policy": policy, "budget_tokens": budget,
                             "replay_s": dt, "hit_rate": r.hit_rate})
                print(f"{n:>7} sessions replay {policy} budget {budget}: {dt:6.2f} s, hit rate {r.hit_rate:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
