"""Public block-hash request traces: sharing statistics and cache replays for a user who has such a file.

Serving traces are published without text, as one JSON object per line whose ``hash_ids`` name the prompt's
blocks; equal ids mean equal blocks *and* equal prefixes before them (ids are chained hashes), so the id
sequences form the same prefix trie as the tokens would. Mooncake (``mooncake_trace.jsonl``, FAST'25) uses 512
tokens per block; Alibaba's Qwen traces name the block size in the file name (``..._blksz_16.jsonl``).
``input_length`` (when present) gives the real prompt length; the last block may be partial.

    python -m kvbench.inputs.workloads.hash_trace TRACE.jsonl [--block-tokens 512] [--budget N ...]
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from kvbench.inputs.workloads.base import Session, Workload

MOONCAKE_BLOCK_TOKENS = 512


def infer_block_tokens(path: Path) -> int:
    m = re.search(r"blk_?sz_?(\d+)", path.name, flags=re.I)
    return int(m.group(1)) if m else MOONCAKE_BLOCK_TOKENS


def read_hash_trace(path: str | Path, block_tokens: int | None = None, limit: int | None = None) -> Workload:
    """Sessions whose 'tokens' are block ids, in file order; ``id_tokens`` = tokens per block."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"block-hash trace {path} does not exist")
    bt = int(block_tokens or infer_block_tokens(path))
    if bt < 1:
        raise ValueError(f"block_tokens={bt} must be >= 1")
    sessions, lengths = [], []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n} is not a JSON line ({e.msg})") from e
            ids = row.get("hash_ids") if isinstance(row, dict) else None
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise ValueError(f"{path}:{n} has no 'hash_ids' list of integers (the Mooncake / Alibaba trace format)")
            length = int(row.get("input_length", len(ids) * bt))
            group = str(row.get("chat_id", row.get("session_id", "")))
            sessions.append(Session(np.asarray(ids, dtype=np.int64), "trace", group))
            lengths.append(length)
            if limit is not None and len(sessions) >= limit:
                break
    return Workload(path.stem, sessions, {"path": str(path), "block_tokens": bt}, id_tokens=bt, prompt_tokens=lengths)


def trace_report(path: str | Path, block_tokens: int | None = None, budgets: list[int] | None = None,
                 limit: int | None = None) -> dict:
    """Sharing statistics (ideal hit rate = unbounded cache) and LRU / PLT replays at the given budgets (tokens).

    Without token log-probabilities the PLT priority is frequency-only (GreedyDual-Size-Frequency)."""
    from kvbench.core.prefix_cache import replay

    wl = read_hash_trace(path, block_tokens, limit)
    seqs = [s.tokens for s in wl.sessions]
    out = {"trace": str(path), "block_tokens": wl.id_tokens, "sharing": wl.stats(block_size=1), "replay": []}
    for budget in budgets or []:
        ids_budget = budget // wl.id_tokens
        for policy in ("lru", "plt"):
            r = replay(seqs, 1, ids_budget, policy, id_tokens=wl.id_tokens, prompt_tokens=wl.prompt_tokens)
            row = r.summary()
            row.update(budget_tokens=ids_budget * wl.id_tokens, memory_held_mean_tokens=r.held_mean_tokens * wl.id_tokens,
                       memory_held_max_tokens=r.held_max_tokens * wl.id_tokens, evicted_tokens=r.evicted_tokens * wl.id_tokens)
            out["replay"].append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvbench.inputs.workloads.hash_trace", description=__doc__.splitlines()[0])
    p.add_argument("trace", help="JSONL file with a hash_ids list per line")
    p.add_argument("--block-tokens", type=int, default=None, help="tokens per id (default: from the file name, else 512)")
    p.add_argument("--budget", type=int, action="append", help="cache budget in tokens for LRU/PLT replays (repeatable)")
    p.add_argument("--limit", type=int, default=None, help="read only the first N requests")
    args = p.parse_args(argv)
    print(json.dumps(trace_report(args.trace, args.block_tokens, args.budget, args.limit), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
