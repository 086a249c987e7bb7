"""Token eviction on kvbench's axes: keep a fraction of the cache per layer and KV head, count every stored bit.

Eviction methods (kvpress calls them "presses") score each cached token and drop the low scorers. They are usually
reported as the fraction of tokens pruned; here a method is a compressor like any other and pays for what its
decoder needs:

- the kept KV, at 16 bits or through any ``inner`` compressor (``inner=turboquant``: eviction, then quantization
  of what is left). Every (layer, KV head) keeps exactly ``round(keep * T)`` entries, so the kept KV packs as
  ``(L, H, K, D)`` and the inner compressor codes it as a sequence of ``K`` tokens;
- the kept positions of every (layer, KV head) (methods keep different positions per head: KNorm and SnapKV
  overlap by about half between heads on SmolLM2), entropy coded as whichever of two encodings is smaller,
  one flag per stream saying which (:func:`encode_positions`);
- the kept count, the flag and the model of the position coder, in a small header.

The decoder returns the full ``(L, H, T, D)`` shape with zeros at evicted entries and ``kept`` set; the harness
hides evicted entries from attention at their original positions (:mod:`kvbench.cache.eviction_mask`) and measures
distortion on kept entries only. Decoders never need the model: methods that score with attention recompute the
queries in the encoder (:func:`capture_queries`) and declare ``needs_model``.

A method is a small dataclass that implements :meth:`Eviction.scores` (higher = keep) and names the tokens it
always keeps (``sinks``: the first tokens, ``window``: the last ones) where it has them. Ties are broken towards
the earlier token, so a selection is a deterministic function of the scores.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvbench.coding.bitstream import Bitstream, BitstreamError, read_varints, varints
from kvbench.coding.entropy import StreamDecoder, StreamEncoder
from kvbench.coding.packing import pack_codes, tensor_from_bytes, tensor_to_bytes, unpack_codes
from kvbench.core.checks import check_choice, check_range
from kvbench.core.compressor import Compressor, Section, SetCompressor
from kvbench.core.kv import Context, KVSequence

#: how the kept positions of a stream are coded (the flag in the header)
MASK, GAPS, ALL = 0, 1, 2
#: queries per attention block when scoring: bounds the ``(heads, queries, T)`` probabilities held at once
QUERY_CHUNK = 256


# ---------------------------------------------------------------------------------------------- selection


def n_kept(owner: str, keep: float, n_tokens: int) -> int:
    """``round(keep * T)`` (halves round up), the entries each (layer, KV head) keeps; at least one."""
    k = math.floor(keep * n_tokens + 0.5)
    if k < 1:
        raise ValueError(f"{owner}.keep={keep!r} keeps round({keep} x {n_tokens}) = 0 of {n_tokens} tokens per head; "
                         f"allowed for {n_tokens} tokens: {0.5 / n_tokens:.6g} <= keep <= 1")
    return k


def select(scores: torch.Tensor, k: int, sinks: int = 0, window: int = 0) -> torch.Tensor:
    """The ``k`` entries of every row of ``scores`` ``(L, H, T)`` to keep, as a ``(L, H, T)`` bool mask.

    The first ``sinks`` and last ``window`` tokens are kept before any scored token (sinks first, earliest first,
    then the window, latest first, when the budget cannot hold them all); the rest go by score, ties to the
    earlier token. NaN scores rank lowest.
    """
    L, H, T = scores.shape
    pos = torch.arange(T, dtype=torch.float64)
    tier = torch.zeros(T, dtype=torch.int64)  # (T,) 2: sink, 1: window, 0: scored
    tier[max(0, T - window) :] = 1
    tier[: min(sinks, T)] = 2
    key = torch.nan_to_num(scores.double(), nan=-math.inf)  # (L, H, T)
    key = torch.where(tier == 2, -pos, torch.where(tier == 1, pos, key))
    # lexicographic (tier, key) descending: two stable sorts, the second on the more significant key
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # (L, H, T)
    by_tier = torch.sort(tier.expand(L, H, T).gather(-1, order), dim=-1, descending=True, stable=True).indices
    top = order.gather(-1, by_tier)[..., :k]  # (L, H, k)
    return torch.zeros(L, H, T, dtype=torch.bool).scatter_(-1, top, True)


# ---------------------------------------------------------------------------------------------- positions


def _bit_length(x: np.ndarray) -> np.ndarray:
    return np.frexp(x.astype(np.float64))[1].astype(np.int64)  # exact for integers below 2**53; 0 -> 0


@dataclass(frozen=True)
class CodedPositions:
    """The kept positions of a stream: the header (kept count, flag, coder model) and the coded sections."""

    header: bytes
    sections: dict[str, Section]
    flag: int

    @property
    def bits(self) -> int:
        return 8 * len(self.header) + sum(8 * len(s) if isinstance(s, (bytes, bytearray)) else s[1]
                                          for s in self.sections.values())


def _code_mask(mask: np.ndarray, k: int) -> CodedPositions:
    """Every row's bitmask, range-coded under the Bernoulli model ``P(kept) = k / T`` that the kept count fixes
    (about ``log2 C(T, k)`` bits a row, the cost of a uniformly random choice: 0 bits of model side information)."""
    T = mask.shape[1]
    enc = StreamEncoder()
    enc.categorical(mask.reshape(-1).astype(np.int32), np.array([1 - k / T, k / T]))
    return CodedPositions(varints([k, MASK]), {"positions": enc.finish()}, MASK)


def _gaps(mask: np.ndarray, k: int) -> np.ndarray:
    pos = np.nonzero(mask)[1].reshape(mask.shape[0], k)  # (R, k), increasing within each row
    return np.diff(pos, axis=1, prepend=-1) - 1  # (R, k) tokens skipped before each kept one


def _code_gaps(mask: np.ndarray, k: int) -> CodedPositions:
    """Gaps between kept positions (tokens skipped before each kept one), Elias-gamma style: the gap's bit length
    range-coded under the stream's own histogram of bit lengths (sent in the header), then its bits below the
    leading one, stored as they are. Runs of kept tokens (sinks, windows, pooled neighbourhoods) are gaps of 0 and
    cost a fraction of a bit each; the gap after the last kept token is implied by ``T``."""
    T = mask.shape[1]
    g = _gaps(mask, k).reshape(-1)  # (R * k,)
    length = _bit_length(g)  # (R * k,) 0 for a gap of 0
    counts = np.bincount(length, minlength=int(_bit_length(np.array([T - k]))[0]) + 1)
    enc = StreamEncoder()
    enc.categorical(length.astype(np.int32), counts / counts.sum())
    low = _low_bits(g, length)
    return CodedPositions(varints([k, GAPS, *counts.tolist()]),
                          {"positions": enc.finish(), "positions.low_bits": pack_codes(low, 1)}, GAPS)


def _low_bits(g: np.ndarray, length: np.ndarray) -> np.ndarray:
    width = np.maximum(length - 1, 0)  # (N,) bits below the leading one
    j = np.arange(max(int(width.max(initial=0)), 1))
    bits = (g[:, None] >> j) & 1  # (N, W)
    return bits[j < width[:, None]].astype(np.uint8)  # gap by gap, low bit first


def encode_positions(kept: torch.Tensor) -> CodedPositions:
    """The kept positions ``(L, H, T)`` bool (the same count in every row) in whichever of the bitmask and the gap
    code is smaller, counting the header of each."""
    L, H, T = kept.shape
    mask = kept.reshape(L * H, T).numpy()
    k = int(mask[0].sum())
    if not (mask.sum(1) == k).all():
        raise ValueError("every (layer, KV head) must keep the same number of entries")
    if k == T:
        return CodedPositions(varints([k, ALL]), {}, ALL)
    return min(_code_mask(mask, k), _code_gaps(mask, k), key=lambda c: c.bits)


def decode_positions(header: bytes, sec: Mapping[str, bytes], shape: tuple[int, int, int]) -> torch.Tensor:
    """Inverse of :func:`encode_positions`: the kept mask ``(L, H, T)``."""
    L, H, T = shape
    R = L * H
    (k, flag), at = read_varints(header, 2)
    if not 1 <= k <= T or flag not in (MASK, GAPS, ALL):
        raise BitstreamError(f"eviction header says {k} kept of {T} tokens with position code {flag}")
    if flag == ALL:
        if k != T:
            raise BitstreamError(f"eviction header says every token is kept but only {k} of {T}")
        return torch.ones(L, H, T, dtype=torch.bool)
    if "positions" not in sec:
        raise BitstreamError("eviction bitstream has no positions section")
    dec = StreamDecoder(sec["positions"])
    if flag == MASK:
        mask = dec.categorical(R * T, np.array([1 - k / T, k / T])).reshape(R, T).astype(bool)
    else:
        n_len = int(_bit_length(np.array([T - k]))[0]) + 1
        counts, _ = read_varints(header, n_len, at)
        counts = np.asarray(counts, dtype=np.int64)
        if counts.sum() != R * k:
            raise BitstreamError(f"eviction gap histogram counts {counts.sum()} gaps; expected {R * k}")
        length = dec.categorical(R * k, counts / counts.sum()).astype(np.int64)  # (R * k,)
        width = np.maximum(length - 1, 0)
        low = unpack_codes(sec.get("positions.low_bits", b""), 1, int(width.sum())).numpy().astype(np.int64)
        j = np.arange(max(int(width.max(initial=0)), 1))
        below = j < width[:, None]  # (N, W)
        bits = np.zeros(below.shape, dtype=np.int64)
        bits[below] = low
        g = np.where(length > 0, np.left_shift(1, np.maximum(length - 1, 0)) + (bits << j).sum(1), 0)
        pos = np.cumsum(g.reshape(R, k) + 1, axis=1) - 1  # (R, k)
        if pos[:, -1].max() >= T:
            raise BitstreamError(f"eviction positions run past the {T} tokens of the sequence")
        mask = np.zeros((R, T), dtype=bool)
        np.put_along_axis(mask, pos, True, axis=1)
    if not (mask.sum(1) == k).all():
        raise BitstreamError(f"eviction positions do not keep {k} entries in every (layer, KV head)")
    return torch.from_numpy(mask).reshape(L, H, T)


# ---------------------------------------------------------------------------------------------- the base


def _embed(inner_bs: Bitstream) -> dict[str, Section]:
    """The inner stream as outer sections, ``inner/frame`` (its header and checksum) and each of its sections at
    its exact bit count, so that the outer stream counts exactly the inner stream's bits."""
    stored = Bitstream.from_bytes(inner_bs.data)
    payloads = stored.sections()
    body = sum(len(p) for p in payloads.values())
    out: dict[str, Section] = {"inner/frame": stored.data[: len(stored.data) - 4 - body] + stored.data[-4:]}
    out.update({f"inner/{name}": (raw, stored.parts[name]) for name, raw in payloads.items()})
    return out


def _unembed(sec: Mapping[str, bytes]) -> Bitstream:
    frame = sec.get("inner/frame")
    if frame is None or len(frame) < 4:
        raise BitstreamError("eviction bitstream has no inner stream")
    payloads = [raw for name, raw in sec.items() if name.startswith("inner/") and name != "inner/frame"]
    return Bitstream.from_bytes(frame[:-4] + b"".join(payloads) + frame[-4:])


@dataclass
class Eviction(Compressor):
    """Keep the ``keep`` fraction of tokens with the highest :meth:`scores` in every (layer, KV head).

    ``keep``: fraction of the ``T`` tokens each (layer, KV head) keeps, ``0 < keep <= 1`` (``round(keep * T)``
    entries, at least one). ``inner``: how the kept KV is stored; None stores it at 16 bits, else a compressor
    (a config name such as ``turboquant``, a ``{name: ..., FIELD: ...}`` node or a Compressor) that codes the kept
    vectors as a sequence of ``K`` tokens. That sequence is not contiguous in position, so an inner coder that
    models RoPE or neighbouring tokens sees the kept tokens side by side.
    """

    keep: float = 0.5
    inner: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.keep, bool) or not isinstance(self.keep, (int, float)) or not 0 < self.keep <= 1:
            raise ValueError(f"{self.name}.keep={self.keep!r} is out of range; allowed: 0 < keep <= 1 "
                             "(the fraction of tokens each layer and KV head keeps)")
        for field in ("sinks", "window"):
            if hasattr(self, field):
                check_range(self.name, field, getattr(self, field), 0, 1 << 30, integer=True)
        if self.inner is not None:
            from compressors.dedup.pipeline import resolve_compressor

            self.inner = resolve_compressor(self.inner, f"{self.name}.inner")
            if isinstance(self.inner, (SetCompressor, Eviction)) or self.inner.needs_model:
                raise ValueError(f"{self.name}.inner={self.inner.name!r} cannot code the kept vectors: give a "
                                 "per-sequence compressor that needs no model and keeps every token (e.g. turboquant)")
            self.needs_config = bool(self.inner.needs_config)  # what the harness hands over depends on the inner
        self._stats: dict[str, float] = {}

    # ---- what a method provides

    @abc.abstractmethod
    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        """``(L, H, T)`` importance of every cached entry; higher is kept first."""

    def protected(self, n_tokens: int, n_keep: int) -> tuple[int, int]:
        """``(sinks, window)``: how many first and last tokens are always kept (fields of the same names)."""
        return int(getattr(self, "sinks", 0)), int(getattr(self, "window", 0))

    def kept_mask(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        """The ``(L, H, T)`` bool mask the encoder keeps."""
        L, H, T, _ = kv.shape
        k = n_kept(self.name, self.keep, T)
        if k == T:
            return torch.ones(L, H, T, dtype=torch.bool)
        started = time.perf_counter()
        scores = self.scores(kv, ctx)
        self._add("score_s", time.perf_counter() - started)
        if tuple(scores.shape) != (L, H, T):
            raise RuntimeError(f"{self.name} scored shape {tuple(scores.shape)}; expected {(L, H, T)}")
        return select(scores, k, *self.protected(T, k))

    # ---- fitted state of the inner compressor, delegated as in the pipeline

    def fit(self, calib: Sequence[KVSequence], config: Any = None) -> None:
        """Fit the inner compressor on the calibration windows (all their tokens: the kept ones are a subset of
        the same distribution, and a scorer that needs the model has none here)."""
        if self.inner is not None:
            self.inner.fit(calib, config=config)

    def state(self) -> dict[str, Section]:
        return {} if self.inner is None else {f"inner/{k}": v for k, v in self.inner.state().items()}

    def load_state(self, sections: Mapping[str, bytes]) -> None:
        stray = sorted(k for k in sections if not k.startswith("inner/"))
        if stray or (sections and self.inner is None):
            raise ValueError(f"{self.name} state sections must belong to its inner compressor; got {sorted(sections)}")
        if self.inner is not None:
            self.inner.load_state({k.removeprefix("inner/"): v for k, v in sections.items()})

    def stats(self) -> dict[str, Any]:
        inner = {} if self.inner is None else {f"inner.{k}": v for k, v in self.inner.stats().items()}
        return {**self._stats, **inner}

    def _add(self, key: str, value: float) -> None:
        self._stats[key] = self._stats.get(key, 0.0) + value

    # ---- coding

    def _inner_ctx(self, ctx: Context, k: int) -> Context:
        return Context(ctx.n_layers, ctx.n_heads, k, ctx.head_dim, ctx.dtype, config=ctx.config, start=ctx.start)

    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream:
        L, H, T, D = kv.shape
        kept = self.kept_mask(kv, ctx)  # (L, H, T)
        k = int(kept[0, 0].sum())
        pos = encode_positions(kept)
        self._add("positions_bits", pos.bits)
        self._add("positions_gap_coded", float(pos.flag == GAPS))
        sections: dict[str, Section] = {"header": pos.header, **pos.sections}
        k_kept = kv.k[kept].reshape(L, H, k, D)  # (L, H, K, D), kept positions in order
        v_kept = kv.v[kept].reshape(L, H, k, D)  # (L, H, K, D)
        if self.inner is None:
            sections.update({"k": tensor_to_bytes(k_kept), "v": tensor_to_bytes(v_kept)})
        else:
            sections.update(_embed(self.inner.encode(KVSequence(k_kept, v_kept), self._inner_ctx(ctx, k))))
        return Bitstream.pack(self.name, sections)

    def decode(self, bs: Bitstream, ctx: Context) -> KVSequence:
        sec = bs.sections(expect=self.name)
        L, H, T, D = ctx.shape
        if "header" not in sec:
            raise BitstreamError(f"{self.name} bitstream has no header section")
        kept = decode_positions(sec["header"], sec, (L, H, T))  # (L, H, T)
        k = int(kept[0, 0].sum())
        if self.inner is None:
            if "k" not in sec or "v" not in sec:
                raise BitstreamError(f"{self.name} bitstream has no 16-bit KV (written with an inner compressor?)")
            k_kept = tensor_from_bytes(sec["k"], ctx.dtype, (L, H, k, D))
            v_kept = tensor_from_bytes(sec["v"], ctx.dtype, (L, H, k, D))
        else:
            out = self.inner.decode(_unembed(sec), self._inner_ctx(ctx, k))
            k_kept, v_kept = out.k.to(ctx.dtype), out.v.to(ctx.dtype)
        k_full = torch.zeros(L, H, T, D, dtype=ctx.dtype)
        v_full = torch.zeros(L, H, T, D, dtype=ctx.dtype)
        k_full[kept] = k_kept.reshape(-1, D)
        v_full[kept] = v_kept.reshape(-1, D)
        return KVSequence(k_full, v_full, kept=kept)


# ---------------------------------------------------------------------------------------------- queries


def _module(ref: Any, owner: str) -> torch.nn.Module:
    if ref is None:
        raise ValueError(f"{owner} scores with the model's queries: the encoder needs the model in the context "
                         "(needs_model=True; the harness passes it)")
    return ref if isinstance(ref, torch.nn.Module) else ref.model


@dataclass
class Queries:
    """Queries of the tokens ``first .. T - 1`` with RoPE at their own positions, and what attention needs."""

    q: torch.Tensor  # (L, Hq, T - first, D) float32, post-RoPE
    q_pre: torch.Tensor  # (L, Hq, T - first, D) float32, before RoPE
    first: int
    scaling: list[float]  # per layer: the logit scale (head_dim**-0.5, or Gemma's query_pre_attn_scalar**-0.5)
    sliding: list[int | None]  # per layer: the sliding window, None for full attention
    softcap: list[float | None]  # per layer: logit soft-capping, None when the model has none
    config: Any


@torch.no_grad()
def capture_queries(owner: str, kv: KVSequence, ctx: Context, first: int) -> Queries:
    """Run the model on ``kv.tokens`` and recompute the queries of tokens ``first ..`` from each attention's input.

    Keys alone do not give queries, so the encoder runs the decoder stack once (no LM head) with a forward
    pre-hook on every attention module that applies its own ``q_proj`` (and ``q_norm`` where the model has one)
    to the hidden states it receives. RoPE is applied with :class:`kvbench.core.rope.Rotary` at the queries' own
    positions (``ctx.start + t``). As a guard, the same pass recomputes every layer's keys; they must match the
    cached ones, else the model is not the one that made the cache (or the segment does not start the sequence:
    its queries would depend on tokens before it, which the encoder does not have).
    """
    from kvbench.core.rope import Rotary

    model = _module(ctx.model, owner)
    if kv.tokens is None:
        raise ValueError(f"{owner} recomputes queries from the token ids, but this sequence has none")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    device = next(model.parameters()).device
    T = kv.n_tokens
    q_pre, k_pre, scaling, sliding, softcap = [], [], [], [], []

    def hook(attn: Any, args: tuple, kwargs: dict) -> None:
        hidden = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).float()  # (1, T, hidden)
        D = attn.head_dim
        q = attn.q_proj(hidden[:, first:]).view(1, T - first, -1, D).transpose(1, 2)  # (1, Hq, n, D)
        k = attn.k_proj(hidden).view(1, T, -1, D).transpose(1, 2)  # (1, H, T, D)
        if getattr(attn, "q_norm", None) is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q_pre.append(q[0].float().cpu())
        k_pre.append(k[0].float().cpu())
        scaling.append(float(attn.scaling))
        sliding.append(getattr(attn, "sliding_window", None))
        softcap.append(getattr(attn, "attn_logit_softcapping", None))

    hooks = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in decoder.layers]
    try:
        positions = torch.arange(ctx.start, ctx.start + T, device=device).unsqueeze(0)  # (1, T)
        decoder(input_ids=kv.tokens.to(device).unsqueeze(0), position_ids=positions, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    if len(q_pre) != kv.shape[0]:
        raise ValueError(f"{owner}: the model has {len(q_pre)} attention layers; the cache has {kv.shape[0]}")
    rope = Rotary(model.config)
    keys = rope.apply(torch.stack(k_pre), ctx.start)  # (L, H, T, D)
    cached = kv.k.float()
    err = float((keys - cached).norm() / cached.norm().clamp_min(1e-12)) if keys.shape == cached.shape else math.inf
    if err > 0.05:
        raise ValueError(f"{owner}: the model in the context does not reproduce this sequence's keys (relative "
                         f"error {err:.3g}); queries are recomputed from kv.tokens with the model that made the "
                         "cache, from the sequence's first token")
    q_pre_all = torch.stack(q_pre)  # (L, Hq, n, D)
    return Queries(rope.apply(q_pre_all, ctx.start + first), q_pre_all, first, scaling, sliding, softcap,
                   model.config)


def attention_sums(qs: Queries, k: torch.Tensor) -> torch.Tensor:
    """``(L, Hq, T)``: attention probabilities of every captured query on every key, summed over the queries.

    Causal (query ``first + i`` sees keys ``<= first + i``), within the layer's sliding window, soft-capped as in
    the model; computed per layer in blocks of ``QUERY_CHUNK`` queries.
    """
    L, H, T, _ = k.shape
    Hq, n = qs.q.shape[1], qs.q.shape[2]
    out = torch.zeros(L, Hq, T)
    for layer in range(L):
        keys = k[layer].float().repeat_interleave(Hq // H, dim=0)  # (Hq, T, D)
        for c in range(0, n, QUERY_CHUNK):
            q = qs.q[layer, :, c : c + QUERY_CHUNK]  # (Hq, c, D)
            q_pos = torch.arange(qs.first + c, qs.first + c + q.shape[1]).unsqueeze(1)  # (c, 1)
            lo, hi = 0, int(q_pos[-1]) + 1  # keys a query of this block can see: causal, and within the window
            if qs.sliding[layer]:
                lo = max(0, int(q_pos[0]) - qs.sliding[layer] + 1)
            key_pos = torch.arange(lo, hi)  # (S,)
            logits = q @ keys[:, lo:hi].transpose(1, 2) * qs.scaling[layer]  # (Hq, c, S)
            if qs.softcap[layer]:
                logits = torch.tanh(logits / qs.softcap[layer]) * qs.softcap[layer]
            visible = key_pos <= q_pos  # (c, S)
            if qs.sliding[layer]:
                visible &= q_pos - key_pos < qs.sliding[layer]
            logits = logits.masked_fill(~visible, -math.inf)
            out[layer, :, lo:hi] += torch.softmax(logits, dim=-1).sum(1)
    return out


def per_kv_head(x: torch.Tensor, n_kv_heads: int, reduce: str = "sum") -> torch.Tensor:
    """``(L, Hq, T)`` -> ``(L, H, T)``: the query heads of each KV head's group, summed or averaged."""
    L, Hq, T = x.shape
    grouped = x.reshape(L, n_kv_heads, Hq // n_kv_heads, T)
    return grouped.sum(2) if reduce == "sum" else grouped.mean(2)


# ---------------------------------------------------------------------------------------------- methods


@dataclass
class StreamingLLM(Eviction):
    """StreamingLLM (Xiao, Tian, Chen, Han, Lewis, "Efficient Streaming Language Models with Attention Sinks",
    arXiv 2309.17453): the first ``sinks`` tokens (attention sinks) and the most recent ones; ``keep`` sets the
    recent window to ``round(keep * T) - sinks`` tokens. The positions cost a few bits per head."""

    sinks: int = 4

    name = "streaming_llm"

    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        L, H, T, _ = kv.shape
        return torch.arange(T, dtype=torch.float32).expand(L, H, T)  # (L, H, T) the most recent first


@dataclass
class KNorm(Eviction):
    """KNorm (Devoto, Zhao, Scardapane, Minervini, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
    Compression", arXiv 2406.11430): keep the keys with the lowest L2 norm, which draw the most attention."""

    name = "knorm"

    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        return -kv.k.float().norm(dim=-1)  # (L, H, T)


@dataclass
class RandomEviction(Eviction):
    """Uniformly random eviction with a seeded generator: the floor every scoring method must beat."""

    seed: int = 0

    name = "random_eviction"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range(self.name, "seed", self.seed, 0, (1 << 63) - 1, integer=True)

    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        return torch.rand(kv.shape[:3], generator=torch.Generator().manual_seed(int(self.seed)))  # (L, H, T)


@dataclass
class SnapKV(Eviction):
    """SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469).

    The last ``window`` tokens are the observation window and are kept; every earlier key is scored by the
    attention the window's queries pay it, summed over the window, pooled along the tokens (``pooling`` over
    ``kernel`` neighbours, so that a kept token brings its neighbourhood) and summed over the query heads that
    share the KV head. The encoder recomputes the window's queries with the model (:func:`capture_queries`).
    """

    window: int = 64
    kernel: int = 5
    pooling: str = "max"

    name = "snapkv"
    needs_model = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range(self.name, "window", self.window, 1, 1 << 30, integer=True)
        check_range(self.name, "kernel", self.kernel, 1, 1 << 10, integer=True)
        if self.kernel % 2 == 0:
            raise ValueError(f"snapkv.kernel={self.kernel} must be odd, so that pooling is centred on each token")
        check_choice(self.name, "pooling", self.pooling, ("max", "avg"))

    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        L, H, T, _ = kv.shape
        w = min(self.window, T - 1)  # at least one token outside the window
        qs = capture_queries(self.name, kv, ctx, T - w)
        attn = attention_sums(qs, kv.k)[..., : T - w]  # (L, Hq, T - w) the window's own keys are kept anyway
        pool = torch.nn.functional.max_pool1d if self.pooling == "max" else torch.nn.functional.avg_pool1d
        kwargs = {} if self.pooling == "max" else {"count_include_pad": False}
        pooled = pool(attn.reshape(-1, 1, T - w), self.kernel, stride=1, padding=self.kernel // 2, **kwargs)
        scores = per_kv_head(pooled.reshape(attn.shape), H)  # (L, H, T - w)
        return torch.nn.functional.pad(scores, (0, w))  # (L, H, T) the window is protected


@dataclass
class TOVA(Eviction):
    """TOVA (Oren, Hassid, Yarden, Adi, Schwartz, "Transformers are Multi-State RNNs", arXiv 2401.06104): keep
    the tokens the last token's query attends to most, per KV head (summed over its query heads). The last
    ``window`` tokens (the current token) are always kept."""

    window: int = 1

    name = "tova"
    needs_model = True

    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        T = kv.n_tokens
        return per_kv_head(attention_sums(capture_queries(self.name, kv, ctx, T - 1), kv.k), kv.shape[1])


@dataclass
class H2O(Eviction):
    """H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
    arXiv 2306.14048): heavy hitters by attention accumulated over every query of the prefill (causal, so an early
    key collects from more queries), summed over each KV head's query heads, plus the most recent tokens.
    ``recent`` is the share of the budget given to the recent window (the paper splits it evenly)."""

    recent: float = 0.5

    name = "h2o"
    needs_model = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range(self.name, "recent", self.recent, 0.0, 1.0)

    def protected(self, n_tokens: int, n_keep: int) -> tuple[int, int]:
        return 0, math.floor(self.recent * n_keep + 0.5)

    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        return per_kv_head(attention_sums(capture_queries(self.name, kv, ctx, 0), kv.k), kv.shape[1])


@dataclass
class ExpectedAttention(Eviction):
    """Expected attention (kvpress's ExpectedAttentionPress, NVIDIA; Devoto et al. 2025, arXiv 2510.00636):
    score each key by the attention that future queries are expected to pay it, times its value's norm.

    Simplified as kvpress does: the queries before RoPE are modelled as one Gaussian whose mean ``mu`` and
    covariance ``S`` are those of the sequence's queries after the ``sinks`` (the last ``query_window`` ones
    when that is > 0), per layer and query head. RoPE of the next ``future`` positions is averaged into one
    matrix ``R`` (the mean of the rotations, not a mixture), so a future query is ``N(R mu, R S R^T)`` and, with
    logit scale ``s``, ``E[exp(s q.k)] = exp(s k.R mu + s^2 k^T R S R^T k / 2)``. Softmax over the keys after the
    sinks gives the expected attention, averaged over the query heads of a KV head, then (``value_norm``)
    ``(score + epsilon) * ||v||``. The sinks are always kept. Logit soft-capping and sliding windows are ignored
    in the expectation.
    """

    sinks: int = 4
    future: int = 512
    query_window: int = 0
    covariance: bool = True
    value_norm: bool = True
    epsilon: float = 0.0

    name = "expected_attention"
    needs_model = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range(self.name, "future", self.future, 1, 1 << 30, integer=True)
        check_range(self.name, "query_window", self.query_window, 0, 1 << 30, integer=True)
        check_range(self.name, "epsilon", self.epsilon, 0.0, math.inf)
        check_choice(self.name, "covariance", self.covariance, (True, False))
        check_choice(self.name, "value_norm", self.value_norm, (True, False))

    def _mean_rotation(self, qs: Queries, start: int, D: int) -> torch.Tensor:
        """``(L, D, D)`` M with ``x @ M`` = the averaged RoPE of the next ``future`` positions applied to ``x``."""
        from kvbench.core.rope import Rotary

        cos, sin = Rotary(qs.config).angles(self.future, start)  # (L, 1, F, R)
        c, s = cos.mean(2), sin.mean(2)  # (L, 1, R)
        R = c.shape[-1]
        eye = torch.eye(D).expand(c.shape[0], D, D)  # (L, D, D) row j = e_j
        half = eye[..., :R].chunk(2, dim=-1)
        rot = eye[..., :R] * c + torch.cat([-half[1], half[0]], dim=-1) * s  # RoPE's rotate-half pairing  # (L, D, R) row j = averaged rotation of e_j
        return torch.cat([rot, eye[..., R:]], dim=-1)  # (L, D, D)

    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        L, H, T, D = kv.shape
        sinks = min(self.sinks, T - 1)
        first = sinks if self.query_window == 0 else max(sinks, T - self.query_window)
        qs = capture_queries(self.name, kv, ctx, first)
        Hq = qs.q_pre.shape[1]
        M = self._mean_rotation(qs, ctx.start + T, D)  # (L, D, D)
        mu = torch.einsum("lhd,lde->lhe", qs.q_pre.mean(2), M)  # (L, Hq, D)
        keys = kv.k.float().repeat_interleave(Hq // H, dim=1)  # (L, Hq, T, D)
        scale = torch.tensor(qs.scaling).view(L, 1, 1)
        logits = torch.einsum("lhd,lhtd->lht", mu, keys) * scale  # (L, Hq, T)
        if self.covariance:
            centred = qs.q_pre - qs.q_pre.mean(2, keepdim=True)  # (L, Hq, n, D)
            cov = centred.transpose(2, 3) @ centred / centred.shape[2]  # (L, Hq, D, D)
            cov = M.transpose(1, 2).unsqueeze(1) @ cov @ M.unsqueeze(1)  # (L, Hq, D, D) R S R^T
            logits = logits + 0.5 * scale**2 * ((keys @ cov) * keys).sum(-1)
        logits[..., :sinks] = -math.inf  # the sinks are kept; the expectation is over the other keys
        expected = per_kv_head(torch.softmax(logits, dim=-1), H, reduce="mean")  # (L, H, T)
        if self.value_norm:
            expected = (expected + self.epsilon) * kv.v.float().norm(dim=-1)
        return expected
