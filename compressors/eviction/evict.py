"""Token eviction on kvbench's axes: keep a fraction of the cache per layer and KV head, count every stored bit.

Eviction methods (kvpress calls them "presses") score each cached token and drop the low scorers. They are usually
reported as the fraction of tokens pruned; here a method is a compressor like any other and pays for what its
decoder needs:

- the kept KV, at 16 bits or through any ``inner`` compressor (``inner=turboquant``: eviction, then quantization
  of what is left). By default every (layer, KV head) keeps exactly ``floor(keep * T)`` entries (kvpress's count;
  ``keep_tokens=N``: ``N`` of them), so the kept KV packs as ``(L, H, K, D)`` and the inner compressor codes it as a
  sequence of ``K`` tokens;
- the kept positions of every (layer, KV head) (most methods keep different positions per head: KNorm and SnapKV
  overlap by about half between heads on SmolLM2; TOVA by default keeps one set per layer, coded once per head),
  entropy coded as whichever of two encodings is smaller,
  one flag per stream saying which (:func:`compressors.eviction.kept_positions.encode_positions`);
- the kept count, the flag and the model of the position coder, in a small header; every row's count where the
  rows keep different numbers of entries.

A budget rule may share the same total differently (:meth:`Eviction.budgets`, :attr:`Eviction.budget_pool`):
PyramidKV gives deeper layers fewer entries, AdaKV lets a layer's heads share its budget, KVzip ranks the whole
cache at once. Their kept KV is a set of unequal rows: at 16 bits, or through an ``inner`` coder that fits nothing
and needs no model config (FP8, KIVI), which then codes each (layer, KV head)'s kept entries as a ``(1, 1, K_lh, D)``
sequence of its own, every stream's frame counted (a fitted coder such as KVTC, whose state is per layer, is
refused).

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
from kvbench.core.compressor import Compressor, Kept, Section, SetCompressor, fits
from kvbench.core.flops import prefill_flops_per_token
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


def ranking(scores: torch.Tensor, sinks: Any = 0, window: Any = 0) -> torch.Tensor:
    """``(L, H, T)``: every row's positions, the one kept first leading.

    The first ``sinks`` and last ``window`` tokens come before any scored token (sinks first, earliest first,
    then the window, latest first); the rest go by score, ties to the earlier token. NaN scores rank lowest.
    ``sinks`` and ``window``: one count for every row, or an ``(L, H)`` tensor of counts row by row.
    """
    L, H, T = scores.shape
    pos = torch.arange(T, dtype=torch.float64)
    sinks = torch.as_tensor(sinks).expand(L, H).unsqueeze(-1)  # (L, H, 1)
    window = torch.as_tensor(window).expand(L, H).unsqueeze(-1)  # (L, H, 1)
    tier = torch.where(pos < sinks, 2, torch.where(pos >= T - window, 1, 0))  # (L, H, T) sink, window, scored
    key = torch.nan_to_num(scores.double(), nan=-math.inf)  # (L, H, T)
    key = torch.where(tier == 2, -pos, torch.where(tier == 1, pos, key))
    # lexicographic (tier, key) descending: two stable sorts, the second on the more significant key
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # (L, H, T)
    by_tier = torch.sort(tier.gather(-1, order), dim=-1, descending=True, stable=True).indices
    return order.gather(-1, by_tier)  # (L, H, T)


def select(scores: torch.Tensor, k: Any, sinks: Any = 0, window: Any = 0) -> torch.Tensor:
    """The ``k`` entries of every row of ``scores`` ``(L, H, T)`` to keep, as a ``(L, H, T)`` bool mask, in the
    order of :func:`ranking` (when the budget cannot hold every protected token: sinks first, then the window's
    latest). ``k``, ``sinks`` and ``window``: one count for every row, or an ``(L, H)`` tensor of counts."""
    L, H, T = scores.shape
    take = torch.arange(T) < torch.as_tensor(k).expand(L, H).unsqueeze(-1)  # (L, H, T) the first k of each row
    return torch.zeros(L, H, T, dtype=torch.bool).scatter_(-1, ranking(scores, sinks, window), take)


def protected_kept(sinks: int, window: int, n_tokens: int, k: int, word: str = "recent") -> Kept:
    """What :func:`select` protects of ``sinks`` first and ``window`` last tokens with ``k`` of ``n_tokens`` kept:
    sinks first, then the window, neither past the context nor the budget (the fields are clamped here, not
    refused: one configuration runs on contexts of many lengths, and the summary records what was kept)."""
    s = min(sinks, n_tokens, k)
    return Kept(s, min(window, n_tokens - s, k - s), word)


# ---------------------------------------------------------------------------------------------- the base


def _embed(inner_bs: Bitstream, prefix: str = "inner") -> dict[str, Section]:
    """The inner stream as outer sections, ``PREFIX/frame`` (its header and checksum) and each of its sections at
    its exact bit count, so that the outer stream counts exactly the inner stream's bits."""
    stored = Bitstream.from_bytes(inner_bs.data)
    payloads = stored.sections()
    body = sum(len(p) for p in payloads.values())
    out: dict[str, Section] = {f"{prefix}/frame": stored.data[: len(stored.data) - 4 - body] + stored.data[-4:]}
    out.update({f"{prefix}/{name}": (raw, stored.parts[name]) for name, raw in payloads.items()})
    return out


def _unembed(sec: Mapping[str, bytes], prefix: str = "inner") -> Bitstream:
    frame = sec.get(f"{prefix}/frame")
    if frame is None or len(frame) < 4:
        raise BitstreamError(f"eviction bitstream has no inner stream {prefix!r}")
    payloads = [raw for name, raw in sec.items() if name.startswith(f"{prefix}/") and name != f"{prefix}/frame"]
    return Bitstream.from_bytes(frame[:-4] + b"".join(payloads) + frame[-4:])


def _kept_rows(kept: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(layer, head, count)`` of every row of the ``(L, H, T)`` kept mask that keeps any entry, in the order the
    mask lists its entries (so their inner streams concatenate as ``kv[kept]`` does)."""
    counts = kept.sum(-1).tolist()  # (L, H)
    return [(a, b, n) for a, row in enumerate(counts) for b, n in enumerate(row) if n]


def _row(layer: int, head: int) -> str:
    """The outer sections' prefix of one (layer, KV head)'s inner stream, where the rows keep unequal counts."""
    return f"inner/{layer}.{head}"


@dataclass
class Eviction(Compressor):
    """Keep the ``keep`` fraction of tokens with the highest :meth:`scores` in every (layer, KV head).

    ``keep``: fraction of the ``T`` tokens each (layer, KV head) keeps, ``0 < keep <= 1`` (``floor(keep * T)``
    entries, at least one). ``keep_tokens``: the alternative, a number of tokens each (layer, KV head) keeps
    (``min(keep_tokens, T)``: a budget that outgrows a short context keeps all of it); exactly one of the two is
    set (``keep=null keep_tokens=N`` on the command line). ``inner``: how the kept KV is stored; None stores it at
    16 bits, else a compressor (a config name such as ``turboquant``, a ``{name: ..., FIELD: ...}`` node or a
    Compressor) that codes the kept vectors as a sequence of ``K`` tokens. That sequence is not contiguous in
    position, so an inner coder that models RoPE or neighbouring tokens sees the kept tokens side by side.
    """

    keep: float | None = 0.5
    keep_tokens: int | None = None
    inner: Any = None

    family = "eviction"
    max_rel_mse = 0.0  # inner none: kept entries at 16 bits (dropped ones are not distortion)
    #: how tables name the protected last tokens: an observation window (``last``) or the newest tokens (``recent``)
    window_word = "last"
    #: True for the method that keeps tokens regardless of content: the chance line the others are compared with
    random_baseline = False
    #: which counts the budget fixes: ``head`` (each (layer, KV head) keeps its :meth:`budgets` entry), ``layer``
    #: (a layer's heads share their entries' sum: AdaKV) or ``cache`` (one total for the whole cache: KVzip)
    budget_pool = "head"
    #: False for a rule whose rows keep different counts: the kept KV is no ``(L, H, K, D)`` sequence for ``inner``
    equal_counts = True
    added_later = {"keep_tokens": None}  # runs before token budgets key as they did

    def __post_init__(self) -> None:
        if (self.keep is None) == (self.keep_tokens is None):
            raise ValueError(f"{self.name}: give exactly one of keep (the fraction of tokens each layer and KV head "
                             f"keeps) and keep_tokens (their number); got keep={self.keep!r}, "
                             f"keep_tokens={self.keep_tokens!r} (a token budget: keep=null keep_tokens=N)")
        if self.keep_tokens is not None:
            check_range(self.name, "keep_tokens", self.keep_tokens, 1, 1 << 30, integer=True)
        elif isinstance(self.keep, bool) or not isinstance(self.keep, (int, float)) or not 0 < self.keep <= 1:
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
            if not self.equal_counts and (fits(self.inner) or self.inner.needs_config):
                raise ValueError(f"{self.name}.inner={self.inner.name!r}: {self.name}'s layers and heads keep "
                                 "different numbers of tokens, so each (layer, KV head) is coded as a sequence of its "
                                 "own, which only a coder that fits nothing and needs no model config can code "
                                 "(e.g. fp8, kivi); or inner=null (16-bit)")
            self.needs_config = bool(self.inner.needs_config)  # what the harness hands over depends on the inner
        self._stats: dict[str, float] = {}

    # ---- what a method provides

    @abc.abstractmethod
    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        """``(L, H, T)`` importance of every cached entry; higher is kept first."""

    def protected(self, n_tokens: int, n_keep: int) -> tuple[int, int]:
        """``(sinks, window)``: how many first and last tokens are always kept (fields of the same names)."""
        return int(getattr(self, "sinks", 0)), int(getattr(self, "window", 0))

    def n_keep(self, n_tokens: int) -> int:
        """Entries each (layer, KV head) keeps of ``n_tokens``, on average where a budget rule shares them out:
        ``floor(keep * T)`` (:func:`n_kept`), or ``min(keep_tokens, T)``."""
        if self.keep_tokens is not None:
            return min(int(self.keep_tokens), n_tokens)
        return n_kept(self.name, self.keep, n_tokens)

    def budgets(self, n_layers: int, n_heads: int, n_tokens: int) -> torch.Tensor:
        """``(L, H)`` int64: the entries each (layer, KV head) keeps (within a :attr:`budget_pool` only their sum
        is fixed); :meth:`n_keep` everywhere unless a budget rule shares the total otherwise."""
        return torch.full((n_layers, n_heads), self.n_keep(n_tokens), dtype=torch.int64)

    def protected_rows(self, n_tokens: int, budgets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sinks, window)``, each ``(L, H)``: :meth:`protected` at every row's budget."""
        values = budgets.unique()  # (V,) sorted
        pairs = torch.tensor([self.protected(n_tokens, int(b)) for b in values], dtype=torch.int64)  # (V, 2)
        at = torch.searchsorted(values, budgets)  # (L, H)
        return pairs[at, 0], pairs[at, 1]

    def always_kept(self, n_tokens: int) -> Kept:
        """The first and last tokens :func:`select` keeps before scoring any, at ``n_tokens``: the fields as asked,
        cut to the context and to the budget as :func:`select` cuts them (a ``window`` of 100000 on 256 tokens
        keeping half protects the last 128, and says so)."""
        k = self.n_keep(n_tokens)
        return protected_kept(*self.protected(n_tokens, k), n_tokens, k, self.window_word)

    def kept_coding(self) -> str:
        """How the kept KV is stored: ``16-bit``, or the inner coder and its bits (``turboquant 3-bit``)."""
        if self.inner is None:
            return "16-bit"
        bits = getattr(self.inner, "bits", None)
        return self.inner.name if bits is None else f"{self.inner.name} {bits:g}-bit"

    def label(self) -> str:
        return self.method() if self.inner is None else f"{self.method()} + {self.kept_coding()}"

    def method(self) -> str:
        """What chooses the kept entries (a budget rule names its scorer too), the label without the kept coding."""
        return self.name

    def facts(self, n_tokens: int) -> dict[str, Any]:
        return {**super().facts(n_tokens), "kept_coding": self.kept_coding(), "random_baseline": self.random_baseline}

    def encode_flops_per_token(self, config: Any, n_tokens: int) -> float:
        """A method that scores with the model's queries runs its decoder stack over the sequence once (no LM head)."""
        return prefill_flops_per_token(config, n_tokens, head=False) if self.needs_model else 0.0

    def kept_mask(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        """The ``(L, H, T)`` bool mask the encoder keeps."""
        L, H, T, _ = kv.shape
        budgets = self.budgets(L, H, T)  # (L, H)
        if bool((budgets == T).all()):
            return torch.ones(L, H, T, dtype=torch.bool)
        started = time.perf_counter()
        scores = self.scores(kv, ctx)
        self._add("score_s", time.perf_counter() - started)
        if tuple(scores.shape) != (L, H, T):
            raise RuntimeError(f"{self.name} scored shape {tuple(scores.shape)}; expected {(L, H, T)}")
        return self.choose(scores, budgets)

    def choose(self, scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        """The ``(L, H, T)`` kept mask from the scores and the :meth:`budgets`: every row its own count, protected
        tokens first (:func:`select`). A rule that pools the budget of several rows overrides it."""
        return select(scores, budgets, *self.protected_rows(scores.shape[-1], budgets))

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

    def _inner_ctx(self, ctx: Context, k: int, one_row: bool = False) -> Context:
        """The inner coder's context for ``k`` kept tokens: of every (layer, KV head), or of one alone."""
        layers, heads = (1, 1) if one_row else (ctx.n_layers, ctx.n_heads)
        return Context(layers, heads, k, ctx.head_dim, ctx.dtype, config=ctx.config, start=ctx.start)

    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream:
        L, H, T, D = kv.shape
        kept = self.kept_mask(kv, ctx)  # (L, H, T)
        pos = encode_positions(kept)
        self._add("positions_bits", pos.bits)
        self._add("positions_gap_coded", float((pos.flag & GAPS) == GAPS))
        sections: dict[str, Section] = {"header": pos.header, **pos.sections}
        if self.inner is None:  # the kept entries row by row, positions in order: (N, D) each
            sections.update({"k": tensor_to_bytes(kv.k[kept]), "v": tensor_to_bytes(kv.v[kept])})
        elif self.equal_counts:
            k = int(kept[0, 0].sum())
            k_kept = kv.k[kept].reshape(L, H, k, D)  # (L, H, K, D), kept positions in order
            v_kept = kv.v[kept].reshape(L, H, k, D)  # (L, H, K, D)
            sections.update(_embed(self.inner.encode(KVSequence(k_kept, v_kept), self._inner_ctx(ctx, k))))
        else:  # rows of unequal counts: one inner stream per (layer, KV head), L * H of them, not a loop over tokens
            for layer, head, n in _kept_rows(kept):
                row = kept[layer, head]  # (T,)
                sub = KVSequence(kv.k[layer, head, row][None, None], kv.v[layer, head, row][None, None])  # (1,1,K,D)
                sections.update(_embed(self.inner.encode(sub, self._inner_ctx(ctx, n, one_row=True)),
                                       _row(layer, head)))
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
            n = int(kept.sum())
            k_kept = tensor_from_bytes(sec["k"], ctx.dtype, (n, D))
            v_kept = tensor_from_bytes(sec["v"], ctx.dtype, (n, D))
        elif self.equal_counts:
            if not bool((kept.sum(-1) == k).all()):
                raise BitstreamError(f"{self.name} bitstream keeps different counts per head, but its kept KV is one "
                                     "inner stream of equal rows")
            out = self.inner.decode(_unembed(sec), self._inner_ctx(ctx, k))
            k_kept, v_kept = out.k.to(ctx.dtype), out.v.to(ctx.dtype)
        else:  # one inner stream per (layer, KV head) that keeps any entry, in the order the mask lists them
            rows = [self.inner.decode(_unembed(sec, _row(a, b)), self._inner_ctx(ctx, n, one_row=True))
                    for a, b, n in _kept_rows(kept)]
            k_kept = torch.cat([r.k.reshape(-1, D) for r in rows]).to(ctx.dtype)  # (N, D)
            v_kept = torch.cat([r.v.reshape(-1, D) for r in rows]).to(ctx.dtype)  # (N, D)
        k_full = torch.zeros(L, H, T, D, dtype=ctx.dtype)
        v_full = torch.zeros(L, H, T, D, dtype=ctx.dtype)
        k_full[kept] = k_kept.reshape(-1, D)
        v_full[kept] = v_kept.reshape(-1, D)
        return KVSequence(k_full, v_full, kept=kept)
