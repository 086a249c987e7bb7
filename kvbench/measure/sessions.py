"""The sessions of a multi-session workload (``python -m kvbench run +compressor=NAME workload=NAME``) as items
for the run path (:func:`kvbench.measure.run.measure`).

Every session of the workload is prefilled on its own with :func:`kvbench.inputs.capture.capture_window` (cached per
session under ``$KVBENCH_HOME/sessions``), so a prefix two sessions share was computed twice and can be checked
for bit-identity. Set compressors (the ``trie`` and ``pipeline`` dedup stages) code all sessions into one
bitstream; any other compressor codes them one by one (the "alone" baseline on the same sessions). The summary
gets the workload's sharing statistics, a prefix-cache replay and the KV identity check. NLL: the last
``eval_tokens`` of each session are scored with the reconstructed cache of the rest.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from kvbench.core.compressor import Compressor, SetCompressor
from kvbench.core.items import Item, Source
from kvbench.core.kv import KVSequence, first_kv_mismatch
from kvbench.core.prefix_cache import PrefixCache, replay
from kvbench.core.radix import RadixTrie
from kvbench.inputs.capture import cache_dtype, capture_code_version, capture_window, default_trace_dir, load_or_capture
from kvbench.inputs.data import load_documents
from kvbench.inputs.models import ModelHandle
from kvbench.inputs.workloads import Workload, make_workload
from kvbench.measure.metrics.rate import bound_bits_per_token
from kvbench.store.paths import home


@dataclass
class CapturedSession:
    kv: KVSequence  # tokens = the session's prompt
    logprobs: torch.Tensor  # (T - 1,) natural log p of tokens 1..T-1
    family: str


def session_cache_dir(cfg: Any) -> Path:
    m = cfg.model
    key = hashlib.sha256(json.dumps([m.name, m.source, str(m.path), cfg.dtype, capture_code_version()]).encode())
    key = key.hexdigest()[:12]
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


def shared_prefix_kv(sessions: list[CapturedSession]) -> dict[str, Any]:
    """For every session whose tokens start with an earlier session's prefix: is the KV over that prefix
    bit-identical between the two independent prefills? (max |difference| over every layer, head, channel)"""
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


def workload_source(cfg: Any, handle: ModelHandle, compressor: Compressor) -> Source:
    """The workload's sessions as items, and the summary fields that describe the workload."""
    builder = make_workload(cfg.workload)
    wl = builder.build(handle.tokenizer, load_documents(cfg.dataset))
    t0 = time.perf_counter()
    sessions, fresh = capture_sessions(cfg, handle, wl)
    capture_s = time.perf_counter() - t0
    E = builder.eval_tokens
    items = []
    for s in sessions:
        T = s.kv.n_tokens
        scored = bool(cfg.metrics.nll) and T > E + 1
        # encoder-side only: the PLT's priorities read the session's token log-probs
        items.append(Item(s.kv, T - E if scored else T, s.kv.tokens[T - E :] if scored else None,
                          {"logprobs": s.logprobs.numpy()}))

    spec = compressor.prefix_cache() if isinstance(compressor, SetCompressor) else PrefixCache()
    lps = [s.logprobs.numpy() for s in sessions]
    cache = replay([s.tokens for s in wl.sessions], spec.block_size, spec.budget_tokens, spec.policy,
                   [np.concatenate([[0.0], lp]) for lp in lps], spec.plt_weight)
    # the set's entropy bound: shared prefixes' tokens coded once (token 0 of a session has no log-prob)
    fine, unique_nats = RadixTrie(1), 0.0
    for s, lp in zip(wl.sessions, lps):
        m = fine.insert(s.tokens).tokens
        unique_nats -= float(lp[max(m, 1) - 1 :].sum())
    all_lp = np.concatenate(lps)
    n_tok = sum(s.kv.n_tokens for s in sessions)
    fields = {
        "workload": wl.name,
        "bound_bits_per_token": bound_bits_per_token(all_lp.tolist(), all_lp.size),
        "bound_dedup_bits_per_token": unique_nats / n_tok / math.log(2),
        "sharing": wl.stats(block_size=spec.block_size),
        "prefix_cache": cache.summary(),
        "shared_prefix_kv": shared_prefix_kv(sessions),
        "workload_params": wl.meta,
        "trace": str(session_cache_dir(cfg)),
        "sessions_captured": fresh,
        "capture_s": capture_s,
    }
    return Source(items, lambda: [s.kv for s in load_or_capture(cfg, handle).calib], fields,
                  str(default_trace_dir(cfg) if not cfg.trace else cfg.trace))
