"""Predictors for :mod:`compressors.delta`: what the decoder can guess of each KV vector before reading it.

A predictor walks the cache of one kind (K or V), ``(L, H, T, D)``, in *units*: groups of elements the decoder
reconstructs together, each predicted only from units already reconstructed. ``groups`` lays any ``(L, H, T, D)``
tensor out as those units, ``predict`` gives one unit's prediction from the reconstruction so far, and
``predict_all`` gives every unit's prediction from a complete cache at once (valid when the reconstruction is
exact, i.e. lossless coding, where closed loop and open loop coincide).

Fitted predictors (``linear``, ``cross_layer``) hold integer weights with a power-of-two scale per output and
evaluate on inputs in fixed point (``x * 2**24``, exact for float16), so every prediction is an exact integer
sum: the same bits whether the encoder computes all tokens in one batch or the decoder one token at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvbench.packing import pack_codes, tensor_to_bytes

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
        peak = W.abs().amax(dim=-2)  # (..., n_out)
        shift = torch.where(peak > 0, torch.floor(torch.log2(top / peak.clamp_min(1e-300))), torch.zeros_like(peak))
        shift = shift.clamp(-64, 63).to(torch.int64)
        w = torch.round(W * torch.pow(2.0, shift.double()).unsqueeze(-2)).clamp(-top, top).to(torch.int64)
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


def _solve(G: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """Ridge least squares from normal equations ``G`` (..., n, n) and ``R`` (..., n, m).

    Solved in numpy: torch's batched ``linalg.solve`` runs MKL's threaded LU inside its own OpenMP loop over the
    batch, and that nesting can spin forever on two cores (seen with 29 systems of 193 unknowns).
    """
    n = G.shape[-1]
    lam = RIDGE * G.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-12)
    A = (G + lam[..., None, None] * torch.eye(n, dtype=G.dtype)).numpy()
    return torch.from_numpy(np.linalg.solve(A, R.numpy())).to(G.dtype)


class Predictor:
    """Base: units, one prediction per unit, and the batched open-loop predictions."""

    def groups(self, t: torch.Tensor) -> list[torch.Tensor]:
        """``t`` ``(L, H, T, D)`` laid out as unit groups, each ``(C, N)``: C units of N elements, in order."""
        raise NotImplementedError

    def predict(self, recon: torch.Tensor, g: int, c: int) -> torch.Tensor:
        """Prediction ``(N,)`` float64 of unit ``c`` of group ``g`` from ``recon`` (earlier units filled in)."""
        raise NotImplementedError

    def predict_all(self, x: torch.Tensor) -> torch.Tensor:
        """Predictions ``(L, H, T, D)`` float64 of every unit from the exact cache ``x``."""
        raise NotImplementedError

    def warm_group(self, shape: tuple[int, int, int, int]) -> torch.Tensor:
        """``(L, H, T, D)`` int64: -1 where a prediction exists; elsewhere (nothing to predict from: the value is
        coded against 0) the index of the warm-up scale that codes it."""
        raise NotImplementedError

    def n_warm(self, shape: tuple[int, int, int, int]) -> int:
        return int(self.warm_group(shape).max().clamp_min(-1)) + 1


class Temporal(Predictor):
    """Tokens in order. ``previous``: the same layer/head/channel at token t-1 (CacheGen-style delta, arXiv
    2310.07240). With ``weights``: an order-p autoregression per (layer, head, channel) plus a bias; tokens
    1..p-1 fall back to ``previous``. Token 0 has no prediction."""

    def __init__(self, weights: QuantizedWeights | None = None) -> None:
        self.weights = weights
        self.order = 1 if weights is None else weights.w.shape[-2] - 1

    def groups(self, t):
        L, H, T, D = t.shape
        return [t.permute(2, 0, 1, 3).reshape(T, L * H * D)]  # (T, L*H*D): one unit per token

    def _ar(self, lags: list[torch.Tensor]) -> torch.Tensor:
        """``lags[j]`` is the cache at t-1-j, ``(L, H, D)`` or ``(L, H, T', D)``: exact integer AR sum -> float64."""
        q = self.weights
        w, shift = q.w[..., 0], q.shift[..., 0]  # (L, H, D, p+1), (L, H, D)
        if lags[0].dim() == 4:
            w, shift = w.unsqueeze(2), shift.unsqueeze(2)  # broadcast over tokens
        mag = q.magnitude_bits()
        acc = w[..., self.order] * (1 << FRACTION_BITS)
        for j, lag in enumerate(lags):
            acc = acc + fixed_point(lag, mag) * w[..., j]
        return torch.ldexp(acc.double(), -(shift + FRACTION_BITS).double())

    def predict(self, recon, g, c):
        t = c
        if t == 0:
            return torch.zeros(recon[:, :, 0].numel(), dtype=torch.float64)
        if self.weights is None or t < self.order:
            return recon[:, :, t - 1].double().reshape(-1)
        return self._ar([recon[:, :, t - 1 - j] for j in range(self.order)]).reshape(-1)

    def predict_all(self, x):
        mu = torch.zeros(x.shape, dtype=torch.float64)
        T, p = x.shape[2], self.order
        if T > 1:
            mu[:, :, 1:] = x[:, :, :-1].double()
        if self.weights is not None and T > p:
            mu[:, :, p:] = self._ar([x[:, :, p - 1 - j : T - 1 - j] for j in range(p)])
        return mu

    def warm_group(self, shape):
        L, H, T, D = shape
        g = torch.full(shape, -1, dtype=torch.int64)
        g[:, :, 0] = torch.arange(L).view(L, 1, 1)  # token 0: one scale per layer
        return g

    @staticmethod
    def fit(calib: Sequence[torch.Tensor], order: int, bits: int) -> QuantizedWeights:
        """Least squares per (layer, head, channel) of x_t on x_{t-1..t-p} and 1 over the calibration caches.

        Weights are stored as ``(L, H, D, p+1, 1)``: one column per channel.
        """
        G = R = None
        for x in calib:
            xd = x.double()  # (L, H, T, D)
            T = xd.shape[2]
            if T <= order:
                continue
            feats = [xd[:, :, order - 1 - j : T - 1 - j] for j in range(order)] + [torch.ones_like(xd[:, :, order:])]
            Z = torch.stack(feats, dim=-1)  # (L, H, T-p, D, p+1)
            y = xd[:, :, order:]  # (L, H, T-p, D)
            g = torch.einsum("lhtdi,lhtdj->lhdij", Z, Z)
            r = torch.einsum("lhtdi,lhtd->lhdi", Z, y)
            G, R = (g, r) if G is None else (G + g, R + r)
        if G is None:
            raise ValueError(f"delta: calibration sequences are too short for order={order}")
        W = _solve(G, R.unsqueeze(-1))  # (L, H, D, p+1, 1)
        return QuantizedWeights.from_real(W, bits)


class CrossLayer(Predictor):
    """Layer l from the reconstructed layer l-1 at the same token: a linear map of all of layer l-1's heads
    (H*D inputs plus a bias) to all of layer l's, per layer, fitted by least squares. Layer 0 has no layer below;
    it falls back to ``previous`` (token by token)."""

    def __init__(self, weights: QuantizedWeights) -> None:
        self.weights = weights  # (L-1, H*D + 1, H*D)

    def groups(self, t):
        L, H, T, D = t.shape
        first = t[0].permute(1, 0, 2).reshape(T, H * D)  # (T, H*D): layer 0, token by token
        rest = t[1:].reshape(L - 1, H * T * D)  # (L-1, H*T*D): one unit per layer
        return [first, rest]

    def _map(self, below: torch.Tensor, layer: int) -> torch.Tensor:
        """``below`` (H, T, D) reconstructed layer ``layer - 1`` -> float64 prediction of ``layer``, (H, T, D)."""
        H, T, D = below.shape
        q = self.weights
        xi = fixed_point(below.permute(1, 0, 2).reshape(T, H * D), q.magnitude_bits())  # (T, H*D)
        w = q.w[layer - 1]  # (H*D + 1, H*D)
        acc = exact_matmul(xi, w[:-1]) + w[-1] * (1 << FRACTION_BITS)  # (T, H*D)
        mu = torch.ldexp(acc.double(), -(q.shift[layer - 1] + FRACTION_BITS).double())
        return mu.reshape(T, H, D).permute(1, 0, 2)

    def predict(self, recon, g, c):
        if g == 0:
            return torch.zeros(recon[0, :, 0].numel(), dtype=torch.float64) if c == 0 else recon[0, :, c - 1].double().reshape(-1)
        return self._map(recon[c], c + 1).reshape(-1)

    def predict_all(self, x):
        mu = torch.zeros(x.shape, dtype=torch.float64)
        mu[0, :, 1:] = x[0, :, :-1].double()
        for layer in range(1, x.shape[0]):
            mu[layer] = self._map(x[layer - 1], layer)
        return mu

    def warm_group(self, shape):
        g = torch.full(shape, -1, dtype=torch.int64)
        g[0, :, 0] = 0
        return g

    @staticmethod
    def fit(calib: Sequence[torch.Tensor], bits: int) -> QuantizedWeights:
        G = R = None
        for x in calib:
            L, H, T, D = x.shape
            flat = x.double().permute(0, 2, 1, 3).reshape(L, T, H * D)  # (L, T, H*D)
            Z = torch.cat([flat[:-1], torch.ones(L - 1, T, 1, dtype=torch.float64)], dim=-1)  # (L-1, T, H*D+1)
            g, r = Z.transpose(1, 2) @ Z, Z.transpose(1, 2) @ flat[1:]
            G, R = (g, r) if G is None else (G + g, R + r)
        return QuantizedWeights.from_real(_solve(G, R), bits)


class FromModel(Predictor):
    """A fixed prediction of the whole cache (a cheaper model's recomputed KV); nothing depends on the reconstruction."""

    def __init__(self, mu: torch.Tensor) -> None:
        self.mu = mu.double()  # (L, H, T, D)

    def groups(self, t):
        return [t.reshape(1, -1)]

    def predict(self, recon, g, c):
        return self.mu.reshape(-1)

    def predict_all(self, x):
        return self.mu

    def warm_group(self, shape):
        return torch.full(shape, -1, dtype=torch.int64)
