"""Predictive delta coding of the KV cache: Layer 2 of "Sequential KV Cache Compression via Probabilistic Language
Tries" (arXiv 2604.15356), which proposes to store the residual between a prediction of the next KV and the true
KV instead of each vector on its own.

Every K/V element is coded as the residual from a prediction made only from what the decoder already holds, by
the closed-loop coder of :mod:`compressors.predictive.residual`: ``step=0`` codes every 16-bit value exactly (bit-exact by
construction), ``step>0`` quantizes the residual uniformly with that step (error at most ``step/2`` before the
reconstruction is rounded to the cache dtype).

``exact_coder=`` picks the exact coder. ``planes`` (default): the zigzag difference of each value's 16-bit pattern
from its prediction's, or the value itself where a channel is better coded without its prediction, through the
byte-plane coder of :mod:`compressors.exact.plane_coder`. ``laplace``: each value under a Laplace in value space centred on
its prediction, 16 binary decisions per value. On the SmolLM2 defaults ``previous`` codes at 13.35 bits/element
with ``planes`` (4 windows), encoding / decoding 35 / 43 MB of 16-bit KV per CPU-second (23 / 29 MB/s on the
shared 2-core machine at load average 5.7, ``scripts/bench_compressors.py``), against 13.39 with ``laplace`` at
1.7 / 2.0 MB/s. Fitted predictors gain more from the value-space model and pay for it in time (window 0:
``linear`` 13.33 with ``planes`` at ~14 MB per CPU-second vs 13.07, ``cross_layer`` 13.25 at ~20 vs 12.75).

Predictors (``predictor=``, see :mod:`compressors.predictive.delta_predictors`), predicting from the reconstructed cache:

- ``previous``: the same layer/head/channel at the previous token (CacheGen-style delta, arXiv 2310.07240).
- ``linear``: an order-``order`` autoregression per (layer, head, channel) and K/V, fitted by least squares on the
  calibration split; its integer weights (``weight_bits`` each, plus an int8 shift per output) are codec state.
- ``cross_layer``: all of layer l-1's heads at the same token, through a linear map per layer and K/V fitted
  likewise (codec state likewise). Layer 0 falls back to ``previous``.

Predicting from a cheaper copy of the model is :mod:`compressors.predictive.speculative` (``+compressor=speculative``).

``bits=`` replaces the fixed step by one step per channel, ``2e * s * 2**-bits`` with ``s`` the channel's mean
absolute residual on the calibration split (the high-rate Laplace rule for about ``bits`` bits per element); those
steps, float16, are codec state too.

Codec state (:meth:`Delta.state`): ``k.weights`` and ``v.weights`` (fitted predictors) and ``k.steps`` and
``v.steps`` (``bits=``). The bytes carry no shape: a decoder parses them against its context's cache shape.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from compressors.predictive.delta_predictors import PREDICTORS, Predictor, make_predictor
from compressors.predictive.residual import EXACT_CODERS, KINDS, ResidualCoder
from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.coding.packing import tensor_from_bytes, tensor_to_bytes
from kvbench.core.checks import check_choice, check_range
from kvbench.core.compressor import Compressor, Section
from kvbench.core.kv import Context, KVSequence

#: smallest per-channel step from ``bits=`` (float16's smallest normal number)
MIN_STEP = 2.0**-14
MOVED_MODEL_PREDICTOR = ("delta.predictor=model is now its own compressor: use +compressor=speculative "
                         "(fields predictor_dtype, token_coding, step)")


@dataclass
class Delta(Compressor):
    """Predictive delta coding (arXiv 2604.15356, Layer 2); ``previous`` is CacheGen's delta (arXiv 2310.07240)."""

    predictor: str = "previous"
    order: int = 2
    step: float = 0.0
    bits: float | None = None
    weight_bits: int = 8
    exact_coder: str = "planes"

    name = "delta"
    family = "predictive"
    max_rel_mse = 0.0  # step 0: bit-exact
    # none chosen on dev: the predictor is the method itself (CacheGen's previous, the paper's linear), a variant of
    # its own rather than a setting; the fitted state is the predictors' weights and the steps that bits sets
    tuned = ()

    def __post_init__(self) -> None:
        if self.predictor == "model":
            raise ValueError(MOVED_MODEL_PREDICTOR)
        check_choice("delta", "predictor", self.predictor, PREDICTORS)
        check_range("delta", "order", self.order, 1, 16, integer=True)
        check_range("delta", "step", self.step, 0.0, 1e4)
        check_range("delta", "weight_bits", self.weight_bits, 4, 16, integer=True)
        check_choice("delta", "exact_coder", self.exact_coder, EXACT_CODERS)
        if self.bits is not None:
            check_range("delta", "bits", self.bits, 0.25, 12.0)
            if self.step != 0:
                raise ValueError(f"delta: set step={self.step} or bits={self.bits}, not both (bits chooses a step per channel)")
        self.order, self.weight_bits, self.step = int(self.order), int(self.weight_bits), float(self.step)
        self._predictors = self._new_predictors()
        self._steps: dict[str, torch.Tensor] = {}  # (L, H, D) float16 per kind, fitted or parsed
        self._step_bytes: dict[str, bytes] = {}  # loaded, parsed against the first cache shape
        self._coder = ResidualCoder("delta", exact=self.exact_coder)
        self._stats: Counter = Counter()

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        return self.step == 0 and self.bits is None

    def _new_predictors(self) -> dict[str, Predictor]:
        return {kind: make_predictor(self.predictor, kind, order=self.order, weight_bits=self.weight_bits)
                for kind in KINDS}

    # ---- fitting and codec state -------------------------------------------------------------------------------

    def fit(self, calib, config: Any = None) -> None:
        self._stats = Counter()
        self._predictors, self._steps, self._step_bytes = self._new_predictors(), {}, {}
        for kind in KINDS:
            self._predictors[kind].fit([getattr(s, kind) for s in calib])
        if self.bits is not None:
            if not calib:
                raise ValueError("delta.bits chooses steps on calibration sequences; none were given")
            for kind in KINDS:
                self._steps[kind] = self._fit_steps([getattr(s, kind) for s in calib], self._predictor(kind, calib[0].shape))

    def _fit_steps(self, xs: list[torch.Tensor], pred: Predictor) -> torch.Tensor:
        """One step per channel ``(L, H, D)`` float16 (what the decoder holds) from the open-loop residuals."""
        sums = counts = 0
        for x in xs:
            steady = pred.warm_group(x.shape) < 0  # (L, H, T, D)
            sums = sums + ((x.double() - pred.predict_all(x)).abs() * steady).sum(2)
            counts = counts + steady.sum(2)
        s_c = sums / counts.clamp_min(1)  # (L, H, D) mean |open-loop residual|
        return (2 * math.e * s_c * 2.0 ** -self.bits).clamp_min(MIN_STEP).to(torch.float16)

    def _state_sections(self) -> list[str]:
        """The state sections this config's decoder needs, in order."""
        names = [p.section for p in self._predictors.values() if p.fitted]
        return names + ([f"{kind}.steps" for kind in KINDS] if self.bits is not None else [])

    def state(self) -> dict[str, Section]:
        """Fitted predictor weights (``weight_bits`` each plus an int8 shift per output) and per-channel steps."""
        out: dict[str, Section] = {p.section: p.state() for p in self._predictors.values() if p.fitted}
        if self.bits is not None:
            for kind in KINDS:
                if kind in self._steps:
                    out[f"{kind}.steps"] = tensor_to_bytes(self._steps[kind])
                elif kind in self._step_bytes:
                    out[f"{kind}.steps"] = self._step_bytes[kind]
                else:
                    raise ValueError("delta.bits is set but no steps were fitted: call fit(calibration) first")
        return out

    def load_state(self, sections: Mapping[str, bytes]) -> None:
        want = self._state_sections()
        missing, extra = sorted(set(want) - set(sections)), sorted(set(sections) - set(want))
        if missing or extra:
            raise BitstreamError(f"delta (predictor={self.predictor}, bits={self.bits}) takes the state sections "
                                 f"{want}; missing {missing}, unexpected {extra}")
        self._predictors, self._steps, self._step_bytes = self._new_predictors(), {}, {}
        for p in self._predictors.values():
            if p.fitted:
                p.load_state(bytes(sections[p.section]))
        if self.bits is not None:
            for kind in KINDS:
                raw = bytes(sections[f"{kind}.steps"])
                if not raw or len(raw) % 2:
                    raise BitstreamError(f"delta: state section {kind}.steps holds {len(raw)} bytes, not a whole "
                                         "number of float16 steps")
                self._step_bytes[kind] = raw

    def stats(self) -> dict:
        """Model-estimated sizes (sum of -log2 p of every coded symbol), summed over sequences."""
        return dict(self._stats)

    # ---- predictors and steps -------------------------------------------------------------------------------------

    def _predictor(self, kind: str, shape) -> Predictor:
        return self._predictors[kind].ready_for(shape)

    def _step(self, kind: str, shape) -> torch.Tensor:
        """Step per element, broadcastable to ``(L, H, T, D)``, float64."""
        if self.bits is None:
            return torch.tensor(self.step, dtype=torch.float64)
        L, H, _, D = shape
        if kind not in self._steps and kind in self._step_bytes:
            raw = self._step_bytes[kind]
            if len(raw) != 2 * L * H * D:
                raise BitstreamError(f"delta: state section {kind}.steps holds {len(raw)} bytes, not the "
                                     f"{2 * L * H * D} of one float16 step per channel of a {(L, H, D)} cache")
            steps = tensor_from_bytes(raw, torch.float16, (L, H, D))
            if not bool((torch.isfinite(steps) & (steps > 0)).all()):
                raise BitstreamError(f"delta: state section {kind}.steps is malformed: steps must be finite and > 0")
            self._steps[kind] = steps
            del self._step_bytes[kind]
        steps = self._steps.get(kind)
        if steps is None:
            raise ValueError("delta.bits is set but no steps were fitted: call fit(calibration) first")
        if tuple(steps.shape) != (L, H, D):
            raise ValueError(f"delta: steps fitted for a cache of {tuple(steps.shape)} channels, not {(L, H, D)}")
        return steps.double().unsqueeze(2)

    def _steps_for(self, shape) -> dict[str, torch.Tensor] | None:
        return None if self.lossless else {kind: self._step(kind, shape) for kind in KINDS}

    # ---- encode / decode ---------------------------------------------------------------------------------------

    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream:
        preds = {kind: self._predictor(kind, kv.shape) for kind in KINDS}
        coded = self._coder.encode(kv, preds, self._steps_for(kv.shape))
        for kind, bits in coded.ideal_bits.items():
            self._stats[f"ideal_bits.{kind}.residual"] += bits
        return Bitstream.pack(self.name, coded.sections)

    def decode(self, bs: Bitstream, ctx: Context) -> KVSequence:
        sec = bs.sections(expect=self.name)
        preds = {kind: self._predictor(kind, ctx.shape) for kind in KINDS}
        out = self._coder.decode(sec, preds, ctx.shape, ctx.dtype, self._steps_for(ctx.shape))
        return KVSequence(out["k"], out["v"])
