"""One cell of the benchmark as a plain function: items -> encoder -> bytes -> fresh decoder -> measurements.

Dataset windows (:func:`trace_source`) and multi-session workloads (:func:`kvbench.measure.sessions.workload_source`) are
two sources of the same items; a :class:`~kvbench.core.compressor.SetCompressor` codes all items of a cell into one
bitstream, any other compressor codes them one by one. Either way the decoder is a fresh instance that has only
the config, the codec's state bytes, the stored bitstream and the free context.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from kvbench.coding.bitstream import Bitstream
from kvbench.core.codec import Codec, prepare, state_cache_path
from kvbench.core.compressor import Compressor, SetCompressor
from kvbench.core.items import Item, Source, coding_contexts
from kvbench.core.kv import Context, KVSequence
from kvbench.core.machine import conditions
from kvbench.core.rope import Rotary
from kvbench.core.timing import Stopwatch
from kvbench.inputs.assets import AssetError
from kvbench.inputs.capture import cache_dtype, check_window, load_or_capture, trace_stored
from kvbench.inputs.models import ModelHandle, model_dtype_name, model_fields, model_identity
from kvbench.inputs.positions import allowed_beyond
from kvbench.inputs.workloads import selected as workload_selected
from kvbench.measure.fit_draws import draw_spread
from kvbench.measure.metrics.attention_error import AttentionError, ScoredQueries, continuation_queries
from kvbench.measure.metrics.distortion import DistortionAccumulator
from kvbench.measure.metrics.paired_loss import recall_loss, task_loss
from kvbench.measure.metrics.rate import bound_bits_per_token, rate_summary
from kvbench.measure.metrics.rate_distortion import RD_RATES, gaussian_rd
from kvbench.measure.metrics.task_loss import continuation_nlls
from kvbench.store.results import NLL_KEY, git_sha


def trace_source(cfg: Any, handle: ModelHandle) -> Source:
    """The dataset's evaluation windows (captured once, then reused), each scored on its held-out continuation; a
    window the model cannot take (its positions, the memory) is refused before the model is loaded or run."""
    held = 2 * int(cfg.dataset.n_sequences) + int(cfg.dataset.n_calib)  # the trace's windows, a decoded copy of each
    stored = trace_stored(cfg)
    if not stored:
        check_window(cfg, handle, held)  # before capturing it
    trace = load_or_capture(cfg, handle)
    if stored and cfg.metrics.nll:
        check_window(cfg, handle, held)  # before scoring on it
    if trace.manifest["dtype"] != cfg.dtype:
        raise ValueError(f"trace {trace.path} holds {trace.manifest['dtype']} KV but dtype={cfg.dtype} was asked for")
    # a trace captured before model.dtype existed was captured in float32
    if (made := trace.manifest.get("model_dtype", "float32")) != (want := model_dtype_name(cfg.model, cfg.device)):
        raise ValueError(f"trace {trace.path} was captured by the model in {made} but model.dtype={want} was asked for: "
                         f"its continuation would be scored by another model; set model.dtype={made}")
    ev = trace.eval
    items = [Item(s.kv, s.kv.n_tokens, s.continuation if cfg.metrics.nll else None) for s in ev]
    lp = torch.cat([s.logprobs for s in ev])
    fields = {"bound_bits_per_token": bound_bits_per_token(lp.tolist(), lp.numel()),
              "trace": str(trace.path), "trace_captured": trace.captured,
              "eval_documents": window_documents(trace.manifest, len(ev))}
    return Source(items, lambda: [s.kv for s in trace.calib], fields, str(trace.path))


def window_documents(manifest: dict, n: int) -> list[int]:
    """The document each of a trace's first ``n`` (evaluated) windows is cut from, as its capture recorded
    (``documents``); a trace that records none (captured from a ``trace=PATH`` of another tool) counts every window
    as a document of its own."""
    docs = manifest.get("documents")
    return [int(d) for d in docs[:n]] if isinstance(docs, list) and len(docs) >= n else list(range(n))


#: per-token NLLs with the uncompressed cache, by (trace, model, device, window, scored span): the same for every
#: cell on a trace, so a sweep in one process scores each window's baseline once
_BASE_NLLS: dict[tuple, np.ndarray] = {}
#: how many baseline spans this process has scored (rather than found in _BASE_NLLS)
_BASE_SCORED = [0]
#: the model's queries at a window's scored positions over its exact cache, keyed as _BASE_NLLS (the same for every
#: cell on a trace); the oldest go once they hold more than QUERY_CACHE_BYTES
_BASE_QUERIES: dict[tuple, ScoredQueries] = {}
QUERY_CACHE_BYTES = 1 << 29


def _per_window(store: dict, handle: ModelHandle, trace: str | None, i: int, it: Item, span: int, probe: str,
                compute: Any) -> Any:
    """``compute()`` for dataset window ``i`` of ``trace``, kept in ``store`` for the rest of the process (a model
    built in the process, or no trace, is computed every time)."""
    model = model_identity(handle)
    if trace is None or model is None:
        return compute()
    key = (trace, model, str(handle.device), i, it.score_from, span, probe)
    if key not in store:
        store[key] = compute()
    return store[key]


def _base_nlls(handle: ModelHandle, trace: str | None, i: int, it: Item, cont: torch.Tensor | None = None,
               probe: str = "next") -> np.ndarray:
    """The baseline's per-token NLLs of ``cont`` (default: the held-out continuation) after dataset window ``i`` of
    ``trace``, computed once per process."""
    cont = it.continuation if cont is None else cont

    def score() -> np.ndarray:
        _BASE_SCORED[0] += 1
        return continuation_nlls(handle.model, it.kv.slice_tokens(0, it.score_from), cont)
    return _per_window(_BASE_NLLS, handle, trace, i, it, int(cont.numel()), probe, score)


def _base_queries(handle: ModelHandle, trace: str | None, i: int, it: Item, n: int) -> ScoredQueries:
    """The model's queries at ``n`` of window ``i``'s scored positions (:mod:`~kvbench.measure.metrics.attention_error`),
    computed once per process while they fit in :data:`QUERY_CACHE_BYTES`."""
    qs = _per_window(_BASE_QUERIES, handle, trace, i, it, int(it.continuation.numel()), f"queries/{n}",
                     lambda: continuation_queries(handle.model, it.kv.slice_tokens(0, it.score_from), it.continuation, n))
    while len(_BASE_QUERIES) > 1 and sum(q.nbytes for q in _BASE_QUERIES.values()) > QUERY_CACHE_BYTES:
        del _BASE_QUERIES[next(iter(_BASE_QUERIES))]
    return qs


def recall_probe(tokens: torch.Tensor | None, start: float, span: int) -> torch.Tensor | None:
    """The long-range probe's continuation: ``span + 1`` tokens of the prefix itself, from ``start`` (a fraction of
    its length; never its first token) on, or None (no token ids, ``span`` 0, or a prefix too short).

    Fed after the prefix, it repeats a passage from early in the context (a copy span): its first token cues the
    passage and the next ``span`` are scored. A model reads them back from the cache at a low NLL (induction), so a
    cache that dropped or blurred those old tokens pays, where the next-token continuation mostly reads recent ones.
    """
    if tokens is None or span <= 0:
        return None
    T = int(tokens.numel())
    at = max(1, int(start * T))
    n = min(int(span), T - at - 1)
    return tokens[at : at + n + 1].clone() if n >= 2 else None


def _part_totals(parts: dict[str, int]) -> dict[str, int]:
    # a pipeline's sections are "<segment>/<inner section>"; sum them per inner section
    out: dict[str, int] = {}
    for name, bits in parts.items():
        head, sep, rest = name.partition("/")
        key = f"inner/{rest}" if sep and head.isdigit() else name
        out[key] = out.get(key, 0) + bits
    return out


def geometry(kvs: Sequence[KVSequence]) -> dict[str, int]:
    """The cache's layers, KV heads and head_dim as the trace holds them (a model's cache, read off its windows)."""
    if not kvs:
        return {}
    layers, heads, _, head_dim = kvs[0].shape
    return {"n_layers": int(layers), "n_kv_heads": int(heads), "head_dim": int(head_dim)}


def code(codec: Codec, kvs: Sequence[KVSequence], enc_ctxs: Sequence[Context], dec_ctxs: Sequence[Context],
         enc: Stopwatch, dec: Stopwatch) -> tuple[list[KVSequence], list[int], list[dict[str, int]]]:
    """Encode, keep only the bytes, decode them on the codec's fresh decoder; the bits are counted from the
    stored bytes. A set compressor codes every sequence into one stream."""
    if isinstance(codec.encoder, SetCompressor):
        with enc():
            bs = codec.encoder.encode_set(kvs, enc_ctxs)
        stored = Bitstream.from_bytes(bs.data)
        with dec():
            outs = codec.decoder.decode_set(stored, dec_ctxs)
        return list(outs), [stored.num_bits], [_part_totals(stored.parts)]
    outs, bits, parts = [], [], []
    for kv, ce, cd in tqdm(list(zip(kvs, enc_ctxs, dec_ctxs)), desc=f"{codec.encoder.name}: code", unit="seq",
                           leave=False, disable=None):  # disable=None: a bar on a terminal, silent in sweep logs
        with enc():
            bs = codec.encoder.encode(kv, ce)
        stored = Bitstream.from_bytes(bs.data)
        with dec():
            outs.append(codec.decoder.decode(stored, cd))
        bits.append(stored.num_bits)
        parts.append(stored.parts)
    return outs, bits, parts


def measure(cfg: Any, compressor: Compressor, handle: ModelHandle | None = None) -> tuple[dict, list[dict]]:
    """Run one cell and return ``(summary, rows)``. ``cfg`` is the resolved run config (DictConfig or alike)."""
    measuring = conditions()  # the load before this run adds its own
    started, scored_before = time.perf_counter(), _BASE_SCORED[0]
    handle = handle or ModelHandle(cfg.model, cfg.device)
    if workload_selected(cfg.get("workload")):
        from kvbench.measure.sessions import workload_source

        source = workload_source(cfg, handle, compressor)
    else:
        source = trace_source(cfg, handle)
    dtype = cache_dtype(cfg.dtype)
    model_ref = handle if compressor.needs_model else None
    config = handle.config if compressor.needs_config else None

    codec = prepare(compressor, source.calib, cfg.device, state_cache_path(compressor, source.calib_id), config)
    kvs = [it.kv for it in source.items]
    enc, dec = Stopwatch(cfg.device), Stopwatch(cfg.device)
    outs, bits, parts = code(codec, kvs, *coding_contexts(source.items, model_ref, config), enc, dec)

    dist = DistortionAccumulator()
    dist_all = DistortionAccumulator()  # every entry, an evicted one as the zero vector a decoder leaves there
    lossless, n_tok, n_el = True, 0, 0
    nll_base, nll_comp = [], []  # per-token NLL arrays, one per scored item
    recall_base, recall_comp, recall_of = [], [], []  # the long-range probe's, and which scored item each is
    recall_span, recall_start = int(cfg.metrics.get("recall_tokens", 0) or 0), float(cfg.metrics.get("recall_from", 0.1))
    reused = 0  # scored items whose decoded cache is the captured one, bit for bit
    # metrics.reuse_exact_nll=false scores such a cache again: the check that both paths give the same NLLs
    reuse = bool(cfg.metrics.get("reuse_exact_nll", True))
    attn, n_queries = AttentionError(), int(cfg.metrics.get("attn_queries", 0) or 0)
    for it, kv_hat in tqdm(list(zip(source.items, outs)), desc=f"{compressor.name}: score", unit="seq", leave=False,
                           disable=None):
        kv = it.kv
        if kv_hat.shape != kv.shape or kv_hat.k.dtype != dtype:
            raise RuntimeError(f"{compressor.name} decoded {tuple(kv_hat.shape)} {kv_hat.k.dtype}; expected {tuple(kv.shape)} {dtype}")
        exact = torch.equal(kv_hat.k, kv.k) and torch.equal(kv_hat.v, kv.v)
        lossless &= exact and (kv_hat.kept is None or bool(kv_hat.kept.all()))
        dist.add("k", kv.k, kv_hat.k, kv_hat.kept)
        dist.add("v", kv.v, kv_hat.v, kv_hat.kept)
        dist_all.add("k", kv.k, _dropped_as_zero(kv_hat.k, kv_hat.kept))
        dist_all.add("v", kv.v, _dropped_as_zero(kv_hat.v, kv_hat.kept))
        n_tok += kv.n_tokens
        n_el += kv.n_elements
        if it.continuation is not None:
            trace = None if workload_selected(cfg.get("workload")) else source.fields.get("trace")
            nll_base.append(_base_nlls(handle, trace, len(nll_base), it))
            if reuse and exact and kv_hat.kept is None:
                # the same cache, bit for bit, scores what the baseline scored: the same computation on the same
                # inputs (half of a lossless run's time on CPU)
                nll_comp.append(nll_base[-1].copy())
                reused += 1
            else:
                nll_comp.append(continuation_nlls(handle.model, kv_hat.slice_tokens(0, it.score_from), it.continuation))
            if n_queries > 0:
                attn.add(_base_queries(handle, trace, len(nll_base) - 1, it, n_queries),
                         kv.slice_tokens(0, it.score_from), kv_hat.slice_tokens(0, it.score_from))
            probe = recall_probe(None if kv.tokens is None else kv.tokens[: it.score_from], recall_start, recall_span)
            if probe is not None:
                recall_of.append(len(nll_base) - 1)
                recall_base.append(_base_nlls(handle, trace, recall_of[-1], it, probe, "recall"))
                recall_comp.append(recall_base[-1].copy() if reuse and exact and kv_hat.kept is None else
                                   continuation_nlls(handle.model, kv_hat.slice_tokens(0, it.score_from), probe))

    baseline_mb = n_el * 2 / 1e6
    context = round(n_tok / max(len(kvs), 1))  # tokens per coded sequence
    summary = {
        "compressor": compressor.name,
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "n_sequences": len(kvs),
        "n_tokens": n_tok,
        "n_elements": n_el,
        **geometry(kvs),
        **rate_summary(bits, parts, n_tok, n_el, codec.codec_bits, int(cfg.rate.amortize_tokens)),
        "lossless": bool(lossless),
        "encode_s": enc.seconds,
        "decode_s": dec.seconds,
        "decode_s_per_token": dec.seconds / n_tok if n_tok else math.nan,
        "decode_flops_per_token": compressor.decode_flops_per_token(handle.config if compressor.needs_model else None,
                                                                    context),
        "encode_flops_per_token": compressor.encode_flops_per_token(handle.config if compressor.needs_model else None,
                                                                    context),
        "fit_s": codec.fit_s,
        "fit_cached": codec.cached,
        "encode_MBps": baseline_mb / enc.seconds if enc.seconds else math.inf,
        "decode_MBps": baseline_mb / dec.seconds if dec.seconds else math.inf,
        "rel_mse_k": dist.rel_mse("k"),
        "rel_mse_v": dist.rel_mse("v"),
        "max_abs_err_k": dist.max_abs_err("k"),
        "max_abs_err_v": dist.max_abs_err("v"),
        "cosine_k": dist.cosine("k"),
        "cosine_v": dist.cosine("v"),
        "dropped_fraction": dist.dropped_fraction("k"),
        # rel_mse_* and cosine_* are measured on the kept entries only; the *_all ones over every entry, an evicted
        # one counted as zero (its whole energy is error), so that eviction's loss shows in the distortion too
        "rel_mse_scope": "kept tokens only" if dist.dropped_fraction("k") > 0 else "all tokens",
        "rel_mse_k_all": dist_all.rel_mse("k"),
        "rel_mse_v_all": dist_all.rel_mse("v"),
        "cosine_k_all": dist_all.cosine("k"),
        "cosine_v_all": dist_all.cosine("v"),
        **attn.summary(),  # the error the model's own queries see at the scored positions
        **rd_reference(kvs, dist, lossless, config if config is not None else _config_if_installed(handle),
                       compressor.kind_weights()),
        **task_loss(nll_base, nll_comp, cfg.metrics, source.fields.get("eval_documents")),
        **recall_loss(recall_base, recall_comp, cfg.metrics, source.fields.get("eval_documents"), recall_of),
        "nll_compressed_reused": reused,
        # the cell's wall time from loading the model to its figures, a trace captured (trace_captured) and baseline
        # spans scored by this cell (nll_base_spans_scored; 0: an earlier cell of the process scored them) included
        "measure_s": time.perf_counter() - started,
        "nll_base_spans_scored": _BASE_SCORED[0] - scored_before,
        **source.fields,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "allow_beyond_positions": allowed_beyond(cfg.dataset),
        **model_fields(handle, cfg),
        "compressor_params": compressor.describe(),
        "compressor_facts": compressor.facts(context),
        "compressor_stats": codec.stats(),
        "model_loaded": handle.loaded,
        **measuring,
        "git_sha": git_sha(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        NLL_KEY: (nll_base, nll_comp, (recall_base, recall_comp, recall_of)),  # the run directory's nll.npz
    }
    summary.update(draw_spread(cfg, compressor, handle, source, summary, recall_base, recall_of, code, recall_probe))
    return summary, attn.annotate(dist.rows())


def _dropped_as_zero(x_hat: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """``x_hat`` ``(L, H, T, D)`` with the entries ``kept`` ``(L, H, T)`` marks evicted set to zero, whatever the
    decoder left there."""
    return x_hat if kept is None else x_hat * kept.unsqueeze(-1).to(x_hat.dtype)


def _config_if_installed(handle: ModelHandle) -> Any:
    """The model's config, or None where a run on a stored trace has no model to read it from."""
    try:
        return handle.config
    except (AssetError, OSError):
        return None


def rd_reference(kvs: Sequence[KVSequence], dist: DistortionAccumulator, lossless: bool, config: Any,
                 weights: tuple[float, float] = (1.0, 1.0)) -> dict:
    """The Gaussian rate–distortion rates at the run's relative MSEs (:mod:`kvbench.measure.metrics.rate_distortion`),
    the weighted one with K's and V's error weighed by ``weights`` (the coder's own objective); NaN for a lossless
    run (no finite rate reaches zero error) and for one that evicts (its relative MSE is over the kept vectors only,
    and a dropped vector's cost is not squared error). Keys with RoPE undone need ``config``."""
    if lossless or dist.dropped_fraction("k") > 0 or dist.dropped_fraction("v") > 0:
        return {**dict.fromkeys(RD_RATES, math.nan), "rd_key_weight": weights[0] / weights[1]}
    return gaussian_rd([kv.k for kv in kvs], [kv.v for kv in kvs], dist.rel_mse("k"), dist.rel_mse("v"),
                       None if config is None else Rotary(config), weights)


def format_summary(s: dict) -> str:
    """A compact table for the terminal."""
    rows = [
        ("compressor", s["compressor"]),
        ("model / dataset", f"{s['model']} / {s['dataset']}  ({s['n_sequences']} seq x {s['n_tokens'] // max(s['n_sequences'], 1)} tok)"),
        ("bits / element", f"{s['bits_per_element']:.4f}"),
        ("bits / token", f"{s['bits_per_token']:,.1f}   (bound {s['bound_bits_per_token']:.2f})"),
        ("compression ratio", f"{s['compression_ratio']:.3f}x vs 16-bit"),
        ("lossless", str(s["lossless"])),
        *_distortion_rows(s),
        ("attn logit / output err", _attention_text(s)),
        ("NLL base / comp.", f"{s['nll_base']:.4f} / {s['nll_compressed']:.4f}  over {s.get('eval_tokens', 0):,} tokens"),
        ("delta NLL", _delta_text(s)),
        ("delta NLL, recall", _recall_text(s)),
        ("encode / decode", f"{s['encode_s']:.3f} s ({s['encode_MBps']:.0f} MB/s) / {s['decode_s']:.3f} s ({s['decode_MBps']:.0f} MB/s)"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def _distortion_rows(s: dict) -> list[tuple[str, str]]:
    """rel MSE (and cosine) K / V; where entries were evicted, on the kept ones and over all with evicted as zero,
    each labelled (a summary written before the second was measured shows the first, labelled as measured)."""
    def both(metric: str, suffix: str, fmt: str) -> str:
        return " / ".join(format(s[f"{metric}_{kind}{suffix}"], fmt) for kind in ("k", "v"))

    if not s.get("dropped_fraction"):
        return [("rel MSE  K / V", both("rel_mse", "", ".3e"))]
    rows = [("rel MSE  K / V, kept", f"{both('rel_mse', '', '.3e')}   cosine {both('cosine', '', '.4f')}  "
                                     f"(kept tokens only; {s['dropped_fraction']:.1%} evicted)")]
    if "rel_mse_k_all" in s:
        rows.append(("rel MSE  K / V, all", f"{both('rel_mse', '_all', '.3e')}   cosine {both('cosine', '_all', '.4f')}  "
                                            "(all tokens, evicted as zero)"))
    return rows


def _attention_text(s: dict) -> str:
    n = s.get("attn_queries", 0)
    return (f"{s.get('attn_logit_rel_mse', math.nan):.3e} / {s.get('attn_output_rel_err', math.nan):.3e}  "
            f"(rel MSE of q.k / rel error of the attention output; {n} queries per window)")


def _recall_text(s: dict) -> str:
    lo, hi = s.get("delta_nll_recall_ci", [math.nan, math.nan])
    return (f"{s.get('delta_nll_recall', math.nan):+.4f} nats, 95% CI [{lo:+.4f}, {hi:+.4f}]  "
            f"(a copy of an early passage, {s.get('recall_tokens', 0):,} tokens)")


def _delta_text(s: dict) -> str:
    lo, hi = s.get("delta_nll_ci", [math.nan, math.nan])
    n = s.get("eval_documents_n")
    docs = f"; {n} document{'s' if n != 1 else ''}" if n is not None else ""
    need = s.get("delta_nll_documents_needed", "absent")
    more = "" if need == "absent" else ("; on the line" if need is None else f"; about {need} would decide")
    return (f"{s['delta_nll']:+.4f} nats, 95% CI [{lo:+.4f}, {hi:+.4f}]  ({s.get('delta_nll_verdict_1pct', '?')} "
            f"1% of base{docs}{more})")
