"""One cell of the benchmark as a plain function: trace -> compressor -> bitstreams -> measurements."""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvbench.atomic import staged_dir
from kvbench.bitstream import Bitstream
from kvbench.capture import cache_dtype, git_sha, load_or_capture
from kvbench.compressor import Compressor
from kvbench.kv import Context
from kvbench.metrics.distortion import DistortionAccumulator
from kvbench.metrics.rate import bound_bits_per_token, rate_summary
from kvbench.metrics.task import continuation_nll
from kvbench.models import ModelHandle
from kvbench.paths import results_root
from kvbench.timing import Stopwatch
from kvbench.workloads import selected as workload_selected


def config_hash(cfg_dict: dict) -> str:
    """Identity of a cell: its resolved config (without output paths) and the code version."""
    keyed = {k: v for k, v in cfg_dict.items() if k not in ("paths", "metrics")}
    keyed["metrics.nll"] = cfg_dict.get("metrics", {}).get("nll")
    keyed["git_sha"] = git_sha()
    return hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_dir_for(cfg_dict: dict, compressor: Compressor) -> Path:
    return results_root(cfg_dict.get("paths", {}).get("results")) / "runs" / f"{compressor.name}-{config_hash(cfg_dict)}"


def measure(cfg: Any, compressor: Compressor, handle: ModelHandle | None = None) -> tuple[dict, list[dict]]:
    """Run one cell and return ``(summary, rows)``. ``cfg`` is the resolved run config (DictConfig or alike)."""
    handle = handle or ModelHandle(cfg.model, cfg.device)
    if workload_selected(cfg.get("workload")):  # many sessions instead of the dataset's windows
        from kvbench.workload_runner import measure_workload

        return measure_workload(cfg, compressor, handle)
    trace = load_or_capture(cfg, handle)
    dtype = cache_dtype(cfg.dtype)
    if trace.manifest["dtype"] != cfg.dtype:
        raise ValueError(f"trace {trace.path} holds {trace.manifest['dtype']} KV but dtype={cfg.dtype} was asked for")
    need_model = bool(cfg.metrics.nll) or compressor.needs_model
    model_ref = handle if compressor.needs_model else None

    fit_watch = Stopwatch(cfg.device)
    with fit_watch():
        compressor.fit([s.kv for s in trace.calib])
    enc, dec = Stopwatch(cfg.device), Stopwatch(cfg.device)
    dist = DistortionAccumulator()
    bits, parts, lossless = [], [], True
    nll_base, nll_comp, n_tok, n_el = [], [], 0, 0
    # disable=None: a bar on a terminal, silent in sweep logs
    for seq in tqdm(trace.eval, desc=f"{compressor.name}: code + score", unit="seq", leave=False, disable=None):
        kv = seq.kv
        ctx = Context.for_kv(kv, model_ref)
        with enc():
            bs = compressor.encode(kv, ctx)
        # Decode from the stored bytes alone: nothing but the bitstream and the free context crosses over.
        stored = Bitstream.from_bytes(bs.data)
        with dec():
            kv_hat = compressor.decode(stored, Context.for_kv(kv, model_ref))
        if kv_hat.shape != kv.shape or kv_hat.k.dtype != dtype:
            raise RuntimeError(f"{compressor.name} decoded {tuple(kv_hat.shape)} {kv_hat.k.dtype}; expected {tuple(kv.shape)} {dtype}")
        bits.append(stored.num_bits)
        parts.append(stored.parts)
        lossless &= torch.equal(kv_hat.k, kv.k) and torch.equal(kv_hat.v, kv.v)
        dist.add("k", kv.k, kv_hat.k)
        dist.add("v", kv.v, kv_hat.v)
        n_tok += kv.n_tokens
        n_el += kv.n_elements
        if cfg.metrics.nll:
            nll_base.append(continuation_nll(handle.model, kv, seq.continuation))
            nll_comp.append(continuation_nll(handle.model, kv_hat, seq.continuation))

    lp = torch.cat([s.logprobs for s in trace.eval])
    summary = {
        "compressor": compressor.name,
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "n_sequences": len(trace.eval),
        "n_tokens": n_tok,
        "n_elements": n_el,
        **measured_fields(compressor, bits, parts, n_tok, n_el, bool(lossless), enc, dec, fit_watch, dist, nll_base, nll_comp),
        "bound_bits_per_token": bound_bits_per_token(lp.tolist(), lp.numel()),
        "eval_tokens": (len(trace.eval[0].continuation) - 1) * len(trace.eval) if nll_base else 0,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "compressor_params": compressor.describe(),
        "compressor_stats": compressor.stats(),
        "trace": str(trace.path),
        "trace_captured": trace.captured,
        "model_loaded": need_model,
        "git_sha": git_sha(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return summary, dist.rows()


def measured_fields(compressor: Compressor, bits: list[int], parts: list, n_tok: int, n_el: int, lossless: bool,
                    enc: Stopwatch, dec: Stopwatch, fit: Stopwatch, dist: DistortionAccumulator,
                    nll_base: list[float], nll_comp: list[float]) -> dict:
    """The summary keys every run path measures the same way: rate, exactness, time, distortion, task loss."""
    baseline_mb = n_el * 2 / 1e6
    mean = (lambda xs: sum(xs) / len(xs)) if nll_base else (lambda xs: math.nan)
    return {
        **rate_summary(bits, parts, n_tok, n_el, compressor.side_info_bits()),
        "lossless": lossless,
        "encode_s": enc.seconds,
        "decode_s": dec.seconds,
        "fit_s": fit.seconds,
        "encode_MBps": baseline_mb / enc.seconds if enc.seconds else math.inf,
        "decode_MBps": baseline_mb / dec.seconds if dec.seconds else math.inf,
        "rel_mse_k": dist.rel_mse("k"),
        "rel_mse_v": dist.rel_mse("v"),
        "max_abs_err_k": dist.max_abs_err("k"),
        "max_abs_err_v": dist.max_abs_err("v"),
        "cosine_k": dist.cosine("k"),
        "cosine_v": dist.cosine("v"),
        "nll_base": mean(nll_base),
        "nll_compressed": mean(nll_comp),
        "delta_nll": mean(nll_comp) - mean(nll_base) if nll_base else math.nan,
    }


def write_run(run_dir: Path, summary: dict, rows: list[dict], cfg_dict: dict) -> None:
    """Write ``summary.json``, ``rows.parquet`` and ``config.json`` as one atomic directory."""
    import pandas as pd

    with staged_dir(run_dir) as tmp:
        pd.DataFrame(rows).assign(compressor=summary["compressor"]).to_parquet(tmp / "rows.parquet", index=False)
        (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2, default=str))
        (tmp / "summary.json").write_text(json.dumps(summary, indent=2, default=str))


def format_summary(s: dict) -> str:
    """A compact table for the terminal."""
    rows = [
        ("compressor", s["compressor"]),
        ("model / dataset", f"{s['model']} / {s['dataset']}  ({s['n_sequences']} seq x {s['n_tokens'] // max(s['n_sequences'], 1)} tok)"),
        ("bits / element", f"{s['bits_per_element']:.4f}"),
        ("bits / token", f"{s['bits_per_token']:,.1f}   (bound {s['bound_bits_per_token']:.2f})"),
        ("compression ratio", f"{s['compression_ratio']:.3f}x vs 16-bit"),
        ("lossless", str(s["lossless"])),
        ("rel MSE  K / V", f"{s['rel_mse_k']:.3e} / {s['rel_mse_v']:.3e}"),
        ("NLL base / comp.", f"{s['nll_base']:.4f} / {s['nll_compressed']:.4f}  (delta {s['delta_nll']:+.4f} nats)"),
        ("encode / decode", f"{s['encode_s']:.3f} s ({s['encode_MBps']:.0f} MB/s) / {s['decode_s']:.3f} s ({s['decode_MBps']:.0f} MB/s)"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)
