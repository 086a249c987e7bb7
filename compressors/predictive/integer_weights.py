"""Integer predictor weights and exact integer sums, for the fitted predictors of
:mod:`compressors.predictive.delta_predictors` and for AQUA-KV's stored predictors
(:mod:`compressors.transform.aquakv`): weights as ``bits``-bit integers with a power-of-two scale per output, their
bytes, inputs in fixed point, matrix products that are exact whatever the BLAS, and the ridge solve that fits them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from compressors.predictive import fit_numerics
from kvbench.coding.bitstream import BitstreamError
from kvbench.coding.packing import pack_codes, tensor_from_bytes, tensor_to_bytes, unpack_codes

#: inputs in fixed point with this many fraction bits (float16's smallest subnormal is 2**-24)
FRACTION_BITS = 24
#: relative ridge added to the normal equations (keeps rarely excited channels well posed)
RIDGE = 1e-4


def fixed_point(x: torch.Tensor, magnitude_bits: int) -> torch.Tensor:
    """``round(x * 2**24)`` as int64, clamped to ``|.| < 2**magnitude_bits`` so that integer sums cannot overflow."""
    lim = float(2**magnitude_bits - 1)
    return torch.round(x.double() * 2.0**FRACTION_BITS).clamp_(-lim, lim).to(torch.int64)


@dataclass
class QuantizedWeights:
    """``W_real[..., i, j] = w[..., i, j] * 2**-shift[..., j]``; the last input row is the bias."""

    w: torch.Tensor  # (..., n_in + 1, n_out) int64, |w| < 2**(bits - 1)
    shift: torch.Tensor  # (..., n_out) int64
    bits: int

    @classmethod
    def from_real(cls, W: torch.Tensor, bits: int) -> QuantizedWeights:
        """Round per output column to ``bits``-bit integers with the largest power-of-two scale that fits."""
        top = 2 ** (bits - 1) - 1
        W = W.double()
        peak = W.abs().amax(dim=-2)  # (..., n_out)
        # floor(log2(top / peak)) from the exponent alone: a vectorised log2 may be an ulp off on another machine,
        # and at a power of two that would move the scale (frexp: top / peak = m * 2**e, m in [0.5, 1))
        _, e = torch.frexp(top / peak.clamp_min(1e-300))
        shift = torch.where(peak > 0, e - 1, torch.zeros_like(e)).clamp(-64, 63).to(torch.int64)
        # W * 2**shift is exact; only W's own last bits (float64 sums, see fit_numerics) could move a rounding
        w = torch.round(torch.ldexp(W, shift.double().unsqueeze(-2))).clamp(-top, top).to(torch.int64)
        return cls(w, shift, bits)

    def to_bytes(self) -> tuple[bytes, int]:
        """The real side information: weights as ``bits``-bit two's-complement codes, shifts as int8."""
        if self.bits <= 8:
            raw, nbits = pack_codes((self.w + 2 ** (self.bits - 1)).to(torch.uint8), self.bits)
        else:
            raw = tensor_to_bytes(self.w.to(torch.int16))
            nbits = 8 * len(raw)
        shifts = tensor_to_bytes(self.shift.to(torch.int8))
        return raw + shifts, nbits + 8 * len(shifts)

    @classmethod
    def from_bytes(cls, raw: bytes, shape: tuple[int, ...], bits: int, what: str) -> QuantizedWeights:
        """Inverse of :meth:`to_bytes` for weights of ``shape`` ``(..., n_in + 1, n_out)``; a
        :class:`~kvbench.coding.bitstream.BitstreamError` naming ``what`` when ``raw`` is not exactly such weights."""
        shift_shape = (*shape[:-2], shape[-1])
        n_w, n_s = math.prod(shape), math.prod(shift_shape)
        n_wbytes = -(-n_w * bits // 8) if bits <= 8 else 2 * n_w
        if len(raw) != n_wbytes + n_s:
            raise BitstreamError(f"{what} holds {len(raw)} bytes, not the {n_wbytes + n_s} that {bits}-bit weights "
                                 f"of shape {tuple(shape)} and their int8 shifts take")
        if bits <= 8:
            w = unpack_codes(raw[:n_wbytes], bits, n_w).to(torch.int64) - 2 ** (bits - 1)  # (n_w,)
        else:
            w = tensor_from_bytes(raw[:n_wbytes], torch.int16, (n_w,)).to(torch.int64)  # (n_w,)
        shift = tensor_from_bytes(raw[n_wbytes:], torch.int8, (n_s,)).to(torch.int64)  # (n_s,)
        top = 2 ** (bits - 1) - 1
        if bool((w.abs() > top).any()):
            raise BitstreamError(f"{what} is malformed: a weight lies outside the {bits}-bit range [-{top}, {top}]")
        if bool(((shift < -64) | (shift > 63)).any()):
            raise BitstreamError(f"{what} is malformed: a shift lies outside [-64, 63]")
        return cls(w.reshape(shape), shift.reshape(shift_shape), bits)

    def magnitude_bits(self) -> int:
        """Input magnitude that keeps every integer sum below 2**62."""
        n_in = self.w.shape[-2]
        return min(40, 62 - (self.bits - 1) - math.ceil(math.log2(n_in)))

    def finish(self, acc: torch.Tensor) -> torch.Tensor:
        """Integer accumulator ``(..., n_out)`` -> float64 prediction."""
        return torch.ldexp(acc.double(), -(self.shift + FRACTION_BITS).double())


def exact_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for int64 ``x`` (|x| < 2**40) and small int64 ``w``, exactly, through float64 BLAS.

    ``x`` is split into 20-bit limbs; each limb product sums integers below 2**53, which float64 adds exactly in
    any order, so the result does not depend on how the BLAS blocks the sum.
    """
    hi = torch.div(x, 1 << 20, rounding_mode="floor")
    lo = x - hi * (1 << 20)
    wd = w.double()
    return (hi.double() @ wd).to(torch.int64) * (1 << 20) + (lo.double() @ wd).to(torch.int64)


def solve(G: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """Ridge least squares from normal equations ``G`` (..., n, n) and ``R`` (..., n, m), float64, one system at a
    time (:func:`compressors.predictive.fit_numerics.solve`)."""
    n = G.shape[-1]
    G = G.double()
    lam = RIDGE * G.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-12)
    return fit_numerics.solve(G + lam[..., None, None] * torch.eye(n, dtype=torch.float64), R)
