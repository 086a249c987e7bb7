"""Token eviction on kvbench's axes: keep a fraction of the cache per layer and KV head, count every stored bit.

Eviction methods (kvpress calls them "presses") score each cached token and drop the low scorers. They are usually
reported as the fraction of tokens pruned; here a method is a compressor like any other and pays for what its
decoder needs:

- the kept KV, at 16 bits or through any ``inner`` compressor (``inner=turboquant``: eviction, then quantization
  of what is left). Every (layer, KV head) keeps exactly ``floor(keep * T)`` entries (kvpress's count), so the kept KV packs as
  ``(L, H, K, D)`` and the inner compressor codes it as a sequence of ``K`` tokens;
- the kept positions of every (layer, KV head) (most methods keep different positions per head: KNorm and SnapKV
  overlap by about half between heads on SmolLM2; TOVA by default keeps one set per layer, coded once per head),
  entropy coded as whichever of two encodings is smaller,
  one flag per stream saying which (:func:`compressors.eviction.kept_positions.encode_positions`);
- the kept count, the flag and the model of the position coder, in a small header.

The decoder returns the full ``(L, H, T, D)`` shape with zeros at evicted entries and ``kept`` set; the harness
hides evicted entries from attention at their original positions (:mod:`kvbench.cache.eviction_mask`) and measures
distortion on kept entries only. Decoders never need the model: methods that score with attention recompute the
queries in the encoder (:func:`compressors.eviction.query_attention.capture_queries`) and declare ``needs_model``.

A method is a small dataclass in a module of its own that implements :meth:`Eviction.scores` (higher = keep) and
names the tokens it always keeps (``sinks``: the first tokens, ``window``: the last ones) where it has them. Ties
are broken towards the earlier token, so a selection is a deterministic function of the scores (:func:`select`).
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from compressors.eviction.kept_positions import GAPS, decode_positions, encode_positions
from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.coding.packing import tensor_from_bytes, tensor_to_bytes
from kvbench.core.checks import check_range
from kvbench.core.compressor import Compressor, Kept, Section, SetCompressor
from kvbench.core.kv import Context, KVSequence

# ---------------------------------------------------------------------------------------------- selection


#: how far below a whole number ``keep * T`` may fall and still count as it (``0.3 * 10`` is 3 in decimal, not in binary)
_SLACK = 1e-9


def n_kept(owner: str, keep: float, n_tokens: int) -> int:
    """``floor(keep * T)``, the entries each (layer, KV head) keeps, as kvpress counts them (``int(T * (1 -
    compression_ratio))``, so that a cell at one keep keeps what kvpress's press keeps); at least one."""
    k = math.floor(keep * n_tokens + _SLACK)
    if k < 1:
        raise ValueError(f"{owner}.keep={keep!r} keeps floor({keep} x {n_tokens}) = 0 of {n_tokens} tokens per head; "
                         f"allowed for {n_tokens} tokens: {1 / n_tokens:.6g} <= keep <= 1")
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


def protected_kept(sinks: int, window: int, n_tokens: int, k: int, word: str = "recent") -> Kept:
    """What :func:`select` protects of ``sinks`` first and ``window`` last tokens with ``k`` of ``n_tokens`` kept:
    sinks first, then the window, neither past the context nor the budget (the fields are clamped here, not
    refused: one configuration runs on contexts of many lengths, and the summary records what was kept)."""
    s = min(sinks, n_tokens, k)
    return Kept(s, min(window, n_tokens - s, k - s), word)


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

    ``keep``: fraction of the ``T`` tokens each (layer, KV head) keeps, ``0 < keep <= 1`` (``floor(keep * T)``
    entries, at least one). ``inner``: how the kept KV is stored; None stores it at 16 bits, else a compressor
    (a config name such as ``turboquant``, a ``{name: ..., FIELD: ...}`` node or a Compressor) that codes the kept
    vectors as a sequence of ``K`` tokens. That sequence is not contiguous in position, so an inner coder that
    models RoPE or neighbouring tokens sees the kept tokens side by side.
    """

    keep: float = 0.5
    inner: Any = None

    family = "eviction"
    max_rel_mse = 0.0  # inner none: kept entries at 16 bits (dropped ones are not distortion)
    #: how tables name the protected last tokens: an observation window (``last``) or the newest tokens (``recent``)
    window_word = "last"
    #: True for the method that keeps tokens regardless of content: the chance line the others are compared with
    random_baseline = False

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

    def always_kept(self, n_tokens: int) -> Kept:
        """The first and last tokens :func:`select` keeps before scoring any, at ``n_tokens``: the fields as asked,
        cut to the context and to the budget as :func:`select` cuts them (a ``window`` of 100000 on 256 tokens
        keeping half protects the last 128, and says so)."""
        k = n_kept(self.name, self.keep, n_tokens)
        return protected_kept(*self.protected(n_tokens, k), n_tokens, k, self.window_word)

    def kept_coding(self) -> str:
        """How the kept KV is stored: ``16-bit``, or the inner coder and its bits (``turboquant 3-bit``)."""
        if self.inner is None:
            return "16-bit"
        bits = getattr(self.inner, "bits", None)
        return self.inner.name if bits is None else f"{self.inner.name} {bits:g}-bit"

    def label(self) -> str:
        return self.name if self.inner is None else f"{self.name} + {self.kept_coding()}"

    def facts(self, n_tokens: int) -> dict[str, Any]:
        return {**super().facts(n_tokens), "kept_coding": self.kept_coding(), "random_baseline": self.random_baseline}

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
