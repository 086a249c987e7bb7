"""Order-0 entropy of the ways to split a 16-bit KV cache into fields, per histogram grouping.

    python scripts/byte_planes.py [OVERRIDES...]      e.g. dtype=bfloat16, dataset.n_sequences=1

Takes the trace's first evaluated sequence, rounds its values to float16 and to bfloat16, and prints the
empirical entropy (bits per element, no side information) of each candidate field when one histogram is fitted
per tensor, layer, head or channel: the floor a static per-group model of that field can reach before paying
for its histograms, and what `compressors/exact/lossless.py`'s choice of split rests on. Per-channel figures of wide
alphabets are optimistic: 1024 samples cannot pin down a 256-bin histogram.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from kvbench.core.config import compose
from kvbench.inputs.capture import load_or_capture
from kvbench.inputs.models import ModelHandle

FIELDS = {
    torch.float16: {  # s | e5 | m10
        "hi byte = s e5 m2": lambda u: u >> 8,
        "lo byte = m8": lambda u: u & 0xFF,
        "s e5 (6 bits)": lambda u: u >> 10,
        "m10 (10 bits)": lambda u: u & 0x3FF,
    },
    torch.bfloat16: {  # s | e8 | m7
        "hi byte = s e7": lambda u: u >> 8,
        "lo byte = e1 m7": lambda u: u & 0xFF,
        "exp byte = e8": lambda u: (u >> 7) & 0xFF,
        "s m7 byte": lambda u: ((u >> 15) << 7) | (u & 0x7F),
    },
}


def entropy_bits(groups: np.ndarray) -> float:
    """Sum over groups (rows) of count x empirical entropy."""
    G = groups.shape[0]
    K = int(groups.max()) + 1
    c = np.bincount((np.arange(G)[:, None] * K + groups).reshape(-1), minlength=G * K).reshape(G, K).astype(float)
    p = np.where(c > 0, c / c.sum(1, keepdims=True), 1.0)
    return float(-(c * np.log2(p)).sum())


def main(argv: list[str]) -> None:
    cfg = compose(argv)
    seq = load_or_capture(cfg, ModelHandle(cfg.model, cfg.device)).eval[0].kv
    print(f"trace: {cfg.model.name} / {cfg.dataset.name}, one sequence of {seq.n_tokens} tokens, stored as {cfg.dtype}")
    print("bits per element (order-0 empirical entropy, histogram per group, no side information)\n")
    print(f"{'view':<9} {'kind':<4} {'field':<20} {'tensor':>7} {'layer':>7} {'head':>7} {'channel':>8}")
    for dtype, fields in FIELDS.items():
        for kind, x in (("k", seq.k), ("v", seq.v)):
            u = x.float().to(dtype).view(torch.int16).numpy().view(np.uint16).astype(np.int64)  # (L, H, T, D)
            L, H, T, D = u.shape
            for name, f in fields.items():
                cm = f(u).transpose(0, 1, 3, 2).reshape(L, H, D, T)  # channel-major
                row = [entropy_bits(cm.reshape(g, -1)) / u.size for g in (1, L, L * H, L * H * D)]
                print(f"{str(dtype).removeprefix('torch.'):<9} {kind:<4} {name:<20} " + " ".join(f"{r:7.3f}" for r in row[:3])
                      + f" {row[3]:8.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
