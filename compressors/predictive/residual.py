"""Closed-loop residual coding of K and V against a predictor: the coding half of predictive delta coding (Layer 2 of
"Sequential KV Cache Compression via Probabilistic Language Tries", arXiv 2604.15356), shared by
:mod:`compressors.predictive.delta` (predictions from the cache itself) and :mod:`compressors.predictive.speculative` (predictions from
a cheaper copy of the model).

Every element is coded as the residual from a :class:`~compressors.predictive.delta_predictors.Predictor`'s prediction made
only from what the decoder already holds. The loop is closed: predictions come from the *reconstructed* cache, so
quantization errors never accumulate.

Exact coding (no step), bit-exact by construction, by one of two coders (``exact``):

- ``planes`` (the default): the prediction is rounded to the cache dtype and the residual is the difference of the
  two 16-bit patterns, wrapped to 16 bits and zigzag-mapped (small differences of either sign to small numbers),
  the integer residual of fpzip (Lindstrom & Isenburg, IEEE TVCG 2006) on the raw patterns (their monotone
  integer images cost 0.01 bits/element more on SmolLM2 keys). Each (layer, head, channel) chooses, by a two-part
  code length of its bytes, between coding that residual and coding its values as they are (a prediction of
  zero): on a SmolLM2 window the previous token pays on a fifth of the key channels (RoPE pairs 3-17 of 32,
  which turn by 0.3-0.002 rad per token) and on no value channel, where per-channel exponent histograms do
  better. Either way the two bytes of every element go to the byte-plane coder of
  :mod:`compressors.exact.plane_coder` (histograms per channel, head, layer or tensor, or raw bytes). The residual
  symbols do not depend on the prediction's value, so the decoder reads all of them at once and the loop over units
  only adds predictions; for a predictor that copies the previous token it is a cumulative sum
  (:mod:`compressors.predictive.residual_planes`).
- ``laplace``: each 16-bit value is coded under a Laplace in value space centred on its prediction
  (:mod:`kvbench.coding.float_coding`), with one scale per (layer, head, channel) and K/V fitted on the sequence and
  stored in the stream: 16 binary decisions per element, an order of magnitude slower, and fewer bits than
  ``planes`` where fitted predictors (``linear``, ``cross_layer``, a model) predict well.

Quantized (a step, scalar or per channel): the residual is uniformly quantized with that step and the integer
symbols are range-coded under a quantized Laplace with a scale per (layer, head, channel) and K/V
(:mod:`kvbench.coding.entropy`). The error of every element is at most ``step/2`` before the reconstruction is
rounded to the cache dtype.

Scales are 8-bit log codes (1/8 octave), range-coded around their median. Values with nothing to predict from
(token 0; layer 0's token 0 for ``cross_layer``) are coded against 0 (with their own warm-up scale under a Laplace).

The decoder's order is the predictor's unit order. When the predictor copies the previous token, a quantized
closed loop needs no loop: predictions then lie on the grid ``step * Z``, so the reconstruction is
``step * round(x / step)`` and the symbols are differences of consecutive grid indices, decoded by a cumulative
sum. Other quantized loops, and every ``laplace`` decode, loop over units (T steps over ``(L, H, D)`` tensors,
L layers, or one unit for a prediction that does not depend on the reconstruction).

Stream sections: ``scales`` (Laplace models only: K's codes then V's), ``bounds`` (quantized only: the symbol
range of K and V, int32 each), ``k.residual``, ``v.residual``. An exact ``planes`` residual section holds all its
kind needs: one bit per channel (1: residual, 0: value), the two plane headers of
:class:`~compressors.exact.plane_coder.PlaneHeader`, one range-coded stream (each coded plane's histograms, then
its bytes) and the planes stored raw, in that order.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from compressors.predictive.delta_predictors import Predictor
from compressors.predictive.residual_planes import decode_planes, encode_planes
from kvbench.coding.bitstream import BitstreamError
from kvbench.coding.entropy import StreamDecoder, StreamEncoder
from kvbench.coding.float_coding import decode_values, encode_values
from kvbench.core.checks import check_choice
from kvbench.core.compressor import Section
from kvbench.core.kv import KVSequence

KINDS = ("k", "v")
#: exact coders: byte planes of the zigzag residual (fast) or a Laplace in value space (fewer bits, slow)
EXACT_CODERS = ("planes", "laplace")
#: log2-scale codes: scale = 2**((code - offset) / 8); value-space scales (lossless) and symbol scales (lossy)
VALUE_SCALE_OFFSET, SYMBOL_SCALE_OFFSET = 184, 96
#: constriction's leaky quantizer gives every symbol of the coder's range at least this probability (24-bit
#: precision), so an outlier costs about 24 bits, not -log2 of the Laplace tail
LEAK = 2.0**-24


def ideal_bits_leaky_laplace(symbols: np.ndarray, scales: np.ndarray) -> float:
    """The coder's model estimate, sum of -log2 p, for the quantized Laplace *as the coder uses it*: the scale floor
    of :mod:`kvbench.coding.entropy` and the leaky quantizer's probability floor (``entropy.ideal_bits_laplace`` has no
    floor, so heavy-tailed residuals would make its estimate far exceed the coded size)."""
    x = np.asarray(symbols, dtype=np.float64)
    b = np.maximum(np.asarray(scales, dtype=np.float64), 1e-3)

    def cdf(t):
        tail = 0.5 * np.exp(-np.abs(t) / b)
        return np.where(t < 0, tail, 1.0 - tail)

    return float(-np.log2(cdf(x + 0.5) - cdf(x - 0.5) + LEAK).sum())


def scale_codes(s: torch.Tensor, offset: int) -> torch.Tensor:
    """Scales -> uint8 log codes (0 for a zero scale)."""
    c = torch.round(8 * torch.log2(s.double().clamp_min(1e-300))) + offset
    return torch.where(s > 0, c, torch.zeros_like(c)).clamp(0, 255).to(torch.int64)


def scales_from_codes(c: torch.Tensor, offset: int) -> torch.Tensor:
    return torch.pow(2.0, (c.double() - offset) / 8)


def _encode_codes(codes: np.ndarray) -> bytes:
    """uint8 codes range-coded under a Laplace around their median (median and spread in a 2-byte header)."""
    med = int(np.median(codes)) if codes.size else 0
    spread = int(min(255, round(16 * float(np.mean(np.abs(codes - med))) if codes.size else 0)))
    enc = StreamEncoder()
    enc.laplace(codes, max(spread / 16, 1e-3), 0, 255, mean=float(med))
    raw, _ = enc.finish()
    return bytes([med, spread]) + raw


def _decode_codes(raw: bytes, n: int, owner: str) -> np.ndarray:
    if len(raw) < 2:
        raise BitstreamError(f"{owner}: scale section is truncated")
    med, spread = raw[0], raw[1]
    dec = StreamDecoder(raw[2:])
    codes = dec.laplace(n, max(spread / 16, 1e-3), 0, 255, mean=float(med)).astype(np.int64)
    dec.finish(f"{owner} scales")
    return codes


def _channel_mean(a: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Mean of ``a`` ``(L, H, T, D)`` over tokens where ``keep``; ``(L, H, D)``, 0 where nothing is kept."""
    n = keep.sum(2).clamp_min(1)
    return (a * keep).sum(2) / n


def _group_mean(a: torch.Tensor, group: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Mean of ``a`` per warm-up group (``group >= 0``), ``(n_groups,)``."""
    sel = group >= 0
    sums = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group[sel], a[sel].double())
    counts = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group[sel], torch.ones_like(a[sel], dtype=torch.float64))
    return sums / counts.clamp_min(1)


def _broadcast_scales(steady: torch.Tensor, warm: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Per-element scale ``(L, H, T, D)`` from per-channel ``steady`` ``(L, H, D)`` and per-group ``warm``."""
    L, H, T, D = group.shape
    b = steady.unsqueeze(2).expand(L, H, T, D).clone()
    sel = group >= 0
    if sel.any():
        b[sel] = warm[group[sel]]
    return b


def _scales(resid: torch.Tensor, pred: Predictor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``(L*H*D + n_warm,)`` of the per-channel and warm-up scales (mean |residual|) and the per-element scale
    ``(L, H, T, D)`` the decoder will rebuild from them."""
    group = pred.warm_group(resid.shape)
    n_warm = pred.n_warm(resid.shape)
    c_steady = scale_codes(_channel_mean(resid, group < 0), offset)  # (L, H, D)
    c_warm = scale_codes(_group_mean(resid, group, n_warm), offset)  # (n_warm,)
    codes = torch.cat([c_steady.reshape(-1), c_warm])
    return codes, _element_scales(codes, pred, resid.shape, offset)


def _element_scales(codes: torch.Tensor, pred: Predictor, shape, offset: int) -> torch.Tensor:
    L, H, _, D = shape
    s = scales_from_codes(codes, offset)
    return _broadcast_scales(s[: L * H * D].reshape(L, H, D), s[L * H * D :], pred.warm_group(shape))


def _section(sec: Mapping[str, bytes], name: str, owner: str) -> bytes:
    if name not in sec:
        raise BitstreamError(f"{owner}: the bitstream has no section {name!r} (sections: {sorted(sec)})")
    return sec[name]


class Coded(NamedTuple):
    """What :meth:`ResidualCoder.encode` returns."""

    sections: dict[str, Section]  # scales, [bounds,] k.residual, v.residual: in stream order
    recon: dict[str, torch.Tensor]  # the decoder's reconstruction per kind, (L, H, T, D) in the cache dtype
    ideal_bits: dict[str, float]  # the coder's model estimate of each residual stream, sum of -log2 p


@dataclass(frozen=True)
class ResidualCoder:
    """K and V coded as residuals from one predictor each: exactly (``steps=None``) or closed-loop quantized.

    ``owner`` prefixes errors; ``invalid`` replaces the error for a residual stream the decoder's model cannot read
    (when the likely cause is a predictor that computed otherwise than the encoder's); ``exact`` is the exact
    coder (``planes`` or ``laplace``, see the module docstring).
    """

    owner: str
    invalid: str = ""
    exact: str = "planes"

    def __post_init__(self) -> None:
        check_choice(self.owner, "exact", self.exact, EXACT_CODERS)

    def _laplace(self, steps) -> bool:
        """Whether the stream has Laplace scales (every coder but exact ``planes``)."""
        return steps is not None or self.exact == "laplace"

    def encode(self, kv: KVSequence, preds: Mapping[str, Predictor],
               steps: Mapping[str, torch.Tensor] | None) -> Coded:
        """``steps[kind]``: float64 step broadcastable to ``(L, H, T, D)``; ``None`` codes every value exactly."""
        codes, streams, bounds, recon, ideal = [], {}, [], {}, {}
        for kind in KINDS:
            x = getattr(kv, kind)  # (L, H, T, D)
            if steps is None and self.exact == "planes":
                streams[kind], ideal[kind] = encode_planes(x, preds[kind])
                recon[kind] = x
                continue
            if steps is None:
                c, streams[kind], ideal[kind] = self._encode_exact(x, preds[kind])
                recon[kind] = x
            else:
                c, streams[kind], ideal[kind], lo_hi, recon[kind] = self._encode_quantized(x, preds[kind], steps[kind])
                bounds += lo_hi
            codes.append(c)
        sections: dict[str, Section] = {}
        if self._laplace(steps):
            sections["scales"] = _encode_codes(np.concatenate(codes))
        if steps is not None:
            sections["bounds"] = struct.pack("<4i", *bounds)
        sections["k.residual"], sections["v.residual"] = streams["k"], streams["v"]
        return Coded(sections, recon, ideal)

    def decode(self, sec: Mapping[str, bytes], preds: Mapping[str, Predictor], shape, dtype,
               steps: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """The reconstruction per kind, ``(L, H, T, D)`` in ``dtype``, from the sections :meth:`encode` wrote."""
        L, H, _, D = shape
        if self._laplace(steps):
            sizes = [L * H * D + preds[kind].n_warm(shape) for kind in KINDS]
            codes = torch.from_numpy(_decode_codes(_section(sec, "scales", self.owner), sum(sizes), self.owner))
            per_kind = dict(zip(KINDS, (codes[: sizes[0]], codes[sizes[0] :])))
        if steps is not None:
            raw = _section(sec, "bounds", self.owner)
            if len(raw) != 16:
                raise BitstreamError(f"{self.owner}: bounds section holds {len(raw)} bytes, not 16")
            bounds = struct.unpack("<4i", raw)
        out = {}
        for i, kind in enumerate(KINDS):
            raw, pred = _section(sec, f"{kind}.residual", self.owner), preds[kind]
            try:
                if steps is None and self.exact == "planes":
                    out[kind] = decode_planes(raw, pred, shape, dtype, self.owner)
                elif steps is None:
                    out[kind] = self._decode_exact(raw, per_kind[kind], pred, shape, dtype)
                else:
                    out[kind] = self._decode_quantized(raw, per_kind[kind], pred, shape, dtype, steps[kind],
                                                       bounds[2 * i : 2 * i + 2])
            except BitstreamError as e:
                if isinstance(e.__cause__, AssertionError):  # the coder: invalid under the decoder's model
                    raise BitstreamError(self.invalid or f"{self.owner} {kind}.residual: {e}") from e
                raise
        return out

    # ---- lossless: exact values under a value-space Laplace ---------------------------------------------------

    @staticmethod
    def _encode_exact(x: torch.Tensor, pred: Predictor):
        mu = pred.predict_all(x)  # (L, H, T, D) float64; open loop == closed loop when nothing is lost
        codes, b = _scales((x.double() - mu).abs(), pred, VALUE_SCALE_OFFSET)
        enc, ideal = StreamEncoder(), 0.0
        for xg, mg, bg in zip(pred.groups(x), pred.groups(mu), pred.groups(b)):
            ideal += encode_values(enc, xg, mg.numpy(), bg.numpy())
        return codes.numpy(), enc.finish(), ideal

    @staticmethod
    def _decode_exact(raw: bytes, codes: torch.Tensor, pred: Predictor, shape, dtype) -> torch.Tensor:
        b = _element_scales(codes, pred, shape, VALUE_SCALE_OFFSET)
        recon = torch.zeros(shape, dtype=dtype)
        flat = recon.view(-1)
        index = torch.arange(recon.numel()).reshape(shape)
        dec = StreamDecoder(raw)
        for g, (idx, bg) in enumerate(zip(pred.groups(index), pred.groups(b))):
            for c in range(idx.shape[0]):
                flat[idx[c]] = decode_values(dec, pred.predict(recon, g, c).numpy(), bg[c].numpy(), dtype)
        dec.finish("residual")
        return recon

    # ---- lossy: uniform quantization of the residual, closed loop -----------------------------------------------

    def _encode_quantized(self, x: torch.Tensor, pred: Predictor, step: torch.Tensor):
        shape = x.shape
        if pred.copies_previous_token:
            grid = torch.round(x.double() / step)  # (L, H, T, D)
            q = grid.clone()
            q[:, :, 1:] -= grid[:, :, :-1]
            recon = (grid * step).to(x.dtype)
        else:
            q = torch.zeros(shape, dtype=torch.float64)
            recon = torch.zeros(shape, dtype=x.dtype)
            flat_q, flat_r, flat_x = q.view(-1), recon.view(-1), x.reshape(-1).double()
            flat_s = step.expand(shape).reshape(-1)
            index = torch.arange(x.numel()).reshape(shape)
            for g, idx in enumerate(pred.groups(index)):
                for c in range(idx.shape[0]):
                    mu, s = pred.predict(recon, g, c), flat_s[idx[c]]
                    qi = torch.round((flat_x[idx[c]] - mu) / s)
                    flat_q[idx[c]] = qi
                    flat_r[idx[c]] = (mu + qi * s).to(x.dtype)
        codes, b = _scales(q.abs(), pred, SYMBOL_SCALE_OFFSET)
        symbols = torch.cat([g.reshape(-1) for g in pred.groups(q)]).to(torch.int64).numpy()
        scales = torch.cat([g.reshape(-1) for g in pred.groups(b)]).numpy()
        lo, hi = int(min(symbols.min(), -1)), int(max(symbols.max(), 1))
        if lo < -(2**31) or hi >= 2**31:
            raise ValueError(f"{self.owner}: the step is too fine for these values: residual symbols span "
                             f"[{lo}, {hi}], beyond 32 bits; use a coarser step")
        enc = StreamEncoder()
        enc.laplace(symbols, scales, lo, hi)
        return codes.numpy(), enc.finish(), ideal_bits_leaky_laplace(symbols, scales), [lo, hi], recon

    @staticmethod
    def _decode_quantized(raw, codes, pred: Predictor, shape, dtype, step, lo_hi) -> torch.Tensor:
        lo, hi = lo_hi
        b = _element_scales(codes, pred, shape, SYMBOL_SCALE_OFFSET)
        dec = StreamDecoder(raw)
        index = torch.arange(math.prod(shape)).reshape(shape)
        idx_groups, b_groups = pred.groups(index), pred.groups(b)
        if pred.copies_previous_token:
            q = torch.zeros(math.prod(shape), dtype=torch.int64)
            idx = torch.cat([g.reshape(-1) for g in idx_groups])
            q[idx] = torch.from_numpy(dec.laplace(idx.numel(), torch.cat([g.reshape(-1) for g in b_groups]).numpy(), lo, hi)).long()
            dec.finish("residual")
            grid = torch.cumsum(q.reshape(shape), dim=2)  # (L, H, T, D) grid indices
            return (grid.double() * step).to(dtype)
        recon = torch.zeros(shape, dtype=dtype)
        flat_r = recon.view(-1)
        flat_s = step.expand(shape).reshape(-1)
        for g, (idx, bg) in enumerate(zip(idx_groups, b_groups)):
            for c in range(idx.shape[0]):
                qi = torch.from_numpy(dec.laplace(idx.shape[1], bg[c].numpy(), lo, hi)).double()
                flat_r[idx[c]] = (pred.predict(recon, g, c) + qi * flat_s[idx[c]]).to(dtype)
        dec.finish("residual")
        return recon
