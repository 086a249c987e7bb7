"""End-to-end latency and memory of decoding with a :class:`~kvbench.cache.compressed.CompressedCache` against a plain
``DynamicCache``, in the same process on the same text.

For each context length: prefill (the compressed cache codes its prefix at the end of it; that time is reported
apart as compression), then greedy decoding of ``decode_tokens`` tokens in a hand-written loop, one forward pass
per token (each pass of the compressed cache decodes its segments from bytes and codes a chunk when the window
fills). Reported: prefill and compression seconds, per-token latency (median and p95), tokens/s, bytes the cache
holds afterwards, and peak resident memory during the run (:class:`~kvbench.core.timing.PeakRSS` on the CPU, CUDA's
peak allocation on a GPU).

Like for like: every cache holds its KV in the run's cache ``dtype`` (the plain ``DynamicCache`` too, through
:class:`StoredLayer`), while the model computes in the dtype it was loaded in (``latency.model_dtype=auto``: ``model.dtype``,
by default float32 on a CPU, where half precision is emulated, and bfloat16 on a GPU). After a warm-up round, each context runs
``latency.rounds`` rounds; within a round the caches run in a seeded random order, so drift in the machine's load
favours none. A row holds the median over rounds of each figure and ``tokens_per_s_iqr``, the interquartile range of
tokens/s across rounds.

``latency.baselines`` adds caches other libraries ship (:mod:`kvbench.measure.baselines`, e.g. transformers'
``QuantizedCache`` with HQQ) as more rows of the same run: same text, contexts and loop, bytes counted from the
backend's own tensors; their ratios are taken against the plain cache, and the compressed cache's against theirs.
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvbench.cache.compressed import CompressedCache
from kvbench.cache.window_layer import assemble
from kvbench.core.codec import prepare
from kvbench.core.compressor import Compressor
from kvbench.core.machine import conditions
from kvbench.core.timing import PeakRSS
from kvbench.inputs.capture import cache_dtype, calib_windows
from kvbench.inputs.data import load_documents, sample_windows
from kvbench.inputs.models import ModelHandle, model_fields
from kvbench.measure.baselines import make_baselines
from kvbench.store.results import git_sha


class Memory:
    """Peak memory of one run: resident set on the CPU, allocated memory on a CUDA device."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda") and torch.cuda.is_available()
        self._rss = PeakRSS()

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self._rss.start()
            self.base = self._rss.base

    def peak(self) -> tuple[int, int]:
        """``(peak bytes, peak bytes above the start)`` since :meth:`start`; ends the measurement."""
        peak = torch.cuda.max_memory_allocated() if self.cuda else self._rss.stop()
        return peak, max(peak - self.base, 0)

    def __enter__(self) -> Memory:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.cuda:
            self._rss.stop()  # a run that raised must not leave the sampling thread behind


def _sync(device: str) -> None:
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


class StoredLayer(DynamicLayer):
    """transformers' ``DynamicLayer`` holding its KV in a storage dtype, so that the plain cache of a latency run
    holds what the compressed cache holds. Attention gets the stored tokens converted to the compute dtype and the new
    tokens as the model computed them, as :class:`~kvbench.cache.compressed.CompressedCache` hands them over."""

    def __init__(self, store: torch.dtype) -> None:
        super().__init__()
        self.store = store

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys = key_states.new_zeros((*key_states.shape[:-2], 0, key_states.shape[-1]), dtype=self.store)
        self.values = value_states.new_zeros((*value_states.shape[:-2], 0, value_states.shape[-1]), dtype=self.store)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.dtype == self.store:
            return super().update(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        ks = assemble([self.keys, key_states], key_states.dtype)  # (1, H, T, D) in the compute dtype
        vs = assemble([self.values, value_states], value_states.dtype)
        self.keys = torch.cat([self.keys, key_states.to(self.store)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(self.store)], dim=-2)
        return ks, vs


def dynamic_cache(store: torch.dtype) -> DynamicCache:
    """A ``DynamicCache`` whose layers hold ``store``."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = lambda: StoredLayer(store)
    return cache


def compute_dtype(model_dtype: str, cache_dtype_name: str, loaded: torch.dtype) -> torch.dtype:
    """``latency.model_dtype``: ``auto`` (the dtype the model was ``loaded`` in: ``model.dtype``), ``cache``, or a
    dtype name."""
    if model_dtype == "auto":
        return loaded
    if model_dtype == "cache":
        return cache_dtype(cache_dtype_name)
    if model_dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"latency.model_dtype={model_dtype!r} is not allowed; one of [auto, cache, float32, float16, "
                         "bfloat16]")
    return getattr(torch, model_dtype)


def over_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the same cache's rounds: the median of every figure, the interquartile range of tokens/s and the
    first round's tokens (greedy decoding gives the same tokens every round)."""
    row = {k: float(np.median([r[k] for r in runs])) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
           for k, v in runs[0].items()}
    tps = np.array([r["tokens_per_s"] for r in runs], dtype=float)
    q25, q75 = np.percentile(tps, [25, 75])
    return {**row, "tokens_per_s_iqr": float(q75 - q25), "tokens_per_s_rounds": tps.tolist(), "rounds": len(runs),
            "tokens": runs[0]["tokens"]}


def dynamic_nbytes(cache: Any) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


@torch.no_grad()
def run_once(model: Any, ids: torch.Tensor, cache: Any, n_decode: int, device: str,
             nbytes: Callable[[Any], int] | None = None) -> dict[str, Any]:
    """Prefill ``ids`` (1, T) into ``cache``, then decode ``n_decode`` tokens greedily; times and memory.
    ``nbytes(cache)`` counts the bytes it holds at the end (default: the compressed cache's own count, or the
    plain cache's keys and values)."""
    with Memory(device) as mem:
        compressed = isinstance(cache, CompressedCache)
        _sync(device)
        t0 = time.perf_counter()
        out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
        _sync(device)
        prefill_wall = time.perf_counter() - t0
        after_prefill = cache.stats() if compressed else {"encode_s": 0.0, "decode_s": 0.0}
        tokens, lat = [int(nxt)], []
        for _ in range(n_decode):
            t = time.perf_counter()
            out = model(nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            _sync(device)
            lat.append(time.perf_counter() - t)
            tokens.append(int(nxt))
        peak, peak_delta = mem.peak()
    lat_a = np.array(lat)
    end = cache.stats() if compressed else {"encode_s": 0.0, "decode_s": 0.0}
    row = {
        "prefill_s": prefill_wall - after_prefill["encode_s"],
        "compress_s": after_prefill["encode_s"],
        "decode_median_ms": float(np.median(lat_a) * 1e3) if lat else math.nan,
        "decode_p95_ms": float(np.percentile(lat_a, 95) * 1e3) if lat else math.nan,
        "tokens_per_s": n_decode / float(lat_a.sum()) if lat else math.nan,
        "decode_total_s": float(lat_a.sum()),
        # time inside the decode loop spent decoding segments and coding new chunks
        "decode_decompress_s": end["decode_s"] - after_prefill["decode_s"],
        "decode_compress_s": end["encode_s"] - after_prefill["encode_s"],
        "bytes_held": nbytes(cache) if nbytes else cache.nbytes() if compressed else dynamic_nbytes(cache),
        "peak_mem_bytes": peak,
        "peak_mem_delta_bytes": peak_delta,
        "tokens": tokens,
    }
    if compressed:
        row.update({f"cache_{k}": v for k, v in end.items()})
    return row


def measure_latency(cfg: Any, compressor: Compressor, handle: ModelHandle | None = None) -> tuple[dict, list[dict]]:
    """Run every context length with the plain cache, the compressed cache and each of ``latency.baselines``;
    return ``(summary, rows)``."""
    handle = handle or ModelHandle(cfg.model, cfg.device)
    lat, cache = cfg.latency, cfg.cache
    contexts = [int(c) for c in lat.contexts]
    if not contexts or min(contexts) < 2:
        raise ValueError(f"latency.contexts={contexts} must list context lengths of at least 2 tokens")
    model = handle.model
    # before anything slow: a baseline that is unknown or not installed fails here
    baselines = make_baselines(lat.get("baselines"), lat.get("quantized_cache"), compressor, cache.residual, model.config)
    config = model.config if compressor.needs_config else None
    fit_s = prepare(compressor, lambda: calib_windows(cfg, handle), cfg.device, config=config).fit_s
    dev = cfg.device
    model_dtype = compute_dtype(str(lat.model_dtype), cfg.dtype, next(model.parameters()).dtype)
    model.to(model_dtype)
    rounds = int(lat.rounds)
    if rounds < 1:
        raise ValueError(f"latency.rounds={rounds} must be at least 1")
    window = sample_windows(load_documents(cfg.dataset), handle.tokenizer, 1, max(contexts), int(cfg.seed))[0]
    store = cache_dtype(cfg.dtype)
    stored = str(store).replace("torch.", "")
    # name -> (new empty cache, its byte count or None for run_once's own, fields every row of it carries)
    make: dict[str, tuple[Callable[[], Any], Callable[[Any], int] | None, dict]] = {
        "dynamic": (lambda: dynamic_cache(store), None, {"label": f"DynamicCache ({stored})"}),
        "compressed": (lambda: CompressedCache(compressor, residual=cache.residual, chunk=int(cache.chunk),
                                               mode=str(cache.mode), model=handle, dtype=store),
                       None, {"label": f"CompressedCache ({compressor.name})"}),
    }
    for name, b in baselines.items():
        make[name] = (lambda b=b: b.make(model.config, store), b.nbytes, b.describe())
    load_start = os.getloadavg()
    warm = window[: min(64, len(window))].unsqueeze(0).to(dev)
    for new, nbytes, _ in make.values():  # first calls allocate and pick kernels; keep them out of the measurement
        run_once(model, warm, new(), 2, dev, nbytes)
    order = np.random.default_rng(int(cfg.seed))
    rows = []
    for T in contexts:
        ids = window[:T].unsqueeze(0).to(dev)  # (1, T)
        runs: dict[str, list[dict]] = {name: [] for name in make}
        for _ in range(rounds):
            for i in order.permutation(len(make)):
                name = list(make)[i]
                new, nbytes, _ = make[name]
                runs[name].append(run_once(model, ids, new(), int(lat.decode_tokens), dev, nbytes))
        got = {name: over_rounds(r) for name, r in runs.items()}
        for name, (_, _, info) in make.items():
            rows.append({"context": T, "cache": name, "dtype": stored,
                         **{k: v for k, v in got[name].items() if k != "tokens"}, **info})
        match = {name: float(np.mean([a == b for a, b in zip(got["dynamic"]["tokens"], g["tokens"])]))
                 for name, g in got.items()}
        match["dynamic"] = match["compressed"]  # the plain row carries the compressed cache's agreement, as it always has
        for r in rows[-len(make):]:
            r["tokens_match_dynamic"] = match[r["cache"]]
    summary = {
        "compressor": compressor.name,
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "kind": "latency",
        "contexts": contexts,
        "decode_tokens": int(lat.decode_tokens),
        "rounds": rounds,
        "rows": rows,
        "ratios": latency_ratios(rows),
        "cache": {"residual": cache.residual, "chunk": int(cache.chunk), "mode": str(cache.mode), "dtype": cfg.dtype},
        "baselines": {name: b.describe() for name, b in baselines.items()},
        **model_fields(handle, cfg),  # model_dtype: the compute dtype latency.model_dtype cast the model to
        "fit_s": fit_s,
        **conditions(load=load_start[0]),
        # 1-minute load average at the start and the end: other jobs on a shared machine slow every row alike
        "loadavg_1m": [load_start[0], os.getloadavg()[0]],
        "compressor_params": compressor.describe(),
        "device": dev,
        "git_sha": git_sha(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return summary, rows


PLAIN = ("dynamic", "compressed")


def _ratios(a: dict, b: dict) -> dict[str, float]:
    """``a`` over ``b``: above 1 means ``a`` takes more (time or bytes)."""
    div = lambda x, y: x / y if y else math.nan
    return {
        "bytes_held": div(a["bytes_held"], b["bytes_held"]),
        "prefill_plus_compress": div(a["prefill_s"] + a["compress_s"], b["prefill_s"] + b["compress_s"]),
        "decode_median": div(a["decode_median_ms"], b["decode_median_ms"]),
        "decode_p95": div(a["decode_p95_ms"], b["decode_p95_ms"]),
        "tokens_per_s": div(a["tokens_per_s"], b["tokens_per_s"]),
        "peak_mem_delta": div(a["peak_mem_delta_bytes"], b["peak_mem_delta_bytes"]),
    }


def latency_ratios(rows: list[dict]) -> dict[str, dict[str, Any]]:
    """Per context: compressed over dynamic (the flat keys); for each baseline ``B`` among the rows,
    ``[B]["vs_dynamic"]`` (B over dynamic) and ``[B]["compressed_vs_baseline"]`` (compressed over B). Above 1 means
    the first takes more (time or bytes)."""
    out = {}
    for T in sorted({r["context"] for r in rows}):
        at = {r["cache"]: r for r in rows if r["context"] == T}
        d, c = at["dynamic"], at["compressed"]
        out[str(T)] = _ratios(c, d)
        for name, b in at.items():
            if name not in PLAIN:
                out[str(T)][name] = {"vs_dynamic": _ratios(b, d), "compressed_vs_baseline": _ratios(c, b)}
    return out


def format_latency(s: dict) -> str:
    load = s.get("loadavg_1m", [math.nan, math.nan])
    w = max([10] + [len(r["cache"]) for r in s["rows"]])
    lines = [f"  {s['compressor']} vs DynamicCache on {s['model']} ({s['device']}, model {s['model_dtype']}, "
             f"{s['decode_tokens']} decoded tokens, {s['torch_threads']} threads, load {load[0]:.1f} -> {load[1]:.1f})",
             f"  {'ctx':>5} {'cache':<{w}} {'prefill s':>9} {'compress s':>10} {'p50 ms':>8} {'p95 ms':>8} {'tok/s':>7} "
             f"{'held MB':>8} {'peak+ MB':>8} {'same tok':>8}"]
    for r in s["rows"]:
        lines.append(f"  {r['context']:>5} {r['cache']:<{w}} {r['prefill_s']:>9.3f} {r['compress_s']:>10.3f} "
                     f"{r['decode_median_ms']:>8.1f} {r['decode_p95_ms']:>8.1f} {r['tokens_per_s']:>7.2f} "
                     f"{r['bytes_held'] / 1e6:>8.2f} {r['peak_mem_delta_bytes'] / 1e6:>8.1f} "
                     f"{r.get('tokens_match_dynamic', math.nan):>8.2f}")
    short = lambda r: f"bytes {r['bytes_held']:.3f}, tok/s {r['tokens_per_s']:.3f}, p50 {r['decode_median']:.2f}x"
    lines.append("  compressed / dynamic: " + "; ".join(f"{T}: {short(r)}" for T, r in s["ratios"].items()))
    for name, b in s.get("baselines", {}).items():
        lines.append(f"  {name}: {b['label']}; {b['note']}")
        for what, title in (("vs_dynamic", f"{name} / dynamic"), ("compressed_vs_baseline", f"compressed / {name}")):
            lines.append(f"  {title}: " + "; ".join(f"{T}: {short(r[name][what])}" for T, r in s["ratios"].items()))
    return "\n".join(lines)
