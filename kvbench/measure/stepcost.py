"""``python -m kvbench stepcost +compressor=recompute``: where a model-running coder's seconds go, against a plain
cached decode step of the same model on the same threads.

A coder that codes token ids under the model's own next-token distribution (arithmetic coding with a language
model, arXiv 2309.10668) runs the model one token at a time on a growing KV cache on both sides: the range decoder
needs each distribution before it can read the next id, and a batched prefill rounds differently from one-token
steps, so the encoder must step too for the two sides' probabilities to be bit-identical. Its cost per token can
therefore not fall below one cached decode step of the model, the step greedy generation pays per token. For a
coder that says it steps so (:meth:`kvbench.core.compressor.Compressor.next_token_model`), this command times, over
the first ``stepcost.tokens`` ids of one scored window of the run's trace, on the coder's threads:

- ``step``: a plain cached decode step, ``model(id, cache)`` with its logits;
- ``row``: the coder's step, the same call plus the float64 softmax of the logits and their copy to NumPy;
- ``code``: range coding of those rows, encode and decode together;
- ``encode`` / ``decode``: the coder's whole encode and decode of the window; ``decode`` includes the batched prefill
  that regenerates the KV from the decoded ids (``decode_prefill``: that part, from the coder's ``decode_prefill_s``
  stat of the same decode calls, where it reports one).

Each stage's seconds per coded token are the median of ``stepcost.repeats`` rounds after a warm-up round, the stages
in a seeded random order within each round (:func:`rounds`); every row carries the rounds' lowest and highest value
and its ratio to ``step``. A ``row`` near 1 says the model step is the cost, not the harness around it. The
decoded ids are checked against the window's (``ids_exact``).
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvbench.coding.entropy import StreamDecoder, StreamEncoder
from kvbench.core.compressor import Compressor
from kvbench.core.kv import Context
from kvbench.core.machine import conditions
from kvbench.core.next_token import torch_threads
from kvbench.inputs.capture import load_or_capture
from kvbench.inputs.models import ModelHandle, model_fields
from kvbench.store.results import git_sha

#: what each stage times, in the summary and on the terminal
STAGES = {
    "step": "plain cached decode step of the model (logits of one token)",
    "row": "the coder's step: the same call, float64 softmax, copy to NumPy",
    "code": "range coding of the rows, encode and decode",
    "encode": "the coder's whole encode of the window",
    "decode": "the coder's whole decode of the window, the regenerating prefill included",
    "decode_prefill": "the batched prefill inside decode that regenerates the KV from the ids",
}


def rounds(stages: dict[str, Callable[[], None]], n: int, repeats: int, seed: int) -> dict[str, list[float]]:
    """Seconds per token of each stage (``stages[name]()`` handles ``n`` tokens) in each of ``repeats`` rounds, after
    a warm-up round. Within a round the stages run in a seeded random order, so that a drift of the machine's speed
    falls on every stage alike."""
    for fn in stages.values():
        fn()
    rng = random.Random(seed)
    out: dict[str, list[float]] = {k: [] for k in stages}
    for _ in range(repeats):
        for k in rng.sample(list(stages), len(stages)):
            t0 = time.perf_counter()
            stages[k]()
            out[k].append((time.perf_counter() - t0) / n)
    return out


def check_settings(node: Any) -> tuple[int, int, int]:
    """``(tokens, repeats, window)`` of ``cfg.stepcost``, each a whole number in its range."""
    out = []
    for name, low in (("tokens", 2), ("repeats", 1), ("window", 0)):
        v = node.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"stepcost.{name}={v!r} must be a whole number of at least {low}")
        out.append(int(v))
    return out[0], out[1], out[2]


def measure_stepcost(cfg: Any, compressor: Compressor, handle: ModelHandle | None = None) -> tuple[dict, list[dict]]:
    """Every stage of :data:`STAGES` on ``cfg.stepcost``'s window; ``(summary, rows)``, one row per stage."""
    tokens, repeats, window = check_settings(cfg.stepcost)
    handle = handle or ModelHandle(cfg.model, cfg.device)
    model = handle.model
    lm = compressor.next_token_model(model)  # its first use computes the rows the code stage codes
    if lm is None:
        raise ValueError(f"stepcost times coders that run the model one token at a time to code token ids; "
                         f"{compressor.name!r} does not (its next_token_model() is None)")
    trace = load_or_capture(cfg, handle)
    if window >= len(trace.eval):
        raise ValueError(f"stepcost.window={window} is past the trace's {len(trace.eval)} scored windows")
    full = trace.eval[window].kv
    kv = full.slice_tokens(0, min(tokens, full.n_tokens))
    threads = lm.threads
    ids = kv.tokens.reshape(-1).to(torch.int64).numpy()  # (n + 1,)
    n = int(ids.size) - 1  # the steps that yield a coded row

    def steps(with_row: bool) -> Callable[[], None]:
        def run() -> None:
            lm = compressor.next_token_model(model)
            step = lm.after if with_row else lm.step
            for t in ids[:-1]:
                step(int(t))
        return run

    with torch_threads(threads):
        probs = np.stack([lm.after(int(t)) for t in ids[:-1]])  # (n, V) float64
    symbols = ids[1:]

    def code() -> None:
        enc = StreamEncoder()
        enc.categorical(symbols, probs)
        StreamDecoder(enc.finish()[0]).categorical(n, probs)

    ctx = Context.for_kv(kv, handle)
    stream = compressor.encode(kv, ctx)
    decoded = compressor.decode(stream, ctx)
    prefills: list[float] = []  # per decode call, the seconds of its regenerating prefill (the coder's stat)

    def decode() -> None:
        before = compressor.stats().get("decode_prefill_s", math.nan)
        compressor.decode(stream, ctx)
        prefills.append((compressor.stats().get("decode_prefill_s", math.nan) - before) / n)

    load_start = os.getloadavg()
    with torch_threads(threads) as threads:
        passes = rounds({"step": steps(False), "row": steps(True), "code": code,
                         "encode": lambda: compressor.encode(kv, ctx), "decode": decode}, n, repeats, int(cfg.seed))
    passes["decode_prefill"] = prefills[1:]  # the warm-up round's left out, as for every stage
    step = statistics.median(passes["step"])
    rows = [{"stage": k, "s_per_token": statistics.median(passes[k]), "over_step": statistics.median(passes[k]) / step,
             "s_per_token_lo": min(passes[k]), "s_per_token_hi": max(passes[k]), "passes_s_per_token": passes[k],
             "what": what} for k, what in STAGES.items()]
    summary = {
        "compressor": compressor.name,
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "kind": "stepcost",
        "window": window,
        "tokens": int(ids.size),
        "coded_tokens": n,
        "repeats": repeats,
        **conditions(threads, load_start[0]),
        "ids_exact": bool(torch.equal(decoded.tokens.reshape(-1).to(torch.int64), torch.from_numpy(ids))),
        **{f"{r['stage']}_s_per_token": r["s_per_token"] for r in rows},
        **{f"{r['stage']}_over_step": r["over_step"] for r in rows if r["stage"] != "step"},
        "rows": rows,
        **model_fields(handle, cfg),
        "device": cfg.device,
        # 1-minute load average at the start and the end: other jobs on a shared machine slow every stage alike
        "loadavg_1m": [load_start[0], os.getloadavg()[0]],
        "compressor_params": compressor.describe(),
        "git_sha": git_sha(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return summary, rows


def format_stepcost(s: dict) -> str:
    """One line per stage: milliseconds per coded token, the rounds' range, and the ratio to the plain decode step."""
    load = s.get("loadavg_1m", [float("nan")] * 2)
    lines = [f"  stepcost {s['compressor']} on {s['model']} / {s['dataset']}: {s['coded_tokens']} coded tokens of "
             f"window {s['window']}, {s['torch_threads']} thread(s), model {s['model_dtype']}, median of "
             f"{s['repeats']}, load {load[0]:.1f} -> {load[1]:.1f}; decoded ids exact: {s['ids_exact']}"]
    for r in s["rows"]:
        ratio = "" if r["stage"] == "step" else f"  {r['over_step']:6.3f}x step"
        spread = f"[{1e3 * r['s_per_token_lo']:.3f}, {1e3 * r['s_per_token_hi']:.3f}]"
        lines.append(f"  {r['stage']:15s} {1e3 * r['s_per_token']:9.3f} ms/token {spread:>19s}{ratio}   {r['what']}")
    return "\n".join(lines)
