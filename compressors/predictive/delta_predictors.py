"""Predictors for :mod:`compressors.predictive.delta` and :mod:`compressors.predictive.speculative`: what the decoder can guess of each KV
vector before reading it.

Two layers. A :class:`Predictor` walks the cache of one kind (K or V), ``(L, H, T, D)``, in *units*: groups of
elements the decoder reconstructs together, each predicted only from units already reconstructed. ``groups`` lays
any ``(L, H, T, D)`` tensor out as those units, ``predict`` gives one unit's prediction from the reconstruction so
far, and ``predict_all`` gives every unit's prediction from a complete cache at once (valid when the reconstruction
is exact, i.e. lossless coding, where closed loop and open loop coincide).

A :class:`DeltaPredictor` is a predictor as ``delta`` chooses it by name (``previous``, ``linear``,
``cross_layer``; :func:`make_predictor`): it fits itself on calibration caches, hands its fitted state out as bytes
(what the decoder is charged for), loads those bytes back on a decoder that never saw the calibration, and gives the
:class:`Predictor` for a cache shape. The bytes carry no shape (the decoder's context has it), so loaded state is
parsed, and its length checked, against the first cache shape it is used with.

Fitted predictors (``linear``, ``cross_layer``) hold integer weights with a power-of-two scale per output and
evaluate on inputs in fixed point (``x * 2**24``, exact for float16), so every prediction is an exact integer
sum: the same bits whether the encoder computes all tokens in one batch or the decoder one token at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

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

    #: True when every prediction is a copy of the same element at an earlier token (or 0): predictions of a
    #: reconstruction on a grid ``step * Z`` then stay on it, so the quantized closed loop is plain rounding
    copies_previous_token: bool = False

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
        self.copies_previous_token = weights is None

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


# ---- predictors as delta chooses them: fit, state as bytes, load, predict -------------------------------------------


class DeltaPredictor:
    """One kind's (K or V) predictor as :class:`~compressors.predictive.delta.Delta` uses it: fitted on calibration caches,
    its fitted state as bytes, that state loaded back, and the :class:`Predictor` for a cache shape.

    ``kind`` names the kind in errors and in the state section (``k.weights``, ``v.weights``).
    """

    name: ClassVar[str] = ""
    #: True when :meth:`fit` learns state the decoder needs (one state section per kind)
    fitted: ClassVar[bool] = False

    def __init__(self, kind: str) -> None:
        self.kind = kind

    @property
    def section(self) -> str:
        return f"{self.kind}.weights"

    def fit(self, calib: Sequence[torch.Tensor]) -> None:
        """Learn from calibration caches of this kind, each ``(L, H, T, D)``; nothing to learn by default."""

    def state(self) -> tuple[bytes, int] | bytes:
        """The fitted state, every bit the decoder needs: ``(bytes, exact_bits)`` or ``bytes``."""
        raise ValueError(f"delta.predictor={self.name} has no fitted state")

    def load_state(self, raw: bytes) -> None:
        """Restore what :meth:`state` wrote (on an instance that was never fitted)."""
        raise BitstreamError(f"delta.predictor={self.name} has no fitted state, but a section {self.section} was given")

    def for_shape(self, shape: tuple[int, int, int, int]) -> Predictor:
        """The predictor for a cache of ``shape`` ``(L, H, T, D)``."""
        raise NotImplementedError


class PreviousPredictor(DeltaPredictor):
    """``previous``: the same layer/head/channel at the previous token (CacheGen-style delta, arXiv 2310.07240)."""

    name = "previous"

    def for_shape(self, shape):
        return Temporal()


class _WeightedPredictor(DeltaPredictor):
    """A predictor with integer weights fitted by least squares: ``weight_bits`` each plus an int8 shift per output,
    the state charged to the decoder."""

    fitted = True

    def __init__(self, kind: str, weight_bits: int) -> None:
        super().__init__(kind)
        self.weight_bits = weight_bits
        self.weights: QuantizedWeights | None = None
        self._raw: bytes | None = None  # loaded state, parsed on first use (the bytes carry no shape)

    def _fit(self, calib: Sequence[torch.Tensor]) -> QuantizedWeights:
        raise NotImplementedError

    def _weight_shape(self, shape: tuple[int, int, int, int]) -> tuple[int, ...]:
        """Shape of the weights ``(..., n_in + 1, n_out)`` for a cache of ``shape``."""
        raise NotImplementedError

    def _predictor(self, weights: QuantizedWeights) -> Predictor:
        raise NotImplementedError

    def fit(self, calib):
        if not calib:
            raise ValueError(f"delta.predictor={self.name} is fitted on calibration sequences; none were given")
        self.weights, self._raw = self._fit(calib), None

    def state(self):
        if self.weights is not None:
            return self.weights.to_bytes()
        if self._raw is not None:  # loaded and not used yet: the bytes as they came
            return self._raw
        raise ValueError(f"delta.predictor={self.name} is not fitted: call fit(calibration) first")

    def load_state(self, raw):
        if not raw:
            raise BitstreamError(f"delta: state section {self.section} is empty")
        self.weights, self._raw = None, bytes(raw)

    def for_shape(self, shape):
        want = self._weight_shape(shape)
        if self.weights is None:
            if self._raw is None:
                raise ValueError(f"delta.predictor={self.name} is not fitted: call fit(calibration) first")
            what = f"delta: state section {self.section} (predictor={self.name} for a cache of shape {tuple(shape)})"
            self.weights, self._raw = QuantizedWeights.from_bytes(self._raw, want, self.weight_bits, what), None
        if tuple(self.weights.w.shape) != want:
            raise ValueError(f"delta: predictor fitted for another cache shape ({tuple(self.weights.w.shape)}) "
                             f"than {tuple(shape)}")
        return self._predictor(self.weights)


class LinearPredictor(_WeightedPredictor):
    """``linear``: an order-``order`` autoregression per (layer, head, channel) plus a bias (:class:`Temporal`)."""

    name = "linear"

    def __init__(self, kind: str, weight_bits: int, order: int) -> None:
        super().__init__(kind, weight_bits)
        self.order = order

    def _weight_shape(self, shape):
        L, H, _, D = shape
        return (L, H, D, self.order + 1, 1)

    def _predictor(self, weights):
        return Temporal(weights)

    def _fit(self, calib):
        """Least squares per (layer, head, channel) of x_t on x_{t-1..t-p} and 1 over the calibration caches.

        Weights are stored as ``(L, H, D, p+1, 1)``: one column per channel.
        """
        order = self.order
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
        return QuantizedWeights.from_real(W, self.weight_bits)


class CrossLayerPredictor(_WeightedPredictor):
    """``cross_layer``: layer l from layer l-1 at the same token through a linear map per layer
    (:class:`CrossLayer`); layer 0 falls back to ``previous``."""

    name = "cross_layer"

    def _weight_shape(self, shape):
        L, H, _, D = shape
        return (L - 1, H * D + 1, H * D)

    def _predictor(self, weights):
        return CrossLayer(weights)

    def _fit(self, calib):
        G = R = None
        for x in calib:
            L, H, T, D = x.shape
            flat = x.double().permute(0, 2, 1, 3).reshape(L, T, H * D)  # (L, T, H*D)
            Z = torch.cat([flat[:-1], torch.ones(L - 1, T, 1, dtype=torch.float64)], dim=-1)  # (L-1, T, H*D+1)
            g, r = Z.transpose(1, 2) @ Z, Z.transpose(1, 2) @ flat[1:]
            G, R = (g, r) if G is None else (G + g, R + r)
        return QuantizedWeights.from_real(_solve(G, R), self.weight_bits)


#: ``delta.predictor`` names
PREDICTORS = ("previous", "linear", "cross_layer")


def make_predictor(name: str, kind: str, *, order: int, weight_bits: int) -> DeltaPredictor:
    """The unfitted predictor ``name`` (one of :data:`PREDICTORS`) for ``kind`` (``k`` or ``v``)."""
    if name == "previous":
        return PreviousPredictor(kind)
    if name == "linear":
        return LinearPredictor(kind, weight_bits, order)
    if name == "cross_layer":
        return CrossLayerPredictor(kind, weight_bits)
    raise ValueError(f"delta.predictor={name!r} is not allowed; choose one of {list(PREDICTORS)}")
