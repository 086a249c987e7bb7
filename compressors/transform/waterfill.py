"""Waterfill: one bit budget allocated jointly over tokens and transform coefficients by reverse water-filling.

Transform coding (KVTC, Staniszewski & Łańcucki, arXiv 2511.01815) allocates bits over PCA coefficients but gives
every token the same allocation; eviction (SnapKV, Li et al., arXiv 2404.14469) spends either 16 bits or nothing on
a token. Rate-distortion allocation over both axes at once (RDKV, arXiv 2605.08317, allocates over eviction and
quantization by reverse water-filling) puts them on one scale, where dropping a token is the 0-bit end:

1. **Transform**: KVTC's calibration (:mod:`compressors.transform.kvtc_calibration`): per layer, a PCA basis of the
   pre-RoPE keys and one of the values over all KV heads, entropy-calibrated quantizer steps ``σ·Δ_w`` for widths
   ``w = 0..8`` and, per component, the calibration's mean squared error at each width, relative to its kind's
   energy (the keys' weighted by ``key_weight``, as in KVTC).
2. **Importance**, per (layer, token), at compression time: the attention the context's last ``obs_window`` queries
   pay each key (recomputed with the model, as SnapKV does; averaged over the query heads, max-pooled over ``kernel``
   neighbours), divided by its mean over the layer's coded tokens; ``uniform`` gives every token the same weight.
   The observation window's own tokens, which only its later queries see, take the layer's highest importance.
   ``all`` scores a key instead by the mean attention it receives from every query of the context that sees it
   (H2O's accumulated attention, Zhang et al., arXiv 2306.14048, over the queries that could pay it), so that a
   passage the context's tail does not read still counts by how the context read it.
3. **Tiers**: each layer's coded tokens are ranked by importance and split into ``tiers`` classes of halving size
   (the bottom half, the next quarter, ..., the top two alike); a tier's weight is the mean of its tokens'
   ``importance ** power``.
4. **Allocation**: every (layer, tier, component) takes the width ``w`` that minimises
   ``weight · D(w) + λ · w``, one multiplier ``λ`` for the whole sequence, found by bisection so that the coded
   widths sum to the budget: ``bits`` per element over the sequence, less what the exact sinks cost. That is reverse
   water-filling over a discrete set of widths: a component whose weighted distortion lies below the water level
   gets no bits. A tier that gets no bits in any K or V component of a layer is dropped from that layer: its
   entries are hidden from attention (``kept``), as an eviction method's are.
   With ``distortion`` ``query`` (or ``query_output``) each key component's distortion is first scaled by what
   the sequence's queries see of it (and each value component's by what ``o_proj`` passes on):
   :mod:`compressors.transform.waterfill_metric`; the scales are sent, float16 per layer and component.
5. **Coding**: the tier of every (layer, token) is range-coded under the tiers' fixed shares; the tiers' weights
   (float16) and ``λ`` (float32) are sent, and the decoder recomputes the same widths from them and the codec state
   (which holds the distortion table). Coefficients are quantized and range-coded per width under calibration
   histograms, as in KVTC. The first ``sinks`` positions are stored exact (16-bit).

The encoder runs the model once per sequence to recompute queries (``needs_model``); the decoder runs none.

Defaults: ``key_weight=0.5``, ``obs_window=32``, ``power=0.5`` and ``tiers=6`` were chosen on the development split
(``dataset.split=dev``, windows from other documents than the scored ones; study ``dev_split``, preset
``dev_waterfill``) among ``key_weight`` 0.125/0.25/0.5 × ``obs_window`` 32/128 × ``power`` 0.5/1 × ``tiers`` 4/6 at a
1-bit budget, by the study's objective: the relative next-token NLL change plus the relative recall-probe change
(``results/dev_split.md``). ``importance`` ``all``/``uniform``, ``distortion`` and a higher ``key_weight`` were measured
at a 2-bit budget against the FP8 cache's recall on 16 development windows (study ``dev_recall``, same page); the
defaults stay those chosen at one bit.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch

from compressors.eviction.query_attention import Queries, attention_sums, capture_queries
from compressors.transform.kvtc_calibration import (
    MAX_WIDTH,
    analyse,
    calibration_keys,
    columns,
    half_range,
    raw_sections,
    uncolumns,
)
from compressors.transform.waterfill_allocation import assign_tiers, tier_probs, water_level, widths_at
from compressors.transform.waterfill_metric import output_metric, quadratic_forms, query_metric, relative
from compressors.transform.waterfill_state import KINDS, State, kind_sections, parse_state
from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.coding.entropy import StreamDecoder, StreamEncoder
from kvbench.coding.packing import tensor_from_bytes, tensor_to_bytes
from kvbench.core.checks import check_choice, check_range
from kvbench.core.compressor import Compressor, Kept, Section
from kvbench.core.kv import Context, KVSequence
from kvbench.core.rope import Rotary

IMPORTANCE = ("attention", "all", "uniform")
DISTORTION = ("energy", "query", "query_output")


@dataclass
class Waterfill(Compressor):
    """Joint token × coefficient bit allocation by reverse water-filling over KVTC's calibrated PCA (see the
    module docstring): ``bits`` per element in all, spent where attention-weighted distortion falls most."""

    bits: float = 1.0
    tiers: int = 6
    importance: str = "attention"
    distortion: str = "energy"
    obs_window: int = 32
    kernel: int = 5
    power: float = 0.5
    sinks: int = 4
    key_weight: float = 0.5

    name: ClassVar[str] = "waterfill"
    family: ClassVar[str] = "transform"
    max_rel_mse: ClassVar[float] = 0.9  # 1 bit: 0.65 (K), 0.20 (V) measured; under 1, what zeros score
    tuned: ClassVar[tuple[str, ...]] = ("key_weight", "obs_window", "power", "tiers")
    needs_config: ClassVar[bool] = True
    needs_model: ClassVar[bool] = True  # the encoder recomputes queries; the decoder runs no model
    added_later: ClassVar[Mapping[str, Any]] = {"distortion": "energy"}

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, (int, float)):
            raise ValueError(f"waterfill.bits={self.bits!r} must be a number of bits per element in (0, {MAX_WIDTH}]")
        check_range("waterfill", "bits", self.bits, 1e-3, MAX_WIDTH)
        check_range("waterfill", "tiers", self.tiers, 1, 16, integer=True)
        check_choice("waterfill", "importance", self.importance, IMPORTANCE)
        check_choice("waterfill", "distortion", self.distortion, DISTORTION)
        check_range("waterfill", "obs_window", self.obs_window, 1, 1 << 20, integer=True)
        check_range("waterfill", "kernel", self.kernel, 1, 1 << 10, integer=True)
        if self.kernel % 2 == 0:
            raise ValueError(f"waterfill.kernel={self.kernel} must be odd, so that pooling is centred on each token")
        for field in ("power", "key_weight"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"waterfill.{field}={value!r} must be a positive number")
            check_range("waterfill", field, value, 1e-6, 1e6)
        check_range("waterfill", "sinks", self.sinks, 0, 1 << 24, integer=True)
        self.bits, self.power, self.key_weight = float(self.bits), float(self.power), float(self.key_weight)
        self.tiers, self.obs_window, self.kernel, self.sinks = (int(self.tiers), int(self.obs_window),
                                                                int(self.kernel), int(self.sinks))
        self._state_sections: dict[str, Section] = {}
        self._st: State | None = None
        self._rotary: tuple[Any, Rotary] | None = None
        self._stats: dict[str, float] = {}

    def kind_weights(self) -> tuple[float, float]:
        # the kinds' weights of its objective; its per-token importance weights are not among them, so the weighted
        # R(D) of a waterfill run prices every token alike
        return (self.key_weight, 1.0)

    def exact_tokens(self, n_tokens: int) -> Kept:
        return Kept(self.sinks, 0)

    def always_kept(self, n_tokens: int) -> Kept:
        return Kept(self.sinks, 0)

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def _add(self, key: str, value: float) -> None:
        self._stats[key] = self._stats.get(key, 0.0) + value

    def _rotary_for(self, config: Any) -> Rotary:
        if self._rotary is None or self._rotary[0] is not config:
            self._rotary = (config, Rotary(config))
        return self._rotary[1]

    # ---- fitting ------------------------------------------------------------------------------------------------

    def fit(self, calib: Sequence[KVSequence], config: Any = None) -> None:
        """KVTC's per-layer analysis of the calibration windows (each starting at position 0), every component and
        width kept: a token of the top tier may use any of them."""
        calib = list(calib)
        if not calib:
            raise ValueError("waterfill.fit needs at least one calibration sequence")
        shapes = {kv.shape[:2] + kv.shape[3:] for kv in calib}
        if len(shapes) != 1:
            raise ValueError(f"waterfill.fit: calibration sequences differ in (layers, heads, head_dim): {sorted(shapes)}")
        sections: dict[str, Section] = {}
        dists = []
        for kind in KINDS:
            cols = [columns(self._calib_kind(kv, kind, config)[:, :, min(self.sinks, kv.n_tokens):], "layer")
                    for kv in calib]  # each (L, d, T_i)
            x = torch.cat(cols, dim=2).double()  # (L, d, N)
            if x.shape[2] < 2:
                raise ValueError(f"waterfill.fit: {x.shape[2]} calibration tokens after the sinks; need >= 2")
            f = analyse(x, "layer", None)
            weight = (self.key_weight if kind == "k" else 1.0) / f.energy
            dists.append(f.dist * weight)  # (L, r, W + 1)
            sections.update(kind_sections(kind, f))
        # the table the allocation reads, as both sides will hold it (float16, relative to the largest entry)
        dist = np.concatenate(dists, axis=1)  # (L, C, W + 1)
        scale = float(dist.max()) or 1.0
        sections["dist"] = tensor_to_bytes(torch.from_numpy(dist / scale).to(torch.float16))
        self.load_state(sections)

    def _calib_kind(self, kv: KVSequence, kind: str, config: Any) -> torch.Tensor:
        if kind == "v":
            return kv.v.float()
        return calibration_keys("waterfill", kv, config, self._rotary_for)

    # ---- state --------------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Section]:
        return dict(self._state_sections)

    def load_state(self, sections: Mapping[str, Section]) -> None:
        if not sections:
            return
        raw = raw_sections(sections)
        try:
            self._st = parse_state(raw)
        except ValueError as e:
            if isinstance(e, BitstreamError):
                raise
            raise BitstreamError(f"waterfill state is malformed: {e}") from e
        self._state_sections = {k: sections[k] for k in sections}

    # ---- allocation -----------------------------------------------------------------------------------------------

    def _check(self, ctx: Context) -> State:
        if self._st is None:
            raise ValueError("waterfill has no fitted state: call fit(calib) on the encoder, or load_state() its "
                             "state bytes (kvbench.core.codec.decoder_for) on a decoder")
        if ctx.config is None:
            raise ValueError("waterfill undoes RoPE on keys and needs the model config in the context (ctx.config)")
        L, H, _, D = ctx.shape
        U, d = self._st.mean["k"].shape
        if U != L or d != H * D:
            raise ValueError(f"waterfill was fitted on {U} layers of {d} elements per token; this cache is "
                             f"(layers, heads, head_dim) = ({L}, {H}, {D})")
        return self._st

    def _n_sink(self, ctx: Context) -> int:
        return min(ctx.n_tokens, max(0, self.sinks - ctx.start))

    def _budget(self, ctx: Context, n_sink: int) -> float:
        """Coefficient bits for the coded tokens: ``bits`` per element of the whole sequence, less the sinks."""
        L, H, T, D = ctx.shape
        return max(0.0, self.bits * 2 * L * H * T * D - 16 * 2 * L * H * n_sink * D)

    def _check_budget(self, fixed_bits: int, ctx: Context, n_sink: int) -> None:
        """Refuse a budget the sequence's fixed cost (its exact sinks, tier weights, water level and coded tiers)
        already exceeds: every coefficient would get no bits and the stream would still store more than asked.

        Only where the sequence holds sinks (it starts at position 0: a whole window, or a cache's first chunk):
        a later chunk of a cache, a few tokens long, may cost its side information over its share, which the
        cache's measured bits count; refusing it would make a run fail on where a context happens to end."""
        L, H, T, D = ctx.shape
        n_el = 2 * L * H * T * D
        if n_sink > 0 and fixed_bits > self.bits * n_el:
            least = math.ceil(fixed_bits / n_el * 1e4) / 1e4
            raise ValueError(f"waterfill.bits={self.bits:g} is below the fixed cost of this {T}-token sequence: "
                             f"{n_sink} exact sink token(s) at 16 bits and the tiers' side information take "
                             f"{fixed_bits / n_el:.4f} bits per element before any coefficient; the smallest budget "
                             f"possible here is waterfill.bits={least:g} (or fewer sinks, or a longer context)")

    def _queries(self, kv: KVSequence, ctx: Context) -> Queries | None:
        """The queries the encoder recomputes: every token's where the importance or the distortion reads them
        all, else the observation window's; None where neither reads any."""
        if self.importance == "all" or self.distortion != "energy":
            return capture_queries(self.name, kv, ctx, 0)
        T = kv.n_tokens
        return None if self.importance == "uniform" else capture_queries(self.name, kv, ctx, T - self._window(T))

    def _window(self, T: int) -> int:
        """The observation window's length in a ``T``-token sequence (its first token is never in it)."""
        return min(self.obs_window, T - 1)

    def _importance(self, kv: KVSequence, qs: Queries | None, n_sink: int) -> torch.Tensor:
        """``(L, n)`` importance of the coded tokens (mean 1 per layer)."""
        L, H, T, _ = kv.shape
        if self.importance == "uniform" or qs is None:
            return torch.ones(L, T - n_sink, dtype=torch.float64)
        w = self._window(T)
        if self.importance == "all":  # the mean attention a key receives from the queries that see it, as H2O sums it
            seen_by = torch.arange(T, 0, -1, dtype=torch.float64)  # (T,) causal; sliding layers' windows not counted
            attn = attention_sums(qs, kv.k).mean(dim=1).double() / seen_by  # (L, T)
        else:
            tail = qs if qs.first == T - w else replace(qs, q=qs.q[:, :, T - w - qs.first:],
                                                       q_pre=qs.q_pre[:, :, T - w - qs.first:], first=T - w)
            attn = attention_sums(tail, kv.k).mean(dim=1)  # (L, T) mean over the query heads
        pooled = torch.nn.functional.max_pool1d(attn[:, None], self.kernel, stride=1, padding=self.kernel // 2)[:, 0]
        if self.importance == "attention":  # the window's own keys: seen by few queries
            pooled[:, T - w :] = pooled.max(dim=1, keepdim=True).values
        a = pooled[:, n_sink:].double()  # (L, n)
        return a / a.mean(dim=1, keepdim=True).clamp_min(1e-30)

    def _scales(self, st: State, kv: KVSequence, qs: Queries | None, ctx: Context) -> np.ndarray | None:
        """``(L, C)`` float16 scales of the distortion table by what a later query sees
        (:mod:`compressors.transform.waterfill_metric`), or None for the calibrated table as it is."""
        if self.distortion == "energy" or qs is None:
            return None
        L, H, _, D = kv.shape
        g_k = quadratic_forms(query_metric(qs.q_pre, self._rotary_for(ctx.config), H), st.basis["k"])
        g_v = (quadratic_forms(output_metric(ctx.model, H, D), st.basis["v"]) if self.distortion == "query_output"
               else torch.ones(st.sigma["v"].shape, dtype=torch.float64))
        scales = torch.cat([relative(g_k, st.sigma["k"]), relative(g_v, st.sigma["v"])], dim=1)  # (L, C)
        return scales.clamp(0, 6e4).numpy().astype(np.float16)

    @staticmethod
    def _dist(st: State, scales: np.ndarray | None) -> np.ndarray:
        """The table the allocation reads: the calibrated one, scaled per component as sent."""
        return st.dist if scales is None else st.dist * scales.astype(np.float64)[:, :, None]

    # ---- coding -------------------------------------------------------------------------------------------------

    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream:
        st = self._check(ctx)
        L, H, T, D = kv.shape
        n_sink = self._n_sink(ctx)
        n = T - n_sink
        sections: dict[str, Section] = {
            "exact": tensor_to_bytes(kv.k[:, :, :n_sink]) + tensor_to_bytes(kv.v[:, :, :n_sink])}
        if n == 0:
            return Bitstream.pack(self.name, sections)
        qs = self._queries(kv, ctx)
        a = self._importance(kv, qs, n_sink)  # (L, n)
        scales = self._scales(st, kv, qs, ctx)
        dist = self._dist(st, scales)  # (L, C, W + 1)
        tier = assign_tiers(a, self.tiers)  # (L, n)
        powered = a.numpy() ** self.power
        counts = np.stack([(tier == g).sum(axis=1) for g in range(self.tiers)], axis=1)  # (L, G)
        sums = np.stack([np.where(tier == g, powered, 0.0).sum(axis=1) for g in range(self.tiers)], axis=1)
        weights = (sums / np.maximum(counts, 1)).astype(np.float16)  # (L, G) as sent
        lam = water_level(dist, weights.astype(np.float64), counts, self._budget(ctx, n_sink))
        widths = widths_at(dist, weights.astype(np.float64), float(lam))  # (L, G, C)
        sections["alloc"] = weights.tobytes() + lam.astype("<f4").tobytes()
        if scales is not None:
            sections["scales"] = scales.tobytes()
        enc = StreamEncoder()
        enc.categorical(tier.reshape(-1), tier_probs(n, self.tiers))
        sections["tiers"] = enc.finish()
        self._check_budget(Bitstream.pack(self.name, sections).num_bits, ctx, n_sink)
        self._add("dropped_fraction", float((~_kept_tokens(widths, tier)).mean()))
        self._add("sequences", 1.0)
        per_kind = st.split(widths)
        for kind, x in (("k", kv.k), ("v", kv.v)):
            per_entry = _entry_widths(per_kind[kind], tier)  # (L, r, n)
            xf = self._rotary_for(ctx.config).undo(x[:, :, n_sink:], ctx.start + n_sink) if kind == "k" else \
                x[:, :, n_sink:].float()
            coef = (st.basis[kind].transpose(1, 2) @ (columns(xf, "layer") - st.mean[kind][:, :, None])).numpy()
            sections[f"{kind}.codes"] = _code(coef, per_entry, st, kind)  # coef: (L, r, n)
        return Bitstream.pack(self.name, sections)

    def decode(self, bs: Bitstream, ctx: Context) -> KVSequence:
        sec = bs.sections(expect=self.name)
        st = self._check(ctx)
        L, H, T, D = ctx.shape
        n_sink = self._n_sink(ctx)
        n = T - n_sink
        raw = sec.get("exact")
        if raw is None or len(raw) != 2 * 2 * L * H * n_sink * D:
            raise BitstreamError(f"waterfill bitstream: the exact section must hold {n_sink} sink tokens of K and V")
        k = torch.zeros(L, H, T, D, dtype=ctx.dtype)  # (L, H, T, D)
        v = torch.zeros(L, H, T, D, dtype=ctx.dtype)
        half = len(raw) // 2
        k[:, :, :n_sink] = tensor_from_bytes(raw[:half], ctx.dtype, (L, H, n_sink, D))
        v[:, :, :n_sink] = tensor_from_bytes(raw[half:], ctx.dtype, (L, H, n_sink, D))
        if n == 0:
            return KVSequence(k, v)
        for name in ("alloc", "tiers", "k.codes", "v.codes"):
            if name not in sec:
                raise BitstreamError(f"waterfill bitstream has no section {name!r}")
        alloc = sec["alloc"]
        if len(alloc) != 2 * L * self.tiers + 4:
            raise BitstreamError(f"waterfill bitstream: alloc holds {len(alloc)} bytes, not {L} x {self.tiers} "
                                 "float16 tier weights and a float32 water level")
        weights = np.frombuffer(alloc[:-4], dtype=np.float16).reshape(L, self.tiers)
        lam = np.frombuffer(alloc[-4:], dtype="<f4")[0]
        if not (np.isfinite(weights).all() and (weights >= 0).all() and np.isfinite(lam) and lam > 0):
            raise BitstreamError("waterfill bitstream: tier weights or water level out of range")
        scales = None
        if self.distortion != "energy":
            raw_scales = sec.get("scales", b"")
            if len(raw_scales) != 2 * st.dist.shape[0] * st.dist.shape[1]:
                raise BitstreamError(f"waterfill bitstream: scales holds {len(raw_scales)} bytes, not {L} x "
                                     f"{st.dist.shape[1]} float16 component scales (distortion={self.distortion})")
            scales = np.frombuffer(raw_scales, dtype=np.float16).reshape(L, -1)
            if not (np.isfinite(scales).all() and (scales >= 0).all()):
                raise BitstreamError("waterfill bitstream: component scales out of range")
        widths = widths_at(self._dist(st, scales), weights.astype(np.float64), float(lam))  # (L, G, C)
        dec = StreamDecoder(sec["tiers"])
        tier = dec.categorical(L * n, tier_probs(n, self.tiers)).astype(np.int64).reshape(L, n)
        dec.finish("waterfill tiers")
        per_kind = st.split(widths)
        out = {}
        for kind in KINDS:
            per_entry = _entry_widths(per_kind[kind], tier)
            coef = _decode_coef(sec[f"{kind}.codes"], per_entry, st, kind)
            cols = st.mean[kind][:, :, None] + st.basis[kind] @ torch.from_numpy(coef)  # (L, d, n)
            x = uncolumns(cols, (L, H, n, D))  # (L, H, n, D) float32
            if kind == "k":
                x = self._rotary_for(ctx.config).apply(x, ctx.start + n_sink)
            out[kind] = x
        kept_tok = _kept_tokens(widths, tier)  # (L, n)
        kept = torch.ones(L, H, T, dtype=torch.bool)
        kept[:, :, n_sink:] = torch.from_numpy(kept_tok)[:, None, :]
        keep = kept[:, :, n_sink:, None]  # (L, H, n, 1): dropped entries are zero, as an eviction decoder's
        k[:, :, n_sink:] = torch.where(keep, out["k"], 0).to(ctx.dtype)
        v[:, :, n_sink:] = torch.where(keep, out["v"], 0).to(ctx.dtype)
        return KVSequence(k, v, kept=None if bool(kept.all()) else kept)


def _entry_widths(w_kind: np.ndarray, tier: np.ndarray) -> np.ndarray:
    """``(U, G, r)`` widths per tier and ``(U, n)`` tiers -> ``(U, r, n)`` the width of every coefficient."""
    r = w_kind.shape[2]
    return np.take_along_axis(w_kind.transpose(0, 2, 1), tier[:, None, :].repeat(r, 1), axis=2)


def _kept_tokens(widths: np.ndarray, tier: np.ndarray) -> np.ndarray:
    """``(U, n)``: False where a token's tier has no coded K or V component in its layer (evicted there)."""
    return ~np.take_along_axis(widths.sum(axis=2) == 0, tier, axis=1)


def _code(coef: np.ndarray, per_entry: np.ndarray, st: State, kind: str) -> Section:
    """Quantize ``coef`` ``(U, r, n)`` at each entry's width and range-code the symbols, one batch per width."""
    sigma, steps, probs = st.sigma[kind], st.steps[kind], st.probs[kind]
    enc = StreamEncoder()
    for w in range(1, MAX_WIDTH + 1):
        sel = per_entry == w  # (U, r, n)
        if not sel.any():
            continue
        step = (sigma[:, :, None] * steps[w - 1]).astype(np.float32)  # (U, r, 1)
        half = half_range(steps[w - 1])
        at = np.broadcast_to(np.where(step > 0, step, np.float32(1.0)), coef.shape)[sel]  # only this width's entries
        q = np.clip(np.rint(coef[sel] / at), -half, half)
        enc.categorical((q + half).astype(np.int32), probs[w])
    return enc.finish()


def _decode_coef(raw: bytes, per_entry: np.ndarray, st: State, kind: str) -> np.ndarray:
    """The dequantized coefficients ``(U, r, n)`` float32 (bin centres; 0 where the width is 0)."""
    sigma, steps, probs = st.sigma[kind], st.steps[kind], st.probs[kind]
    coef = np.zeros(per_entry.shape, dtype=np.float32)
    dec = StreamDecoder(raw)
    for w in range(1, MAX_WIDTH + 1):
        sel = per_entry == w
        count = int(sel.sum())
        if not count:
            continue
        half = half_range(steps[w - 1])
        step = np.broadcast_to((sigma[:, :, None] * steps[w - 1]).astype(np.float32), per_entry.shape)
        coef[sel] = (dec.categorical(count, probs[w]).astype(np.float32) - half) * step[sel]
    dec.finish(f"waterfill {kind}.codes")
    return coef
