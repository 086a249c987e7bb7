"""``python -m kvbench restore +compressor=NAME``: time to first token when a session's stored cache is restored,
against link bandwidth, as CacheGen (Liu et al. 2024, arXiv 2310.07240) and KVTC (Staniszewski & Łańcucki,
arXiv 2511.01815) measure it.

A session of ``T`` context tokens (cut from the dataset's text; each context is a prefix of one window) ends with
its cache stored off the accelerator; it resumes with one new input token (the text's next one) and wants the first
output token. Three ways to get there:

- **compressed restore**: send the coded cache (the bitstream, plus the codec state once: every bit the decoder
  needs), decode it on a decoder rebuilt from the state bytes (:func:`kvbench.core.codec.prepare`, as everywhere in the
  harness), then one forward pass of the new token on the restored cache;
- **16-bit restore**: send the 16-bit KV and run the same forward pass;
- **prefill**: send only the context's token ids and re-run the model on them and the new token.

**Measured on this machine** (each the median of ``restore.repeats`` rounds on ``restore.threads`` torch threads,
after one warm-up pass on a short context; every round's time is kept, and each crossover's spread is its lowest and
highest value over the rounds): encode, decode, the first-token forward on the restored cache
(building the cache from the decoded tensors included; its cost does not depend on the values, so the 16-bit
route uses the same time), and prefill of ``T + 1`` tokens (logits of the last position only). **Modelled**:
transfer at each link bandwidth (:mod:`kvbench.measure.ttft`, which also defines the crossover bandwidths) and the
projection to larger shapes (:mod:`kvbench.measure.restore_projection`). The first token is the greedy one; rows say
whether the restored cache gives the same token as the 16-bit cache and as prefill.

Coders whose decoder runs the model are measured as they are: ``recompute`` decodes the token ids one model step
at a time (its range coder needs each distribution before the next id), then regenerates the KV with one batched
prefill; ``speculative`` does the same on its cheaper copy of the model with ``token_coding=model``, or reads plain
ids and runs one batched prefill of the copy with ``token_coding=plain``, then adds the coded residual. The copy is
built once per process (in the warm-up), not per restore.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

from kvbench.cache.eviction_mask import hide_evicted
from kvbench.coding.bitstream import Bitstream
from kvbench.core.codec import Codec, prepare
from kvbench.core.compressor import Compressor
from kvbench.core.kv import Context, KVSequence
from kvbench.core.machine import conditions
from kvbench.core.next_token import torch_threads
from kvbench.core.timing import Stopwatch
from kvbench.inputs.assets import AssetError
from kvbench.inputs.capture import cache_dtype, calib_windows
from kvbench.inputs.data import adds_bos, load_documents, sample_windows
from kvbench.inputs.models import ModelHandle, model_fields
from kvbench.measure.metrics.task_loss import build_cache
from kvbench.measure.restore_projection import LABEL as PROJECTION_LABEL
from kvbench.measure.restore_projection import project
from kvbench.measure.ttft import Route, check_bandwidths, crossovers, id_bits, ttft_rows
from kvbench.store.results import git_sha

MODELLED = ("transfer time = bits / link bandwidth (no protocol overhead, no overlap of transfer and decode); "
            "the projection to other models")
MEASURED = "encode, decode, first-token forward on the restored cache, prefill of the context and the new token"
WARM_TOKENS = 32  # the warm-up context: first calls allocate and pick kernels


def timed(fn: Callable[[], Any], device: str, repeats: int) -> tuple[Any, list[float]]:
    """``fn()``'s result and the seconds of each of ``repeats`` calls."""
    out, times = None, []
    for _ in range(repeats):
        watch = Stopwatch(device)
        with watch():
            out = fn()
        times.append(watch.seconds)
    return out, times


def check_threads(n: Any) -> int | None:
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, (int, float)) or int(n) != n or int(n) < 1:
        raise ValueError(f"restore.threads={n!r} must be a whole number of at least 1, or null for torch's default")
    return int(n)


def max_positions(model: Any) -> int | None:
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


def check_contexts(values: Any) -> list[int]:
    try:
        contexts = [int(c) for c in values]
    except (TypeError, ValueError):
        raise ValueError(f"restore.contexts={values!r} must be a list of context lengths in tokens, "
                         "e.g. [1024, 4096]") from None
    if not contexts or min(contexts) < 2 or any(c != float(v) for c, v in zip(contexts, values)):
        raise ValueError(f"restore.contexts={list(values)} must list whole context lengths of at least 2 tokens")
    return sorted(set(contexts))


def clip(contexts: list[int], limit: int, why: str) -> tuple[list[int], list[str]]:
    """Contexts above ``limit`` replaced by it, with a note each."""
    notes = [f"context {c} clipped to {limit}: {why}" for c in contexts if c > limit]
    return sorted({min(c, limit) for c in contexts}), notes


def session_window(cfg: Any, handle: ModelHandle, requested: list[int]) -> tuple[torch.Tensor, list[int], list[str]]:
    """One window of the dataset, long enough for the longest usable context plus the new token, the contexts
    clipped to what the model and the text allow, and a note per clipped context."""
    contexts, notes = requested, []
    pos = max_positions(handle.model)
    if pos is not None:
        contexts, notes = clip(contexts, int(pos) - 1, f"{cfg.model.name} has {pos} positions and the new token "
                                                     "takes one")
    docs = load_documents(cfg.dataset)
    try:
        window = sample_windows(docs, handle.tokenizer, 1, max(contexts) + 1, int(cfg.seed))[0]
    except AssetError:
        bos = 1 if adds_bos(handle.tokenizer) else 0
        longest = bos + max(len(handle.tokenizer(d, add_special_tokens=False).input_ids) for d in docs)
        if longest < 3:
            raise ValueError(f"dataset {cfg.dataset.name} has no document of 3 tokens or more") from None
        contexts, more = clip(contexts, longest - 1, f"the longest document of {cfg.dataset.name} has {longest} "
                                                     "tokens and the new token takes one")
        notes += more
        window = sample_windows(docs, handle.tokenizer, 1, max(contexts) + 1, int(cfg.seed))[0]
    return window, contexts, notes


@torch.no_grad()
def session_kv(model: Any, ids: torch.Tensor, dtype: torch.dtype) -> KVSequence:
    """The cache a session of ``ids`` (T,) leaves behind, every layer's whole K/V (sliding-window layers too, as
    the harness codes them), in the 16-bit cache dtype on the CPU."""
    device = next(model.parameters()).device
    cache = DynamicCache()  # full layers: a sliding-window layer keeps all T tokens
    model(ids.unsqueeze(0).to(device), cache=cache, use_cache=True, logits_to_keep=1)
    k = torch.stack([layer.keys[0] for layer in cache.layers]).to(dtype).cpu()  # (L, H, T, D)
    v = torch.stack([layer.values[0] for layer in cache.layers]).to(dtype).cpu()  # (L, H, T, D)
    return KVSequence(k, v, ids.cpu().clone())


@torch.no_grad()
def first_token(model: Any, kv: KVSequence, new: torch.Tensor) -> int:
    """The greedy token after feeding ``new`` (1,) on a cache filled with ``kv``."""
    ids = new.view(1, 1).to(next(model.parameters()).device)  # (1, 1)
    with hide_evicted(model, kv.kept):  # a token-eviction decoder's dropped entries stay out of attention
        out = model(ids, cache=build_cache(model, kv), use_cache=True, logits_to_keep=1)
    return int(out.logits[0, -1].argmax())


@torch.no_grad()
def prefill_token(model: Any, ids: torch.Tensor) -> int:
    """The greedy token after re-running the model on ``ids`` (T + 1,), keeping the cache a resumed session needs."""
    device = next(model.parameters()).device
    out = model(ids.unsqueeze(0).to(device), cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
    return int(out.logits[0, -1].argmax())


def measure_context(model: Any, codec: Codec, window: torch.Tensor, T: int, dtype: torch.dtype, model_ref: Any,
                    config: Any, device: str, repeats: int) -> dict[str, Any]:
    """Store the session of ``window[:T]``, restore it and take the first token after ``window[T]``; measured."""
    kv = session_kv(model, window[:T], dtype)
    new = window[T : T + 1]  # (1,) the resumed session's next input
    bs, encode_t = timed(lambda: codec.encoder.encode(kv, Context.for_kv(kv, model_ref, config)), device, repeats)
    stored = Bitstream.from_bytes(bs.data)  # the decoder sees bytes only; bits are counted from them
    dec_ctx = Context.for_kv(kv, model_ref, config)
    kv_hat, decode_t = timed(lambda: codec.decoder.decode(stored, dec_ctx), device, repeats)
    if kv_hat.shape != kv.shape or kv_hat.k.dtype != dtype:
        raise RuntimeError(f"{codec.encoder.name} decoded {tuple(kv_hat.shape)} {kv_hat.k.dtype}; expected "
                           f"{tuple(kv.shape)} {dtype}")
    token, first_t = timed(lambda: first_token(model, kv_hat, new), device, repeats)
    token_prefill, prefill_t = timed(lambda: prefill_token(model, window[: T + 1]), device, repeats)
    encode_s, decode_s, first_s, prefill_s = (statistics.median(t) for t in (encode_t, decode_t, first_t, prefill_t))
    token_16bit = first_token(model, kv, new)
    n_el = kv.n_elements
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    exact = (torch.equal(kv_hat.k, kv.k) and torch.equal(kv_hat.v, kv.v)
             and (kv_hat.kept is None or bool(kv_hat.kept.all())))
    return {
        "context": T,
        "n_elements": n_el,
        "stream_bits": stored.num_bits,
        "codec_bits": codec.codec_bits,
        "bits": stored.num_bits + codec.codec_bits,  # every bit the decoder needs, codec state once
        "bits_16bit": 16 * n_el,
        "bits_ids": T * id_bits(vocab),
        "id_bits": id_bits(vocab),
        "bits_per_element": stored.num_bits / n_el,
        "encode_s": encode_s,  # each time the median of the repeats; every repeat's time under repeat_s
        "decode_s": decode_s,
        "first_token_s": first_s,
        "prefill_s": prefill_s,
        "repeat_s": {"encode": encode_t, "decode": decode_t, "first_token": first_t, "prefill": prefill_t},
        "encode_elements_per_s": n_el / encode_s if encode_s > 0 else math.inf,
        "decode_elements_per_s": n_el / decode_s if decode_s > 0 else math.inf,
        "exact": bool(exact),
        "first_token": token,
        "first_token_16bit": token_16bit,
        "first_token_prefill": token_prefill,
        "first_token_matches_16bit": token == token_16bit,
        "first_token_matches_prefill": token == token_prefill,
    }


def routes(m: dict[str, Any], repeat: int | None = None) -> tuple[Route, Route, Route]:
    """The three routes of one measured context (:mod:`kvbench.measure.ttft`): at the median times, or at the
    times of one ``repeat`` (every route's measurement in the same round)."""
    t = {k: m[f"{k}_s"] for k in ("decode", "first_token", "prefill")} if repeat is None else \
        {k: m["repeat_s"][k][repeat] for k in ("decode", "first_token", "prefill")}
    return (Route("compressed", m["bits"], t["decode"] + t["first_token"]),
            Route("16bit", m["bits_16bit"], t["first_token"]),
            Route("prefill", m["bits_ids"], t["prefill"]))


ROW_FIELDS = ("bits", "bits_16bit", "bits_ids", "encode_s", "decode_s", "first_token_s", "prefill_s", "exact",
              "first_token_matches_16bit", "first_token_matches_prefill")
CROSSINGS = ("crossover_16bit_gbps", "crossover_prefill_gbps", "crossover_16bit_prefill_gbps")


def context_rows(m: dict[str, Any], bandwidths: list[float]) -> tuple[list[dict], dict[str, Any]]:
    """Rows per bandwidth of one measured context, and its crossovers."""
    comp, sixteen, prefill = routes(m)
    cross = crossovers(comp, sixteen, prefill)
    # the spread: each crossing computed from every round's times, lowest and highest
    per_round = [crossovers(*routes(m, i)) for i in range(len(m["repeat_s"]["decode"]))]
    for k in CROSSINGS:
        got = [c[k] for c in per_round if c[k] is not None]
        cross[f"{k}_spread"] = [min(got), max(got)] if got else None
    rows = []
    for r in ttft_rows(comp, sixteen, prefill, bandwidths):
        rows.append({"context": m["context"], **r, "bytes": m["bits"] / 8, "bytes_16bit": m["bits_16bit"] / 8,
                     "bytes_ids": m["bits_ids"] / 8, **{k: m[k] for k in ROW_FIELDS},
                     **{k: math.nan if cross[k] is None else cross[k] for k in CROSSINGS},
                     **{f"{k}_{end}": math.nan if cross.get(f"{k}_spread") is None else cross[f"{k}_spread"][i]
                        for k in CROSSINGS for i, end in enumerate(("lo", "hi"))}})
    return rows, cross


def measure_restore(cfg: Any, compressor: Compressor, handle: ModelHandle | None = None) -> tuple[dict, list[dict]]:
    """Every context of ``cfg.restore``: measured, then modelled at every bandwidth; ``(summary, rows)``."""
    r = cfg.restore
    bandwidths = check_bandwidths(list(r.bandwidths_gbps))
    requested = check_contexts(list(r.contexts))
    repeats = int(r.repeats)
    if repeats < 1 or repeats != r.repeats:
        raise ValueError(f"restore.repeats={r.repeats!r} must be a whole number of at least 1")
    threads = check_threads(r.get("threads"))
    dtype = cache_dtype(cfg.dtype)
    handle = handle or ModelHandle(cfg.model, cfg.device)
    config = handle.config if compressor.needs_config else None
    model_ref = handle if compressor.needs_model else None
    codec = prepare(compressor, lambda: calib_windows(cfg, handle), cfg.device, config=config)
    model, dev = handle.model, cfg.device
    window, contexts, notes = session_window(cfg, handle, requested)
    load_start = os.getloadavg()
    measured, rows, cross = [], [], {}
    with torch_threads(threads) as threads:
        measure_context(model, codec, window, min(WARM_TOKENS, contexts[0]), dtype, model_ref, config, dev, 1)
        for T in contexts:
            m = measure_context(model, codec, window, T, dtype, model_ref, config, dev, repeats)
            measured.append(m)
            got, cross[str(T)] = context_rows(m, bandwidths)
            rows += got
    largest = measured[-1]
    summary = {
        "compressor": compressor.name,
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "kind": "restore",
        "contexts": contexts,
        "contexts_requested": requested,
        "notes": notes,
        "bandwidths_gbps": bandwidths,
        "measured_here": MEASURED,
        "modelled": MODELLED,
        "measured": measured,
        "rows": rows,
        "crossovers": cross,
        "projection": project({k: largest[k] for k in ("bits_per_element", "encode_elements_per_s",
                                                       "decode_elements_per_s")} | {"context": largest["context"]},
                              r.projection, bandwidths, compressor.needs_model),
        "repeats": repeats,
        "codec_bits": codec.codec_bits,
        "fit_s": codec.fit_s,
        "dtype": cfg.dtype,
        **model_fields(handle, cfg),
        "device": dev,
        **conditions(threads, load_start[0]),
        # 1-minute load average at the start and the end: other jobs on a shared machine slow every time alike
        "loadavg_1m": [load_start[0], os.getloadavg()[0]],
        "compressor_params": compressor.describe(),
        # summed over every call, the warm-up and the repeats included
        "compressor_stats": codec.stats(),
        "git_sha": git_sha(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return summary, rows


def _gbps(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "none"
    return "inf" if math.isinf(x) else f"{x:.3g}"


def _range(r: list[float] | None) -> str:
    return "never" if r is None else f"{_gbps(r[0])}..{_gbps(r[1])}"


def format_restore(s: dict) -> str:
    """The measured table, the modelled TTFT per bandwidth with crossovers, and the projection, for the terminal."""
    load = s.get("loadavg_1m", [math.nan, math.nan])
    lines = [f"  restore {s['compressor']} on {s['model']} ({s['device']}, model {s['model_dtype']}, "
             f"cache {s['dtype']}, {s['torch_threads']} threads, load {load[0]:.1f} -> {load[1]:.1f}, "
             f"median of {s['repeats']})"]
    lines += [f"  note: {n}" for n in s.get("notes", [])]
    lines.append(f"  MEASURED here: {s['measured_here']}")
    lines.append(f"  {'ctx':>6} {'MB coded':>9} {'MB 16-bit':>9} {'KB ids':>8} {'encode s':>9} {'decode s':>9} "
                 f"{'first s':>8} {'prefill s':>9} {'exact':>5} {'tok=16b':>7} {'tok=pf':>6}")
    for m in s["measured"]:
        lines.append(f"  {m['context']:>6} {m['bits'] / 8e6:>9.3f} {m['bits_16bit'] / 8e6:>9.3f} "
                     f"{m['bits_ids'] / 8e3:>8.2f} {m['encode_s']:>9.4f} {m['decode_s']:>9.4f} "
                     f"{m['first_token_s']:>8.4f} {m['prefill_s']:>9.4f} "
                     f"{'yes' if m['exact'] else 'no':>5} {'yes' if m['first_token_matches_16bit'] else 'no':>7} "
                     f"{'yes' if m['first_token_matches_prefill'] else 'no':>6}")
    lines.append(f"  MODELLED: {s['modelled']}")
    lines += _ttft_table(s["rows"], s["crossovers"], "ctx", "context")
    p = s.get("projection") or {}
    lines.append(f"  {p.get('label', PROJECTION_LABEL)}: {p.get('tokens')} tokens, flops "
                 f"{p.get('assumptions', {}).get('flops', math.nan):.3g}/s, memory "
                 f"{p.get('assumptions', {}).get('memory_bytes_per_s', math.nan):.3g} B/s (assumed)")
    if p.get("skipped"):
        lines.append(f"  projection skipped: {p['skipped']}")
    for name, pm in (p.get("models") or {}).items():
        rows = [{**r, "model": name} for r in pm["rows"]]
        lines.append(f"  {name}: {pm['bytes'] / 1e9:.3f} GB coded, {pm['bytes_16bit'] / 1e9:.3f} GB 16-bit; "
                     f"decode {pm['decode_s']:.3g} s, first token {pm['first_token_s']:.3g} s, "
                     f"prefill {pm['prefill_s']:.3g} s")
        lines += _ttft_table(rows, {name: pm["crossovers"]}, "model", "model")
    return "\n".join(lines)


def _ttft_table(rows: list[dict], cross: dict[str, dict], head: str, key: str) -> list[str]:
    lines = [f"  {head:>12} {'Gbit/s':>7} {'TTFT s':>9} {'16-bit s':>9} {'prefill s':>9}  fastest"]
    for r in rows:
        lines.append(f"  {str(r[key]):>12} {r['bandwidth_gbps']:>7g} {r['ttft_s']:>9.4f} {r['ttft_16bit_s']:>9.4f} "
                     f"{r['ttft_prefill_s']:>9.4f}  {r['fastest']}")
    for k, c in cross.items():
        lines.append(f"  {head} {k}: compressed beats 16-bit at {_range(c['compressed_faster_than_16bit_gbps'])} "
                     f"Gbit/s, beats prefill at {_range(c['compressed_faster_than_prefill_gbps'])}, "
                     "fastest of three at "
                     f"{_range(c['compressed_fastest_gbps'])}; 16-bit beats prefill at "
                     f"{_range(c['16bit_faster_than_prefill_gbps'])}")
    return lines
