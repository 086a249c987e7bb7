"""Predictors for :mod:`compressors.predictive.delta` and :mod:`compressors.predictive.speculative`: what the decoder
can guess of each KV vector before reading it.

One hierarchy: every predictor is a :class:`Predictor`, one class per predictor (:class:`Previous`, :class:`Linear`,
:class:`CrossLayer` as ``delta`` chooses them by name, :func:`make_predictor`; :class:`FromModel` for
``speculative``). A predictor walks the cache of one kind (K or V), ``(L, H, T, D)``, in *units*: groups of elements
the decoder reconstructs together, each predicted only from units already reconstructed. ``groups`` lays any
``(L, H, T, D)`` tensor out as those units, ``predict`` gives one unit's prediction from the reconstruction so far,
and ``predict_all`` gives every unit's prediction from a complete cache at once (valid when the reconstruction is
exact, i.e. lossless coding, where closed loop and open loop coincide).

A fitted predictor (``fitted``: ``linear``, ``cross_layer``) learns on calibration caches (``fit``), hands its
fitted state out as bytes (what the decoder is charged for) and loads those bytes back on a decoder that never saw
the calibration. The bytes carry no shape (the decoder's context has it), so loaded state is parsed, and its length
checked, against the first cache shape the predictor is made ready for (``ready_for``).

Fitted predictors hold integer weights with a power-of-two scale per output and evaluate on inputs in fixed point
(``x * 2**24``, exact for float16), so every prediction is an exact integer sum: the same bits whether the encoder
computes all tokens in one batch or the decoder one token at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from compressors.predictive import fit_numerics
from compressors.predictive.integer_weights import FRACTION_BITS, QuantizedWeights, exact_matmul, fixed_point, solve
from kvbench.coding.bitstream import BitstreamError


class Predictor:
    """Base of every predictor: its units, one prediction per unit, the batched open-loop predictions, and (for a
    fitted predictor) its fitting and state. ``kind`` (``k`` or ``v``) names the state section and errors."""

    #: ``delta.predictor`` name (empty for a predictor ``delta`` does not choose)
    name: ClassVar[str] = ""
    #: True when :meth:`fit` learns state the decoder needs (one state section per kind)
    fitted: ClassVar[bool] = False
    #: True when every prediction is a copy of the same element at an earlier token (or 0): predictions of a
    #: reconstruction on a grid ``step * Z`` then stay on it, so the quantized closed loop is plain rounding
    copies_previous_token: ClassVar[bool] = False

    def __init__(self, kind: str = "") -> None:
        self.kind = kind

    # ---- fitting and state: nothing to learn by default

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

    def ready_for(self, shape: tuple[int, int, int, int]) -> Predictor:
        """This predictor, ready to predict a cache of ``shape`` ``(L, H, T, D)``."""
        return self

    # ---- units and predictions

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


class _Weighted(Predictor):
    """A predictor with integer weights fitted by least squares: ``weight_bits`` each plus an int8 shift per output,
    the state charged to the decoder. A subclass says how its weights are fitted and shaped."""

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

    def ready_for(self, shape):
        want = self._weight_shape(shape)
        if self.weights is None:
            if self._raw is None:
                raise ValueError(f"delta.predictor={self.name} is not fitted: call fit(calibration) first")
            what = f"delta: state section {self.section} (predictor={self.name} for a cache of shape {tuple(shape)})"
            self.weights, self._raw = QuantizedWeights.from_bytes(self._raw, want, self.weight_bits, what), None
        if tuple(self.weights.w.shape) != want:
            raise ValueError(f"delta: predictor fitted for another cache shape ({tuple(self.weights.w.shape)}) "
                             f"than {tuple(shape)}")
        return self


def _token_units(t: torch.Tensor) -> list[torch.Tensor]:
    """Tokens in order: one unit per token, ``(T, L*H*D)``."""
    L, H, T, D = t.shape
    return [t.permute(2, 0, 1, 3).reshape(T, L * H * D)]


def _token_zero_warm(shape: tuple[int, int, int, int]) -> torch.Tensor:
    """Token 0 has no prediction: one warm-up scale per layer."""
    L = shape[0]
    g = torch.full(shape, -1, dtype=torch.int64)
    g[:, :, 0] = torch.arange(L).view(L, 1, 1)
    return g


class Previous(Predictor):
    """``previous``: the same layer/head/channel at the previous token (CacheGen-style delta, arXiv 2310.07240).
    Token 0 has no prediction."""

    name = "previous"
    copies_previous_token = True

    def groups(self, t):
        return _token_units(t)

    def predict(self, recon, g, c):
        if c == 0:
            return torch.zeros(recon[:, :, 0].numel(), dtype=torch.float64)
        return recon[:, :, c - 1].double().reshape(-1)

    def predict_all(self, x):
        mu = torch.zeros(x.shape, dtype=torch.float64)
        if x.shape[2] > 1:
            mu[:, :, 1:] = x[:, :, :-1].double()
        return mu

    def warm_group(self, shape):
        return _token_zero_warm(shape)


class Linear(_Weighted):
    """``linear``: an order-``order`` autoregression per (layer, head, channel) plus a bias, tokens in order; tokens
    1..p-1 fall back to ``previous``. Token 0 has no prediction."""

    name = "linear"

    def __init__(self, kind: str, weight_bits: int, order: int) -> None:
        super().__init__(kind, weight_bits)
        self.order = order

    def _weight_shape(self, shape):
        L, H, _, D = shape
        return (L, H, D, self.order + 1, 1)

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
            Zt = Z.permute(0, 1, 3, 4, 2)  # (L, H, D, p+1, T-p)
            g = fit_numerics.gemm(Zt, Zt.transpose(-1, -2))  # (L, H, D, p+1, p+1)
            r = fit_numerics.gemm(Zt, y.permute(0, 1, 3, 2).unsqueeze(-1))[..., 0]  # (L, H, D, p+1)
            G, R = (g, r) if G is None else (G + g, R + r)
        if G is None:
            raise ValueError(f"delta: calibration sequences are too short for order={order}")
        W = solve(G, R.unsqueeze(-1))  # (L, H, D, p+1, 1)
        return QuantizedWeights.from_real(W, self.weight_bits)

    def groups(self, t):
        return _token_units(t)

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
        if t < self.order:
            return recon[:, :, t - 1].double().reshape(-1)
        return self._ar([recon[:, :, t - 1 - j] for j in range(self.order)]).reshape(-1)

    def predict_all(self, x):
        mu = torch.zeros(x.shape, dtype=torch.float64)
        T, p = x.shape[2], self.order
        if T > 1:
            mu[:, :, 1:] = x[:, :, :-1].double()
        if T > p:
            mu[:, :, p:] = self._ar([x[:, :, p - 1 - j : T - 1 - j] for j in range(p)])
        return mu

    def warm_group(self, shape):
        return _token_zero_warm(shape)


class CrossLayer(_Weighted):
    """``cross_layer``: layer l from the reconstructed layer l-1 at the same token, through a linear map of all of
    layer l-1's heads (H*D inputs plus a bias) to all of layer l's, per layer, fitted by least squares. Layer 0 has
    no layer below; it falls back to ``previous`` (token by token)."""

    name = "cross_layer"

    def _weight_shape(self, shape):
        L, H, _, D = shape
        return (L - 1, H * D + 1, H * D)

    def _fit(self, calib):
        G = R = None
        for x in calib:
            L, H, T, D = x.shape
            flat = x.double().permute(0, 2, 1, 3).reshape(L, T, H * D)  # (L, T, H*D)
            Z = torch.cat([flat[:-1], torch.ones(L - 1, T, 1, dtype=torch.float64)], dim=-1)  # (L-1, T, H*D+1)
            g, r = fit_numerics.gemm(Z.transpose(1, 2), Z), fit_numerics.gemm(Z.transpose(1, 2), flat[1:])
            G, R = (g, r) if G is None else (G + g, R + r)
        return QuantizedWeights.from_real(solve(G, R), self.weight_bits)

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
    """A fixed prediction of the whole cache (a cheaper model's recomputed KV, :mod:`compressors.predictive.speculative`);
    nothing depends on the reconstruction."""

    def __init__(self, mu: torch.Tensor, kind: str = "") -> None:
        super().__init__(kind)
        self.mu = mu.double()  # (L, H, T, D)

    def groups(self, t):
        return [t.reshape(1, -1)]

    def predict(self, recon, g, c):
        return self.mu.reshape(-1)

    def predict_all(self, x):
        return self.mu

    def warm_group(self, shape):
        return torch.full(shape, -1, dtype=torch.int64)


#: ``delta.predictor`` names
PREDICTORS = ("previous", "linear", "cross_layer")


def make_predictor(name: str, kind: str, *, order: int, weight_bits: int) -> Predictor:
    """The unfitted predictor ``name`` (one of :data:`PREDICTORS`) for ``kind`` (``k`` or ``v``)."""
    if name == "previous":
        return Previous(kind)
    if name == "linear":
        return Linear(kind, weight_bits, order)
    if name == "cross_layer":
        return CrossLayer(kind, weight_bits)
    raise ValueError(f"delta.predictor={name!r} is not allowed; choose one of {list(PREDICTORS)}")
