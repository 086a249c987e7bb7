"""The byte-plane coder: a 16-bit tensor split into two byte planes, each range-coded under per-group histograms
that travel as side information, or stored as it is when no histogram pays (ZipNN, arXiv 2411.05239; DFloat11,
arXiv 2504.11651). The splits, groupings and histogram coding are described in :mod:`compressors.exact.lossless`,
which codes the cache with it; ``delta`` codes its exact residuals' byte planes with it too
(:mod:`compressors.predictive.residual`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvbench.coding.bitstream import BitstreamError
from kvbench.coding.entropy import StreamDecoder, StreamEncoder, laplace_bits

HISTOGRAMS = ("auto", "channel", "head", "layer", "tensor")
GROUPINGS = HISTOGRAMS[1:]
#: stream code of a plane stored verbatim: ``auto`` picks it when no histogram beats 8 bits per byte (float16's
#: low mantissa byte), which also spares the decoder its slowest part
RAW = len(GROUPINGS)

#: histogram precision: a count c > 0 is sent as level 1 + round(2 log2 c), i.e. within 2^(1/4) = 19% of itself.
#: Coarse on purpose: on SmolLM2 traces 2 levels per doubling beat 1, 3, 4, 6 and 8 (finer histograms cost more
#: side information than the better fit saves; scripts/byte_planes.py measures it)
LEVELS_PER_OCTAVE = 2
#: 2^(j/2) rounded to 1/64: exact in float64, so encoder and decoder build bit-identical probability rows
_MANTISSAS = np.array([64, 91], dtype=np.float64) / 64
_MAX_LEVEL = 127


def to_planes(x: torch.Tensor, split: str) -> tuple[np.ndarray, np.ndarray]:
    """The two byte planes of a 16-bit tensor, same shape, uint8: (exponent-holding plane, the rest)."""
    u = x.detach().contiguous().cpu().view(torch.int16).numpy().view(np.uint16)
    if x.dtype == torch.bfloat16 and split == "exponent":
        return ((u >> 7) & 0xFF).astype(np.uint8), (((u >> 8) & 0x80) | (u & 0x7F)).astype(np.uint8)
    return (u >> 8).astype(np.uint8), (u & 0xFF).astype(np.uint8)


def from_planes(a: np.ndarray, b: np.ndarray, dtype: torch.dtype, split: str) -> torch.Tensor:
    """Inverse of :func:`to_planes`."""
    a16, b16 = a.astype(np.uint16), b.astype(np.uint16)
    if dtype == torch.bfloat16 and split == "exponent":
        u = ((b16 & 0x80) << 8) | (a16 << 7) | (b16 & 0x7F)
    else:
        u = (a16 << 8) | b16
    return torch.from_numpy(u.view(np.int16).copy()).view(dtype)


def plane_names(dtype: torch.dtype, split: str) -> tuple[str, str]:
    return ("exp", "mant") if split == "exponent" else ("hi", "lo")


def n_groups(shape: tuple[int, int, int, int], grouping: str) -> int:
    L, H, _, D = shape
    return {"channel": L * H * D, "head": L * H, "layer": L, "tensor": 1}[grouping]


def grouped(plane: np.ndarray, grouping: str) -> np.ndarray:
    """``(L, H, T, D)`` -> ``(G, n)`` channel-major, so that every grouping is a plain reshape."""
    cm = np.ascontiguousarray(plane.transpose(0, 1, 3, 2))  # (L, H, D, T)
    return cm.reshape(n_groups(plane.shape, grouping), -1)


def ungrouped(groups: np.ndarray, shape: tuple[int, int, int, int]) -> np.ndarray:
    L, H, T, D = shape
    return np.ascontiguousarray(groups.reshape(L, H, D, T).transpose(0, 1, 3, 2))  # (L, H, T, D)


def count_levels(counts: np.ndarray) -> np.ndarray:
    """Counts -> levels: 0 for an empty bin, else 1 + round(LEVELS_PER_OCTAVE * log2 c)."""
    lv = 1 + np.rint(LEVELS_PER_OCTAVE * np.log2(np.maximum(counts, 1))).astype(np.int64)
    return np.where(counts > 0, lv, 0)


def level_weights(levels: np.ndarray) -> np.ndarray:
    """Levels -> unnormalized probabilities, exact dyadic float64 (no libm call: identical on every machine)."""
    j = np.maximum(levels - 1, 0)
    w = np.ldexp(_MANTISSAS[j % LEVELS_PER_OCTAVE], (j // LEVELS_PER_OCTAVE).astype(np.int32))
    return np.where(levels > 0, w, 0.0)


def _laplace_bits(symbols: np.ndarray, scale: float, bound: int) -> float:
    """Sum of -log2 p of integers in ``[-bound, bound]`` under one quantized Laplace, by counting each value once
    (side information has few distinct values and many symbols)."""
    counts = np.bincount(np.asarray(symbols, dtype=np.int64) + bound, minlength=2 * bound + 1)
    values = np.flatnonzero(counts)
    return float((counts[values] * laplace_bits(values - bound, scale)).sum())


def _starts(width: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(width + 1)[:-1]]).astype(np.int64)


@dataclass
class Histograms:
    """Per-group histograms as side information: occupied range per group, then log-count levels inside it.

    Coded as Laplace-distributed differences (a group's range and first level against the previous group's,
    the other levels bin to bin) under four scales that travel as float32 in the stream header.
    """

    lo: np.ndarray  # (G,) first occupied bin
    hi: np.ndarray  # (G,) last occupied bin
    levels: np.ndarray  # (G, B)

    @classmethod
    def fit(cls, counts: np.ndarray) -> Histograms:
        occupied = counts > 0
        lo = occupied.argmax(1).astype(np.int64)
        hi = (counts.shape[1] - 1 - occupied[:, ::-1].argmax(1)).astype(np.int64)
        return cls(lo, hi, count_levels(counts))

    def _symbols(self) -> tuple[np.ndarray, np.ndarray]:
        width = self.hi - self.lo
        support = np.concatenate([np.diff(self.lo, prepend=0), np.diff(width, prepend=0)])
        bins = np.arange(self.levels.shape[1])
        vals = self.levels[(bins >= self.lo[:, None]) & (bins <= self.hi[:, None])]  # group by group
        starts = _starts(width)
        prev = np.roll(vals, 1)
        prev[starts] = np.concatenate([[0], vals[starts[:-1]]])
        return support, vals - prev

    def scales(self) -> np.ndarray:
        """Mean |difference| of (lo, width, first levels, other levels), as stored: float32."""
        support, diffs = self._symbols()
        G = self.lo.size
        first = np.zeros(diffs.size, dtype=bool)
        first[_starts(self.hi - self.lo)] = True
        parts = [support[:G], support[G:], diffs[first], diffs[~first]]
        return np.array([max(float(np.abs(q).mean()) if q.size else 0.0, 0.05) for q in parts], dtype=np.float32)

    @staticmethod
    def _level_scales(scales: np.ndarray, width: np.ndarray) -> np.ndarray:
        per = np.full(int((width + 1).sum()), float(scales[3]))
        per[_starts(width)] = float(scales[2])
        return per

    def encode(self, stream: StreamEncoder, scales: np.ndarray) -> None:
        support, diffs = self._symbols()
        stream.laplace(support, np.repeat(scales[:2].astype(np.float64), self.lo.size), -255, 255)
        stream.laplace(diffs, self._level_scales(scales, self.hi - self.lo), -_MAX_LEVEL, _MAX_LEVEL)

    def ideal_bits(self, scales: np.ndarray) -> float:
        support, diffs = self._symbols()
        G = self.lo.size
        first = np.zeros(diffs.size, dtype=bool)
        first[_starts(self.hi - self.lo)] = True
        parts = [(support[:G], 255), (support[G:], 255), (diffs[first], _MAX_LEVEL), (diffs[~first], _MAX_LEVEL)]
        return sum(_laplace_bits(q, float(scale), bound) for (q, bound), scale in zip(parts, scales))

    @classmethod
    def decode(cls, stream: StreamDecoder, scales: np.ndarray, G: int, bins: int) -> Histograms:
        sup = stream.laplace(2 * G, np.repeat(scales[:2].astype(np.float64), G), -255, 255).astype(np.int64)
        lo = np.cumsum(sup[:G])
        hi = lo + np.cumsum(sup[G:])
        if G and (lo.min() < 0 or hi.max() >= bins or (hi < lo).any()):
            raise ValueError("lossless: histogram range out of bounds (corrupted or mismatched stream)")
        width = hi - lo
        d = stream.laplace(int((width + 1).sum()), cls._level_scales(scales, width), -_MAX_LEVEL, _MAX_LEVEL)
        d = d.astype(np.int64)
        starts = _starts(width)
        firsts = np.cumsum(d[starts])
        d[starts] = firsts
        c = np.cumsum(d)
        levels = np.zeros((G, bins), dtype=np.int64)
        b = np.arange(bins)
        levels[(b >= lo[:, None]) & (b <= hi[:, None])] = c - (c[starts] - firsts)[np.repeat(np.arange(G), width + 1)]
        return cls(lo, hi, levels)


@dataclass
class PlaneModel:
    """Probability rows for one byte plane: ``p(byte | group) = p(field | group) * p(rest | field)``.

    ``field`` is the byte's top ``8 - shift`` bits (sign and exponent) with a histogram per group; ``rest`` is
    its low ``shift`` bits (mantissa bits that share the byte) with one conditional table for the whole plane.
    ``shift=0`` is a plain per-group byte histogram.
    """

    shift: int
    field: Histograms  # (G, 256 >> shift)
    joint: Histograms | None  # (1, 256) for shift > 0

    @classmethod
    def fit(cls, counts: np.ndarray, shift: int) -> PlaneModel:
        """``counts``: ``(G, 256)`` byte counts per group."""
        G = counts.shape[0]
        field = Histograms.fit(counts.reshape(G, 256 >> shift, 1 << shift).sum(2))
        return cls(shift, field, Histograms.fit(counts.sum(0, keepdims=True)) if shift else None)

    def _conditional(self) -> np.ndarray:
        """``p(rest | field)``, ``(F, R)``; a row of zeros for a field that never occurs."""
        wj = level_weights(self.joint.levels[0]).reshape(256 >> self.shift, 1 << self.shift)  # (F, R)
        tot = wj.sum(1, keepdims=True)
        return np.divide(wj, tot, out=np.zeros_like(wj), where=tot > 0)

    def rows(self) -> np.ndarray:
        """``(G, 256)`` unnormalized float64 rows, computed by the same exact float ops on both sides."""
        wf = level_weights(self.field.levels)  # (G, F)
        if not self.shift:
            return wf
        return (wf[:, :, None] * self._conditional()[None]).reshape(wf.shape[0], 256)

    def ideal_data_bits(self, counts: np.ndarray) -> float:
        """-log2 p of the bytes counted in ``counts`` ``(G, 256)``: their fields under the group's histogram plus
        (``shift > 0``) their rest under the shared conditional table. A field with counts has a nonzero level in
        its group and in the joint table, so each group's row sums to the sum of its field weights."""
        G, F = counts.shape[0], 256 >> self.shift
        wf = level_weights(self.field.levels)  # (G, F)
        pf = wf / wf.sum(1, keepdims=True)
        cf = counts.reshape(G, F, -1).sum(2)  # (G, F)
        bits = -(cf * np.log2(pf, out=np.zeros_like(pf), where=cf > 0)).sum()  # the logarithm only where seen
        if self.shift:
            cond = self._conditional()  # (F, R)
            cr = counts.sum(0).reshape(F, -1)  # (F, R)
            bits -= (cr * np.log2(cond, out=np.zeros_like(cond), where=cr > 0)).sum()
        return float(bits)

    def scales(self) -> np.ndarray:
        return np.concatenate([self.field.scales(), self.joint.scales() if self.joint else np.zeros(0, np.float32)])

    def side_ideal_bits(self, scales: np.ndarray) -> float:
        return self.field.ideal_bits(scales[:4]) + (self.joint.ideal_bits(scales[4:]) if self.joint else 0.0)

    def encode_side(self, stream: StreamEncoder, scales: np.ndarray) -> None:
        self.field.encode(stream, scales[:4])
        if self.joint:
            self.joint.encode(stream, scales[4:])

    @classmethod
    def decode_side(cls, stream: StreamDecoder, scales: np.ndarray, G: int, shift: int) -> PlaneModel:
        field = Histograms.decode(stream, scales[:4], G, 256 >> shift)
        return cls(shift, field, Histograms.decode(stream, scales[4:], 1, 256) if shift else None)

    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        """Per group, the byte range its row can produce (the field range times all rest values)."""
        return self.field.lo << self.shift, ((self.field.hi + 1) << self.shift) - 1


def channel_counts(plane: np.ndarray) -> np.ndarray:
    """Byte counts per channel, ``(L*H*D, 256)`` channel-major, of a plane ``(L, H, T, D)``.

    One bincount per head over 16-bit keys ``d * 256 + byte``: a head's counts fit in cache, and the keys need no
    transposed copy of the plane (2.4x faster than one bincount over ``channel * 256 + byte`` on SmolLM2 planes).
    """
    L, H, T, D = plane.shape
    key = np.uint16 if D <= 256 else np.uint32
    keys = (plane.astype(key) | (np.arange(D, dtype=key) << 8)).reshape(L * H, T * D)  # (L*H, T*D)
    out = np.empty((L * H, D * 256), dtype=np.int64)
    for head in range(L * H):  # heads, not tokens or elements: 90 calls on SmolLM2
        out[head] = np.bincount(keys[head], minlength=D * 256)
    return out.reshape(L * H * D, 256)


def grouped_counts(ch: np.ndarray, shape: tuple[int, int, int, int], grouping: str) -> np.ndarray:
    """Channel counts ``(L*H*D, 256)`` summed into ``grouping``'s groups (channel-major, as :func:`grouped`)."""
    return ch.reshape(n_groups(shape, grouping), -1, 256).sum(1)


def _fit_groupings(ch: np.ndarray, shape, shift: int, groupings) -> dict[str, tuple[float, PlaneModel]]:
    """Per grouping: estimated size (data under the quantized model + its side information) and model."""
    out = {}
    for name in groupings:
        c = grouped_counts(ch, shape, name)
        m = PlaneModel.fit(c, shift)
        out[name] = (m.ideal_data_bits(c) + m.side_ideal_bits(m.scales()), m)
    return out


def choose_grouping(plane: np.ndarray, shift: int, counts: np.ndarray | None = None) -> tuple[str, dict[str, float]]:
    """The grouping with the smallest estimated size (data under the quantized model + its side information),
    or ``raw`` (the bytes as they are) when none is estimated below 8 bits per byte. ``counts``: the plane's
    :func:`channel_counts` when the caller has them."""
    fits = _fit_groupings(channel_counts(plane) if counts is None else counts, plane.shape, shift, GROUPINGS)
    est = {name: f[0] for name, f in fits.items()}
    best = min(est, key=est.get)
    est["raw"] = 8.0 * plane.size
    return ("raw" if est["raw"] <= est[best] else best), est


@dataclass(frozen=True)
class PlaneHeader:
    """How one plane is coded: its grouping (or ``raw``) and the float32 scales of its histograms' side stream.
    Stored as the grouping's code (``RAW`` for a verbatim plane) followed by the scales."""

    grouping: str
    scales: np.ndarray  # (4,) or (8,) float32 with a conditional table (shift > 0); empty for raw

    def to_bytes(self) -> bytes:
        if self.grouping == "raw":
            return bytes([RAW])
        return bytes([GROUPINGS.index(self.grouping)]) + self.scales.astype("<f4").tobytes()

    @classmethod
    def read(cls, raw: bytes, pos: int, shift: int, owner: str) -> tuple[PlaneHeader, int]:
        """The header at ``raw[pos:]`` of a plane coded with ``shift``, and the position after it."""
        if pos < len(raw) and raw[pos] == RAW:
            return cls("raw", np.zeros(0, np.float32)), pos + 1
        n_scales = 8 if shift else 4
        if pos + 1 + 4 * n_scales > len(raw) or raw[pos] >= len(GROUPINGS):
            raise BitstreamError(f"{owner}: plane header does not match this compressor's settings")
        scales = np.frombuffer(raw[pos + 1 : pos + 1 + 4 * n_scales], dtype="<f4")
        return cls(GROUPINGS[raw[pos]], scales), pos + 1 + 4 * n_scales


def encode_plane(plane: np.ndarray, shift: int, histogram: str, side: StreamEncoder, data: StreamEncoder,
                 counts: np.ndarray | None = None) -> tuple[PlaneHeader, float]:
    """Range-code a plane ``(L, H, T, D)`` uint8: its histograms into ``side``, its bytes into ``data`` (the same
    stream or two). Returns the header and the model's estimate in bits (side information included). A ``raw``
    header means nothing was coded: the caller stores ``plane`` verbatim (8 bits a byte).

    ``histogram``: a grouping, or ``auto`` for the cheapest one by estimate (or ``raw``). ``counts``: the plane's
    :func:`channel_counts` when the caller has them (every grouping's counts are sums of them)."""
    ch = channel_counts(plane) if counts is None else counts
    fits = _fit_groupings(ch, plane.shape, shift, GROUPINGS if histogram == "auto" else [histogram])
    grouping = min(fits, key=lambda name: fits[name][0])
    if histogram == "auto" and 8.0 * plane.size <= fits[grouping][0]:
        return PlaneHeader("raw", np.zeros(0, np.float32)), 8.0 * plane.size
    model = fits[grouping][1]
    scales = model.scales()
    model.encode_side(side, scales)
    rows = model.rows()  # (G, 256)
    lo, hi = model.spans()
    symbols = grouped(plane, grouping).astype(np.int32) - lo[:, None].astype(np.int32)  # (G, n), from each span's start
    coded = np.flatnonzero(hi > lo)  # a group with a one-symbol range is known from the side information
    data.categorical_rows(symbols[coded], [rows[g, lo[g] : hi[g] + 1] for g in coded])
    return PlaneHeader(grouping, scales), fits[grouping][0]


def decode_plane(head: PlaneHeader, shape: tuple[int, int, int, int], shift: int, side: StreamDecoder,
                 data: StreamDecoder) -> np.ndarray:
    """Inverse of :func:`encode_plane` for a coded (not ``raw``) plane: ``(L, H, T, D)`` uint8."""
    G = n_groups(shape, head.grouping)
    n = math.prod(shape) // G
    model = PlaneModel.decode_side(side, head.scales, G, shift)
    rows = model.rows()
    lo, hi = model.spans()
    out = np.repeat(lo[:, None], n, axis=1).astype(np.uint8)  # (G, n)
    coded = np.flatnonzero(hi > lo)
    out[coded] = data.categorical_rows(n, [rows[g, lo[g] : hi[g] + 1] for g in coded]) + lo[coded, None]
    return ungrouped(out, shape)


def field_shift(dtype: torch.dtype, split: str, plane_index: int) -> int:
    """Mantissa bits that share the exponent's byte: 2 for float16's high byte; none for bfloat16's ``e8``."""
    return 2 if plane_index == 0 and dtype == torch.float16 else 0
