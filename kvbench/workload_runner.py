"""The run path for multi-session workloads (``python -m kvbench run +compressor=NAME workload=NAME``).

Every session of the workload is prefilled on its own with :func:`kvbench.capture.capture_window` (cached per
session under ``$KVBENCH_HOME/sessions``), so a prefix two sessions share was computed twice and can be checked
for bit-identity. Set compressors (the ``trie`` and ``pipeline`` dedup stages) code all sessions into one
bitstream; any other compressor codes them one by one (the "alone" baseline on the same sessions). The summary
has every key of a plain run plus the workload's sharing statistics, a prefix-cache replay and the KV identity
check. NLL: the last ``eval_tokens`` of each session are scored with the reconstructed cache of the rest.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from kvbench.bitstream import Bitstream
from kvbench.capture import cache_dtype, capture_window, git_sha, load_or_capture
from kvbench.compressor import Compressor
from kvbench.data import load_documents
from kvbench.kv import Context, KVSequence
from kvbench.metrics.distortion import DistortionAccumulator
from kvbench.metrics.rate import bound_bits_per_token
from kvbench.metrics.task import continuation_nll
from kvbench.models import ModelHandle
from kvbench.paths import home
from kvbench.prefix.cache import replay
from kvbench.prefix.radix import RadixTrie
from kvbench.runner import measured_fields
from kvbench.timing import Stopwatch
from kvbench.workloads import Workload, make_workload


@dataclass
class CapturedSession:
    kv: KVSequence  # tokens = the session's prompt
    logprobs: torch.Tensor  # (T - 1,) natural log p of tokens 1..T-1
    family: str


def session_cache_dir(cfg: Any) -> Path:
    m = cfg.model
    key = hashlib.sha256(json.dumps([m.name, m.source, str(m.path), cfg.dtype]).encode()).hexdigest()[:12]
    return home() / "sessions" / f"{m.name}-{cfg.dtype}-{key}"


def capture_sessions(cfg: Any, handle: ModelHandle, wl: Workload) -> tuple[list[CapturedSession], int]:
    """Each session's KV and token log-probs, from the per-session cache or a fresh prefill."""
    out_dir = session_cache_dir(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = cache_dtype(cfg.dtype)
    got, fresh = [], 0
    for s in tqdm(wl.sessions, desc=f"{wl.name}: capture", unit="session", leave=False, disable=None):
        ids = torch.from_numpy(np.ascontiguousarray(s.tokens, dtype=np.int64))
        path = out_dir / f"{hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:24]}.safetensors"
        if path.exists():
            t = load_file(str(path))
        else:
            t = capture_window(handle.model, ids, ids.numel(), dtype)
            t = {"k": t["k"], "v": t["v"], "logprobs": t["logprobs"], "tokens": ids}
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            save_file(t, str(tmp))
            os.replace(tmp, path)  # atomic: parallel runs never read half a file
            fresh += 1
        got.append(CapturedSession(KVSequence(t["k"], t["v"], t["tokens"]), t["logprobs"], s.family))
    return got, fresh


def dedup_stage(compressor: Compressor) -> Any:
    """The trie inside a set compressor (itself, or a pipeline's ``dedup``), else None."""
    from compressors.trie import Trie

    if isinstance(compressor, Trie):
        return compressor
    dedup = getattr(compressor, "dedup", None)
    return dedup if isinstance(dedup, Trie) else None


def _fits(c: Compressor) -> bool:
    inner = getattr(c, "inner", None)
    if isinstance(inner, Compressor):
        return _fits(inner)
    return type(c).fit is not Compressor.fit


def shared_prefix_kv(sessions: list[CapturedSession]) -> dict[str, Any]:
    """For every session whose tokens start with an earlier session's prefix: is the KV over that prefix
    bit-identical between the two independent prefills? (max |difference| over every layer, head, channel)"""
    from compressors.trie import first_kv_mismatch

    trie = RadixTrie(1)
    pairs = identical = compared = after_first = 0
    max_diff = 0.0
    examples = []
    for j, s in enumerate(sessions):
        m = trie.insert(s.kv.tokens.numpy(), owner=j)
        if not m.tokens:
            continue
        o_id = trie.owner[m.node]
        o = sessions[o_id].kv
        n = m.tokens
        d = max(float((s.kv.k[:, :, :n].float() - o.k[:, :, :n].float()).abs().max()),
                float((s.kv.v[:, :, :n].float() - o.v[:, :, :n].float()).abs().max()))
        pairs += 1
        identical += d == 0.0
        compared += n
        max_diff = max(max_diff, d)
        if d:
            first = first_kv_mismatch(s.kv, o, n)
            after_first += n - first
            if len(examples) < 8:
                examples.append({"session": j, "tokens": s.kv.n_tokens, "earlier": o_id, "earlier_tokens": o.n_tokens,
                                 "shared": n, "first_difference": first, "max_abs_diff": d})
    # tokens_after_first_difference: shared tokens that exact (KV-verified) dedup cannot share
    return {"pairs": pairs, "identical_pairs": identical, "tokens_compared": compared, "max_abs_diff": max_diff,
            "tokens_after_first_difference": after_first, "differing_pairs": examples}


def _part_totals(parts: dict[str, int]) -> dict[str, int]:
    # a pipeline's sections are "<segment>/<inner section>"; sum them per inner section
    out: dict[str, int] = {}
    for name, bits in parts.items():
        key = re.sub(r"^\d+/", "inner/", name)
        out[key] = out.get(key, 0) + bits
    return out


def measure_workload(cfg: Any, compressor: Compressor, handle: ModelHandle) -> tuple[dict, list[dict]]:
    builder = make_workload(cfg.workload)
    wl = builder.build(handle.tokenizer, load_documents(cfg.dataset))
    dtype = cache_dtype(cfg.dtype)
    t0 = time.perf_counter()
    sessions, fresh = capture_sessions(cfg, handle, wl)
    capture_s = time.perf_counter() - t0
    kvs = [s.kv for s in sessions]
    model_ref = handle if compressor.needs_model else None
    stage = dedup_stage(compressor)
    block = stage.block_size if stage is not None else 16

    fit_watch = Stopwatch(cfg.device)
    if _fits(compressor):  # calibrate on the dataset's calibration windows, as a plain run does
        with fit_watch():
            compressor.fit([s.kv for s in load_or_capture(cfg, handle).calib])
    enc, dec = Stopwatch(cfg.device), Stopwatch(cfg.device)
    bits, parts = [], []
    if hasattr(compressor, "encode_set"):
        ctxs = [Context.for_kv(kv, model_ref) for kv in kvs]
        for ctx, s in zip(ctxs, sessions):
            ctx.extras["logprobs"] = s.logprobs.numpy()  # encoder-side only (PLT priorities)
        with enc():
            bs = compressor.encode_set(kvs, ctxs)
        stored = Bitstream.from_bytes(bs.data)  # the decoder sees the bytes and the free contexts only
        with dec():
            outs = compressor.decode_set(stored, [Context.for_kv(kv, model_ref) for kv in kvs])
        bits.append(stored.num_bits)
        parts.append(_part_totals(stored.parts))
    else:
        outs = []
        for kv in kvs:
            with enc():
                bs = compressor.encode(kv, Context.for_kv(kv, model_ref))
            stored = Bitstream.from_bytes(bs.data)
            with dec():
                outs.append(compressor.decode(stored, Context.for_kv(kv, model_ref)))
            bits.append(stored.num_bits)
            parts.append(stored.parts)

    dist = DistortionAccumulator()
    lossless, n_tok, n_el = True, 0, 0
    nll_base, nll_comp, n_eval = [], [], 0
    E = builder.eval_tokens
    for kv, kv_hat in zip(kvs, outs):
        if kv_hat.shape != kv.shape or kv_hat.k.dtype != dtype:
            raise RuntimeError(f"{compressor.name} decoded {tuple(kv_hat.shape)} {kv_hat.k.dtype}; expected {tuple(kv.shape)} {dtype}")
        lossless &= torch.equal(kv_hat.k, kv.k) and torch.equal(kv_hat.v, kv.v)
        dist.add("k", kv.k, kv_hat.k)
        dist.add("v", kv.v, kv_hat.v)
        n_tok += kv.n_tokens
        n_el += kv.n_elements
        T = kv.n_tokens
        if cfg.metrics.nll and T > E + 1:
            cont = kv.tokens[T - E :]
            nll_base.append(continuation_nll(handle.model, kv.slice_tokens(0, T - E), cont))
            nll_comp.append(continuation_nll(handle.model, kv_hat.slice_tokens(0, T - E), cont))
            n_eval += E - 1

    stats = wl.stats(block_size=block)
    lps = [s.logprobs.numpy() for s in sessions]
    cache = replay([s.tokens for s in wl.sessions], block, stage.budget_tokens if stage else None,
                   stage.policy if stage else "lru", [np.concatenate([[0.0], lp]) for lp in lps],
                   stage.plt_weight if stage else 1.0)
    # the set's entropy bound: shared prefixes' tokens coded once (token 0 of a session has no log-prob)
    fine, unique_nats = RadixTrie(1), 0.0
    for s, lp in zip(wl.sessions, lps):
        m = fine.insert(s.tokens).tokens
        unique_nats -= float(lp[max(m, 1) - 1 :].sum())
    all_lp = np.concatenate(lps)
    summary = {
        "compressor": compressor.name,
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "workload": wl.name,
        "n_sequences": len(kvs),
        "n_tokens": n_tok,
        "n_elements": n_el,
        **measured_fields(compressor, bits, parts, n_tok, n_el, bool(lossless), enc, dec, fit_watch, dist, nll_base, nll_comp),
        "bound_bits_per_token": bound_bits_per_token(all_lp.tolist(), all_lp.size),
        "bound_dedup_bits_per_token": unique_nats / n_tok / math.log(2),
        "eval_tokens": n_eval,
        "sharing": stats,
        "prefix_cache": cache.summary(),
        "shared_prefix_kv": shared_prefix_kv(sessions),
        "workload_params": wl.meta,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "compressor_params": compressor.describe(),
        "compressor_stats": compressor.stats() if hasattr(compressor, "stats") else {},
        "trace": str(session_cache_dir(cfg)),
        "sessions_captured": fresh,
        "capture_s": capture_s,
        "model_loaded": handle._model is not None,
        "git_sha": git_sha(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return summary, dist.rows()
