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
  better. Either way the two bytes of every element go to the byte-plane coder of :mod:`compressors.exact.lossless`
  (histograms per channel, head, layer or tensor, or raw bytes). The residual symbols do not depend on the
  prediction's value, so the decoder reads all of them at once and the loop over units only adds predictions;
  for a predictor that copies the previous token it is a cumulative sum.
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
kind needs: one bit per channel (1: residual, 0: value), the two plane headers of :class:`PlaneHeader`, one
range-coded stream (each coded plane's histograms, then its bytes) and the planes stored raw, in that order.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from compressors.exact.lossless import (
    PlaneHeader,
    channel_counts,
    decode_plane,
    encode_plane,
    field_shift,
    from_planes,
    to_planes,
)
from compressors.predictive.delta_predictors import Predictor
from kvbench.coding.bitstream import BitstreamError
from kvbench.coding.entropy import StreamDecoder, StreamEncoder
from kvbench.coding.float_coding import decode_values, encode_values
from kvbench.coding.packing import pack_codes, unpack_codes
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
    return StreamDecoder(raw[2:]).laplace(n, max(spread / 16, 1e-3), 0, 255, mean=float(med)).astype(np.int64)


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


# ---- exact residuals of 16-bit patterns, as byte planes --------------------------------------------------------


def bit_patterns(x: torch.Tensor) -> np.ndarray:
    """The 16-bit patterns of a 16-bit float tensor, uint16, same shape."""
    return x.detach().contiguous().cpu().view(torch.int16).numpy().view(np.uint16)


def from_bit_patterns(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`bit_patterns`."""
    return torch.from_numpy(np.ascontiguousarray(bits, dtype=np.uint16).view(np.int16)).view(dtype)


def zigzag(d: np.ndarray) -> np.ndarray:
    """Differences of 16-bit patterns (uint16, i.e. modulo 2**16) -> 0, -1, 1, -2, ... mapped to 0, 1, 2, 3, ..."""
    s = d.view(np.int16)
    return ((s << 1) ^ (s >> 15)).view(np.uint16)  # s >> 15 is -1 for a negative s (arithmetic shift)


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of :func:`zigzag`, modulo 2**16."""
    return (z >> 1) ^ ((z & 1) * np.uint16(0xFFFF))


def prediction_bits(x: torch.Tensor, pred: Predictor) -> np.ndarray:
    """Bit patterns ``(L, H, T, D)`` uint16 of every prediction rounded to the cache dtype, from the exact cache.

    A predictor that copies the previous token predicts its bit pattern (0, i.e. +0.0, at token 0): what rounding
    its float64 copy gives too, except for a signalling NaN, which the round trip through float64 quiets; the
    decoder's cumulative sum depends on the copy being exact."""
    if pred.copies_previous_token:
        base = np.zeros(x.shape, dtype=np.uint16)
        base[:, :, 1:] = bit_patterns(x)[:, :, :-1]
        return base
    return bit_patterns(pred.predict_all(x).to(x.dtype))


def channel_bits(counts: np.ndarray, shift: int) -> np.ndarray:
    """Two-part code length (Rissanen's MDL) of each channel's bytes ``(C, 256)`` under its own histogram:
    ``n H`` of the empirical distribution plus ``log2(n) / 2`` per further occupied bin (of the ``256 >> shift``
    fields the histograms are stored over); ``(C,)``. What picks each channel's mode, not what is coded."""
    n = counts.sum(1)
    c_log_c = np.arange(int(n.max(initial=0)) + 1, dtype=np.float64)
    c_log_c *= np.log2(np.maximum(c_log_c, 1))  # c log2 c for every count that can occur: one lookup per bin
    data = c_log_c[n] - c_log_c[counts].sum(1)
    bins = (counts.reshape(len(counts), 256 >> shift, 1 << shift).sum(2) > 0).sum(1)
    return data + 0.5 * np.maximum(bins - 1, 0) * np.log2(np.maximum(n, 2))


def encode_planes(x: torch.Tensor, pred: Predictor) -> tuple[bytes, float]:
    """The exact ``planes`` residual section of one kind ``(L, H, T, D)`` and the model's estimate of its bits."""
    L, H, T, D = x.shape
    z = zigzag(bit_patterns(x) - prediction_bits(x, pred))  # (L, H, T, D) uint16
    resid = ((z >> 8).astype(np.uint8), z.astype(np.uint8))  # how far the prediction is off, high byte first
    value = to_planes(x, "exponent")  # the bytes of a prediction of zero, exponent whole in the first
    shifts = (field_shift(x.dtype, "exponent", 0), 0)
    counts = [(channel_counts(a), channel_counts(b)) for a, b in zip(resid, value)]  # per plane, (L*H*D, 256) each
    # each channel's mode by its own two-part code length; a second plane is at worst stored as it is
    cost = [sum(np.minimum(channel_bits(c[j], s), 8.0 * T) for c, s in zip(counts, shifts)) for j in (0, 1)]
    use = cost[0] < cost[1]  # (L*H*D,)
    m = use.reshape(L, H, 1, D)
    stream = StreamEncoder()
    heads, ideal, verbatim = [], 0.0, []
    for r_plane, v_plane, (c_resid, c_value), s in zip(resid, value, counts, shifts):
        plane = np.where(m, r_plane, v_plane)  # (L, H, T, D) uint8
        head, bits = encode_plane(plane, s, "auto", stream, stream, np.where(use[:, None], c_resid, c_value))
        heads.append(head)
        ideal += bits
        if head.grouping == "raw":
            verbatim.append(plane.tobytes())
    front = pack_codes(torch.from_numpy(use), 1)[0] + b"".join(h.to_bytes() for h in heads)
    return front + stream.finish()[0] + b"".join(verbatim), ideal + 8 * len(front)


def decode_planes(raw: bytes, pred: Predictor, shape, dtype: torch.dtype, owner: str) -> torch.Tensor:
    """Inverse of :func:`encode_planes`: the cache of one kind ``(L, H, T, D)`` in ``dtype``."""
    L, H, T, D = shape
    n, n_modes = L * H * T * D, -(-L * H * D // 8)
    if len(raw) < n_modes:
        raise BitstreamError(f"{owner}: residual section is truncated")
    use = unpack_codes(raw[:n_modes], 1, L * H * D).bool()  # (L*H*D,)
    shift = field_shift(dtype, "exponent", 0)
    heads, pos = [], n_modes
    for s in (shift, 0):
        head, pos = PlaneHeader.read(raw, pos, s, owner)
        heads.append(head)
    end = len(raw) - n * sum(h.grouping == "raw" for h in heads)
    coded = any(h.grouping != "raw" for h in heads)
    if end < pos or (end - pos) % 4 or coded != (end > pos):
        raise BitstreamError(f"{owner}: residual section has {len(raw)} bytes, which its plane headers do not account for")
    stream = StreamDecoder(raw[pos:end])
    planes = []
    for head, s in zip(heads, (shift, 0)):
        if head.grouping == "raw":
            planes.append(np.frombuffer(raw, dtype=np.uint8, count=n, offset=end).reshape(shape).copy())
            end += n
        else:
            planes.append(decode_plane(head, shape, s, stream, stream))
    m = use.numpy().reshape(L, H, 1, D)
    value = bit_patterns(from_planes(*planes, dtype, "exponent"))  # (L, H, T, D) uint16
    if not m.any():
        return from_bit_patterns(value, dtype)
    r = unzigzag((planes[0].astype(np.uint16) << 8) | planes[1])  # (L, H, T, D) uint16: residuals modulo 2**16
    if pred.copies_previous_token:
        # x_t = x_{t-1} + r_t (mod 2**16) from x_{-1} = +0.0: a cumulative sum of residuals along the tokens
        return from_bit_patterns(np.where(m, np.cumsum(r, axis=2, dtype=np.uint16), value), dtype)
    # value channels are known now; residual channels unit by unit, each from the reconstruction so far
    recon = from_bit_patterns(np.where(m, 0, value), dtype)
    flat = recon.view(-1)
    index = torch.arange(n).reshape(shape)
    r32 = torch.from_numpy(r.astype(np.int32))
    mask = torch.from_numpy(np.broadcast_to(m, shape).copy())
    for g, (idx, rg, mg) in enumerate(zip(pred.groups(index), pred.groups(r32), pred.groups(mask))):
        for c in range(idx.shape[0]):
            sel = idx[c][mg[c]]
            if sel.numel():
                base = torch.from_numpy(bit_patterns(pred.predict(recon, g, c).to(dtype)).astype(np.int32))  # (N,)
                flat[sel] = from_bit_patterns(((base + rg[c])[mg[c]] & 0xFFFF).numpy().astype(np.uint16), dtype)
    return recon


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
            except AssertionError as e:  # constriction: the stream is invalid under the decoder's model
                raise BitstreamError(self.invalid or f"{self.owner}: {e}") from e
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
            grid = torch.cumsum(q.reshape(shape), dim=2)  # (L, H, T, D) grid indices
            return (grid.double() * step).to(dtype)
        recon = torch.zeros(shape, dtype=dtype)
        flat_r = recon.view(-1)
        flat_s = step.expand(shape).reshape(-1)
        for g, (idx, bg) in enumerate(zip(idx_groups, b_groups)):
            for c in range(idx.shape[0]):
                qi = torch.from_numpy(dec.laplace(idx.shape[1], bg[c].numpy(), lo, hi)).double()
                flat_r[idx[c]] = (pred.predict(recon, g, c) + qi * flat_s[idx[c]]).to(dtype)
        return recon
