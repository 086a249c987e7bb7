"""Capture overhead: KV capture (cache + copies + token log-probs) against a bare forward pass of the same tokens.

    python scripts/bench_capture.py [--seq-len 1024] [--repeats 5] [--model smollm2_135m]

Prints the median seconds of each and their ratio (target <= 1.15x).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvbench.core.config import compose
from kvbench.inputs.capture import capture_window
from kvbench.inputs.data import load_documents, sample_windows
from kvbench.inputs.models import ModelHandle


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default="smollm2_135m")
    args = p.parse_args()

    cfg = compose([f"model={args.model}"])
    handle = ModelHandle(cfg.model)
    ids = sample_windows(load_documents(cfg.dataset), handle.tokenizer, args.repeats, args.seq_len, seed=0)
    model = handle.model

    def bare(x):
        with torch.no_grad():
            model(x[None], use_cache=False)

    def cap(x):
        capture_window(model, x, args.seq_len, torch.float16)

    bare(ids[0])  # warm-up: first call pays allocator and kernel set-up
    cap(ids[0])
    times = {"bare forward": [], "capture": []}
    for x in ids:  # interleaved so drift in machine load hits both alike
        for name, fn in (("bare forward", bare), ("capture", cap)):
            t0 = time.perf_counter()
            fn(x)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model={args.model} seq_len={args.seq_len} repeats={args.repeats} threads={torch.get_num_threads()}")
    for k, v in med.items():
        print(f"  {k:<13} {v:.3f} s  ({args.seq_len / v:.0f} tok/s)")
    print(f"  overhead      {med['capture'] / med['bare forward']:.3f}x  (target <= 1.15x)")


if __name__ == "__main__":
    main()
