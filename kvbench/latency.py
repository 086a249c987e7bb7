"""End-to-end latency and memory of decoding with a :class:`~kvbench.cache.CompressedCache` against a plain
``DynamicCache``, in the same process on the same text.

For each context length: prefill (the compressed cache codes its prefix at the end of it; that time is reported
apart as compression), then greedy decoding of ``decode_tokens`` tokens in a hand-written loop, one forward pass
per token (each pass of the compressed cache decodes its segments from bytes and codes a chunk when the window
fills). Reported: prefill and compression seconds, per-token latency (median and p95), tokens/s, bytes the cache
holds afterwards, and peak resident memory during the run (:class:`~kvbench.timing.PeakRSS` on the CPU, CUDA's
peak allocation on a GPU).
"""

from __future__ import annotations

import gc
import math
import os
import time
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from kvbench.cache import CompressedCache
from kvbench.capture import cache_dtype, calib_windows
from kvbench.codec import prepare
from kvbench.compressor import Compressor
from kvbench.data import load_documents, sample_windows
from kvbench.models import ModelHandle
from kvbench.results import git_sha
from kvbench.timing import PeakRSS


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


def dynamic_nbytes(cache: Any) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


@torch.no_grad()
def run_once(model: Any, ids: torch.Tensor, cache: Any, n_decode: int, device: str) -> dict[str, Any]:
    """Prefill ``ids`` (1, T) into ``cache``, then decode ``n_decode`` tokens greedily; times and memory."""
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
        "bytes_held": cache.nbytes() if compressed else dynamic_nbytes(cache),
        "peak_mem_bytes": peak,
        "peak_mem_delta_bytes": peak_delta,
        "tokens": tokens,
    }
    if compressed:
        row.update({f"cache_{k}": v for k, v in end.items()})
    return row


def measure_latency(cfg: Any, compressor: Compressor, handle: ModelHandle | None = None) -> tuple[dict, list[dict]]:
    """Run every context length with both caches; return ``(summary, rows)``."""
    handle = handle or ModelHandle(cfg.model, cfg.device)
    lat = cfg.latency
    contexts = [int(c) for c in lat.contexts]
    if not contexts or min(contexts) < 2:
        raise ValueError(f"latency.contexts={contexts} must list context lengths of at least 2 tokens")
    config = handle.model.config if compressor.needs_config else None
    fit_s = prepare(compressor, lambda: calib_windows(cfg, handle), cfg.device, config=config).fit_s
    model = handle.model
    model_dtype = cache_dtype(cfg.dtype) if lat.model_dtype == "cache" else getattr(torch, str(lat.model_dtype))
    model.to(model_dtype)
    dev = cfg.device
    window = sample_windows(load_documents(cfg.dataset), handle.tokenizer, 1, max(contexts), int(cfg.seed))[0]
    store = cache_dtype(cfg.dtype)
    make = {
        "dynamic": DynamicCache,
        "compressed": lambda: CompressedCache(compressor, residual=lat.residual, chunk=int(lat.chunk), mode=str(lat.mode),
                                              model=handle, dtype=store),
    }
    load_start = os.getloadavg()
    warm = window[: min(64, len(window))].unsqueeze(0).to(dev)
    for name in make:  # first calls allocate and pick kernels; keep them out of the measurement
        run_once(model, warm, make[name](), 2, dev)
    rows = []
    for T in contexts:
        ids = window[:T].unsqueeze(0).to(dev)  # (1, T)
        got = {}
        for name in make:
            got[name] = run_once(model, ids, make[name](), int(lat.decode_tokens), dev)
            rows.append({"context": T, "cache": name, **{k: v for k, v in got[name].items() if k != "tokens"}})
        same = np.mean([a == b for a, b in zip(got["dynamic"]["tokens"], got["compressed"]["tokens"])])
        rows[-1]["tokens_match_dynamic"] = rows[-2]["tokens_match_dynamic"] = float(same)
    summary = {
        "compressor": compressor.name,
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "kind": "latency",
        "contexts": contexts,
        "decode_tokens": int(lat.decode_tokens),
        "rows": rows,
        "ratios": latency_ratios(rows),
        "cache": {"residual": lat.residual, "chunk": int(lat.chunk), "mode": str(lat.mode), "dtype": cfg.dtype},
        "model_dtype": str(model_dtype).replace("torch.", ""),
        "fit_s": fit_s,
        "torch_threads": torch.get_num_threads(),
        # 1-minute load average at the start and the end: other jobs on a shared machine slow every row alike
        "loadavg_1m": [load_start[0], os.getloadavg()[0]],
        "compressor_params": compressor.describe(),
        "device": dev,
        "git_sha": git_sha(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return summary, rows


def latency_ratios(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Compressed over dynamic, per context: above 1 means the compressed cache takes more (time or bytes)."""
    out = {}
    for T in sorted({r["context"] for r in rows}):
        d = next(r for r in rows if r["context"] == T and r["cache"] == "dynamic")
        c = next(r for r in rows if r["context"] == T and r["cache"] == "compressed")
        div = lambda a, b: a / b if b else math.nan
        out[str(T)] = {
            "bytes_held": div(c["bytes_held"], d["bytes_held"]),
            "prefill_plus_compress": div(c["prefill_s"] + c["compress_s"], d["prefill_s"]),
            "decode_median": div(c["decode_median_ms"], d["decode_median_ms"]),
            "decode_p95": div(c["decode_p95_ms"], d["decode_p95_ms"]),
            "tokens_per_s": div(c["tokens_per_s"], d["tokens_per_s"]),
            "peak_mem_delta": div(c["peak_mem_delta_bytes"], d["peak_mem_delta_bytes"]),
        }
    return out


def format_latency(s: dict) -> str:
    load = s.get("loadavg_1m", [math.nan, math.nan])
    lines = [f"  {s['compressor']} vs DynamicCache on {s['model']} ({s['device']}, model {s['model_dtype']}, "
             f"{s['decode_tokens']} decoded tokens, {s['torch_threads']} threads, load {load[0]:.1f} -> {load[1]:.1f})",
             f"  {'ctx':>5} {'cache':<10} {'prefill s':>9} {'compress s':>10} {'p50 ms':>8} {'p95 ms':>8} {'tok/s':>7} "
             f"{'held MB':>8} {'peak+ MB':>8} {'same tok':>8}"]
    for r in s["rows"]:
        lines.append(f"  {r['context']:>5} {r['cache']:<10} {r['prefill_s']:>9.3f} {r['compress_s']:>10.3f} {r['decode_median_ms']:>8.1f} "
                     f"{r['decode_p95_ms']:>8.1f} {r['tokens_per_s']:>7.2f} {r['bytes_held'] / 1e6:>8.2f} "
                     f"{r['peak_mem_delta_bytes'] / 1e6:>8.1f} {r.get('tokens_match_dynamic', math.nan):>8.2f}")
    lines.append("  compressed / dynamic: " + "; ".join(
        f"{T}: bytes {r['bytes_held']:.3f}, tok/s {r['tokens_per_s']:.3f}, p50 {r['decode_median']:.2f}x" for T, r in s["ratios"].items()))
    return "\n".join(lines)
