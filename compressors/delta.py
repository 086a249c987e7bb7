"""Predictive delta coding of the KV cache: Layer 2 of "Sequential KV Cache Compression via Probabilistic Language
Tries" (arXiv 2604.15356), which proposes to store the residual between a prediction of the next KV and the true
KV instead of each vector on its own.

Every K/V element is coded as the residual from a prediction made only from what the decoder already holds. The
loop is closed: predictions come from the *reconstructed* cache, so quantization errors never accumulate.

Predictors (``predictor=``, see :mod:`compressors.delta_predictors`):

- ``previous``: the same layer/head/channel at the previous token (CacheGen-style delta, arXiv 2310.07240).
- ``linear``: an order-``order`` autoregression per (layer, head, channel) and K/V, fitted by least squares on the
  calibration split; its integer weights (``weight_bits`` each) are side information, charged once per run.
- ``cross_layer``: all of layer l-1's heads at the same token, through a linear map per layer and K/V fitted
  likewise (charged likewise). Layer 0 falls back to ``previous``.
- ``model``: a cheaper copy of the model (``predictor_dtype``: weights rounded to bf16 or int8 with float32
  activations, or the whole copy run in bf16) recomputes the KV from the token ids by one prefill. The ids are
  then part of the stream: by default (``token_coding=model``) they are range-coded under the cheap copy's own
  next-token distribution by :class:`compressors.recompute.Recompute` (its bitstream is embedded whole, as the
  section ``tokens``), which costs a one-token-at-a-time pass of the copy on both sides; ``token_coding=plain``
  stores them at ceil(log2 V) bits each, and decoding is then one prefill. This is "speculative KV coding", the
  strongest form of the paper's Layer 2. Encoder and decoder must compute the same prediction to the bit, so
  the stream carries a CRC-32 of the reconstruction and a decoder that rounds differently fails loudly.

Residual coding:

- ``step=0`` (lossless): each 16-bit value is coded exactly under a Laplace in value space centred on its
  prediction (:mod:`kvbench.float_coding`), with one scale per (layer, head, channel) and K/V fitted on the
  sequence and stored in the stream. Bit-exact by construction.
- ``step>0`` (lossy): the residual is uniformly quantized with that step and the integer symbols are range-coded
  under a quantized Laplace with a scale per (layer, head, channel) and K/V (:mod:`kvbench.entropy`). The error of
  every element is at most ``step/2`` before the reconstruction is rounded to the cache dtype. ``bits=`` replaces
  the fixed step by one step per channel, ``2e * s * 2**-bits`` with ``s`` the channel's mean absolute residual on
  the calibration split (the high-rate Laplace rule for about ``bits`` bits per element); those steps are side
  information.

Scales are 8-bit log codes (1/8 octave), range-coded around their median. Values with nothing to predict from
(token 0; layer 0's token 0 for ``cross_layer``) are coded against 0 with their own scale per layer.

The decoder's order is the predictor's unit order (tokens for ``previous``/``linear``, layer 0's tokens then
whole layers for ``cross_layer``, everything at once for ``model``). For ``previous`` with a step the closed loop
needs no loop: predictions then lie on the grid ``step * Z``, so the reconstruction is ``step * round(x / step)``
and the symbols are differences of consecutive grid indices, decoded by a cumulative sum. ``linear`` and
``cross_layer`` with a step, and every lossless decode except ``model``'s, loop over units (T steps over
``(L, H, D)`` tensors, or L layers).
"""

from __future__ import annotations

import copy
import math
import struct
import zlib
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from compressors.delta_predictors import CrossLayer, FromModel, Predictor, QuantizedWeights, Temporal
from kvbench.bitstream import Bitstream, BitstreamError
from kvbench.checks import check_choice, check_range
from kvbench.compressor import Compressor
from kvbench.entropy import StreamDecoder, StreamEncoder
from kvbench.float_coding import decode_values, encode_values
from kvbench.kv import Context, KVSequence
from kvbench.packing import tensor_to_bytes
from kvbench.timing import Stopwatch

PREDICTORS = ("previous", "linear", "cross_layer", "model")
PREDICTOR_DTYPES = ("bf16", "int8", "bf16_compute")
TOKEN_CODINGS = ("model", "plain")
KINDS = ("k", "v")
#: log2-scale codes: scale = 2**((code - offset) / 8); value-space scales (lossless) and symbol scales (lossy)
VALUE_SCALE_OFFSET, SYMBOL_SCALE_OFFSET = 184, 96
#: smallest per-channel step from ``bits=`` (float16's smallest normal number)
MIN_STEP = 2.0**-14
#: constriction's leaky quantizer gives every symbol of the coder's range at least this probability (24-bit
#: precision), so an outlier costs about 24 bits, not -log2 of the Laplace tail
LEAK = 2.0**-24


def ideal_bits_leaky_laplace(symbols: np.ndarray, scales: np.ndarray) -> float:
    """The coder's model estimate, sum of -log2 p, for the quantized Laplace *as the coder uses it*: the scale floor
    of :mod:`kvbench.entropy` and the leaky quantizer's probability floor (``entropy.ideal_bits_laplace`` has no
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


def _decode_codes(raw: bytes, n: int) -> np.ndarray:
    if len(raw) < 2:
        raise BitstreamError("delta: scale section is truncated")
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


def _crc(*tensors: torch.Tensor) -> bytes:
    crc = 0
    for t in tensors:
        crc = zlib.crc32(tensor_to_bytes(t), crc)
    return crc.to_bytes(4, "big")


def _id_bits(model: Any) -> int:
    return max(1, math.ceil(math.log2(int(model.config.get_text_config(decoder=True).vocab_size))))


def _plain_tokens(tokens: torch.Tensor, model: Any) -> tuple[bytes, int]:
    """Token ids at a fixed ceil(log2 V) bits each, little-endian bit packing."""
    nb = _id_bits(model)
    ids = tokens.reshape(-1).to(torch.int64).numpy()
    bits = ((ids[:, None] >> np.arange(nb)) & 1).astype(np.uint8).reshape(-1)  # (T * nb,)
    return np.packbits(bits, bitorder="little").tobytes(), int(bits.size)


def _plain_tokens_from(raw: bytes, n: int, model: Any) -> torch.Tensor:
    nb = _id_bits(model)
    if len(raw) != -(-n * nb // 8):
        raise BitstreamError(f"delta: token section holds {len(raw)} bytes, not {n} ids of {nb} bits")
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")[: n * nb].reshape(n, nb)
    return torch.from_numpy((bits.astype(np.int64) << np.arange(nb)).sum(1))


def make_cheap_copy(model: Any, predictor_dtype: str) -> Any:
    """The predictor model: a copy of ``model`` with rounded weights (``bf16``: to bfloat16; ``int8``: symmetric
    int8 per output row of every matrix, norms and biases kept) computing in float32, or (``bf16_compute``) the
    whole copy cast to bfloat16, activations included, which is what makes it cheaper to run."""
    cheap = copy.deepcopy(model).eval()
    if predictor_dtype == "bf16_compute":
        return cheap.to(torch.bfloat16)
    with torch.no_grad():
        for p in cheap.parameters():  # tied matrices appear once
            if predictor_dtype == "bf16":
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
            elif p.dim() == 2:
                s = p.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127
                p.copy_(torch.round(p / s).clamp(-127, 127) * s)
    return cheap


@dataclass
class Delta(Compressor):
    """Predictive delta coding (arXiv 2604.15356, Layer 2); ``previous`` is CacheGen's delta (arXiv 2310.07240)."""

    predictor: str = "previous"
    order: int = 2
    step: float = 0.0
    bits: float | None = None
    weight_bits: int = 8
    predictor_dtype: str = "bf16"
    token_coding: str = "model"

    name = "delta"

    def __post_init__(self) -> None:
        check_choice("delta", "predictor", self.predictor, PREDICTORS)
        check_range("delta", "order", self.order, 1, 16, integer=True)
        check_range("delta", "step", self.step, 0.0, 1e4)
        check_range("delta", "weight_bits", self.weight_bits, 4, 16, integer=True)
        check_choice("delta", "predictor_dtype", self.predictor_dtype, PREDICTOR_DTYPES)
        check_choice("delta", "token_coding", self.token_coding, TOKEN_CODINGS)
        if self.bits is not None:
            check_range("delta", "bits", self.bits, 0.25, 12.0)
            if self.step != 0:
                raise ValueError(f"delta: set step={self.step} or bits={self.bits}, not both (bits chooses a step per channel)")
            if self.predictor == "model":
                raise ValueError("delta.bits is not available with predictor=model (its residual needs the model, "
                                 "which calibration does not have); use step= instead")
        self.order, self.weight_bits, self.step = int(self.order), int(self.weight_bits), float(self.step)
        self._weights: dict[str, QuantizedWeights] = {}
        self._steps: dict[str, torch.Tensor] = {}
        self._stats: Counter = Counter()
        self._cheap: tuple[int, Any] | None = None
        self._recompute: Any = None

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        return self.step == 0 and self.bits is None

    @property
    def needs_model(self) -> bool:  # type: ignore[override]
        return self.predictor == "model"

    # ---- fitting and side information -------------------------------------------------------------------------

    def fit(self, calib) -> None:
        self._stats = Counter()
        self._weights, self._steps = {}, {}
        if self.predictor in ("linear", "cross_layer"):
            if not calib:
                raise ValueError(f"delta.predictor={self.predictor} is fitted on calibration sequences; none were given")
            for kind in KINDS:
                xs = [getattr(s, kind) for s in calib]
                self._weights[kind] = (Temporal.fit(xs, self.order, self.weight_bits) if self.predictor == "linear"
                                       else CrossLayer.fit(xs, self.weight_bits))
        if self.bits is not None:
            if not calib:
                raise ValueError("delta.bits chooses steps on calibration sequences; none were given")
            for kind in KINDS:
                pred = self._predictor(kind, calib[0].shape)
                sums = counts = 0
                for s in calib:
                    x = getattr(s, kind)
                    steady = pred.warm_group(x.shape) < 0
                    sums = sums + ((x.double() - pred.predict_all(x)).abs() * steady).sum(2)
                    counts = counts + steady.sum(2)
                s_c = sums / counts.clamp_min(1)  # (L, H, D) mean |open-loop residual|
                step = (2 * math.e * s_c * 2.0 ** -self.bits).clamp_min(MIN_STEP)
                self._steps[kind] = step.to(torch.float16)  # stored as float16: what the decoder holds

    def _side_info(self) -> list[tuple[bytes, int]]:
        parts = [self._weights[k].to_bytes() for k in KINDS if k in self._weights]
        for k in KINDS:
            if k in self._steps:
                raw = tensor_to_bytes(self._steps[k])
                parts.append((raw, 8 * len(raw)))
        return parts

    def side_info_bits(self) -> int:
        """Fitted predictor weights (``weight_bits`` each plus an int8 shift per output) and per-channel steps."""
        return int(sum(n for _, n in self._side_info()))

    def stats(self) -> dict:
        """Model-estimated sizes (sum of -log2 p of every coded symbol) and time per stage, summed over sequences."""
        out = dict(self._stats)
        if self._recompute is not None:
            out.update({f"tokens.{k}": v for k, v in self._recompute.stats().items()})
        return out

    # ---- predictors --------------------------------------------------------------------------------------------

    def _predictor(self, kind: str, shape, mu: torch.Tensor | None = None) -> Predictor:
        if self.predictor == "previous":
            return Temporal()
        if self.predictor == "model":
            return FromModel(mu)
        if kind not in self._weights:
            raise ValueError(f"delta.predictor={self.predictor} is not fitted: call fit(calibration) first")
        q = self._weights[kind]
        L, H, _, D = shape
        want = (L, H, D) if self.predictor == "linear" else (L - 1, H * D + 1)
        if tuple(q.w.shape[: len(want)]) != want:
            raise ValueError(f"delta: predictor fitted for another cache shape ({tuple(q.w.shape)}) than {tuple(shape)}")
        return Temporal(q) if self.predictor == "linear" else CrossLayer(q)

    def _step(self, kind: str, shape) -> torch.Tensor:
        """Step per element, broadcastable to ``(L, H, T, D)``, float64."""
        if self.bits is None:
            return torch.tensor(self.step, dtype=torch.float64)
        steps = self._steps.get(kind)
        if steps is None:
            raise ValueError("delta.bits is set but no steps were fitted: call fit(calibration) first")
        L, H, _, D = shape
        if tuple(steps.shape) != (L, H, D):
            raise ValueError(f"delta: steps fitted for a cache of {tuple(steps.shape)} channels, not {(L, H, D)}")
        return steps.double().unsqueeze(2)

    def _cheap_model(self, ctx: Context) -> Any:
        if ctx.model is None:
            raise ValueError("delta.predictor=model needs the model in the context (needs_model=True)")
        model = ctx.model.model
        if self._cheap is None or self._cheap[0] != id(model):
            watch = Stopwatch(str(next(model.parameters()).device))
            with watch():
                self._cheap = (id(model), make_cheap_copy(model, self.predictor_dtype))
            self._stats["predictor_setup_s"] += watch.seconds
        if self._recompute is None:
            from compressors.recompute import Recompute

            self._recompute = Recompute()
        return self._cheap[1]

    def _inner_ctx(self, ctx: Context) -> Context:
        """The token coder's context: the cheap copy as its model, float32 KV out (the prediction)."""
        return Context(ctx.n_layers, ctx.n_heads, ctx.n_tokens, ctx.head_dim, torch.float32,
                       SimpleNamespace(model=self._cheap_model(ctx)))

    # ---- encode / decode ---------------------------------------------------------------------------------------

    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream:
        from kvbench.capture import capture_window

        sections: dict[str, Any] = {}
        mus: dict[str, torch.Tensor] = {}
        if self.predictor == "model":
            if kv.tokens is None:
                raise ValueError("delta.predictor=model needs the token ids the cache was computed from")
            inner = self._inner_ctx(ctx)
            cheap = inner.model.model
            watch = Stopwatch(str(next(cheap.parameters()).device))
            with watch():
                if self.token_coding == "model":
                    sections["tokens"] = self._recompute.encode(kv, inner).data
                else:
                    sections["tokens"] = _plain_tokens(kv.tokens, cheap)
                got = capture_window(cheap, kv.tokens, kv.n_tokens, torch.float32)
            self._stats["encode_model_s"] += watch.seconds
            mus = {"k": got["k"], "v": got["v"]}
        codes, streams, bounds, recons = [], {}, [], []
        for kind in KINDS:
            x = getattr(kv, kind)
            pred = self._predictor(kind, x.shape, mus.get(kind))
            if self.lossless:
                c, streams[kind], ideal = self._encode_exact(x, pred)
                recons.append(x)
            else:
                c, streams[kind], ideal, lo_hi, recon = self._encode_quantized(x, pred, self._step(kind, x.shape))
                bounds += lo_hi
                recons.append(recon)
            codes.append(c)
            self._stats[f"ideal_bits.{kind}.residual"] += ideal
        sections["scales"] = _encode_codes(np.concatenate(codes))
        if bounds:
            sections["bounds"] = struct.pack("<4i", *bounds)
        sections["k.residual"], sections["v.residual"] = streams["k"], streams["v"]
        if self.predictor == "model":
            # the prediction is a float computation on the decoder's side: a decoder whose kernels round
            # differently must fail loudly, not return another cache
            sections["crc"] = _crc(*recons)
        return Bitstream.pack(self.name, sections)

    def decode(self, bs: Bitstream, ctx: Context) -> KVSequence:
        sec = bs.sections(expect=self.name)
        shape = ctx.shape
        mus: dict[str, torch.Tensor] = {}
        tokens = None
        if self.predictor == "model":
            from kvbench.capture import capture_window

            inner = self._inner_ctx(ctx)
            cheap = inner.model.model
            watch = Stopwatch(str(next(cheap.parameters()).device))
            with watch():
                if self.token_coding == "model":
                    pred_kv = self._recompute.decode(Bitstream.from_bytes(sec["tokens"]), inner)
                    mus, tokens = {"k": pred_kv.k, "v": pred_kv.v}, pred_kv.tokens
                else:
                    tokens = _plain_tokens_from(sec["tokens"], ctx.n_tokens, cheap)
                    got = capture_window(cheap, tokens, ctx.n_tokens, torch.float32)
                    mus = {"k": got["k"], "v": got["v"]}
            self._stats["decode_model_s"] += watch.seconds
        preds = {kind: self._predictor(kind, shape, mus.get(kind)) for kind in KINDS}
        L, H, _, D = shape
        sizes = [L * H * D + p.n_warm(shape) for p in preds.values()]
        codes = torch.from_numpy(_decode_codes(sec["scales"], sum(sizes)))
        code_k, code_v = codes[: sizes[0]], codes[sizes[0] :]
        bounds = struct.unpack("<4i", sec["bounds"]) if not self.lossless else (0, 0, 0, 0)
        out = {}
        mismatch = ("delta: the decoded cache fails its checksum: the predictor model computed other KV than on "
                    "the encoder's side (another device, kernel or thread count?)")
        for i, (kind, c) in enumerate(zip(KINDS, (code_k, code_v))):
            pred = preds[kind]
            try:
                if self.lossless:
                    out[kind] = self._decode_exact(sec[f"{kind}.residual"], c, pred, shape, ctx.dtype)
                else:
                    out[kind] = self._decode_quantized(sec[f"{kind}.residual"], c, pred, shape, ctx.dtype,
                                                       self._step(kind, shape), bounds[2 * i : 2 * i + 2])
            except AssertionError as e:  # constriction: the stream is invalid under the decoder's model
                raise BitstreamError(mismatch if self.predictor == "model" else f"delta: {e}") from e
        if self.predictor == "model" and _crc(out["k"], out["v"]) != sec["crc"]:
            raise BitstreamError(mismatch)
        return KVSequence(out["k"], out["v"], tokens)

    # ---- lossless: exact values under a value-space Laplace ---------------------------------------------------

    def _scales(self, resid: torch.Tensor, pred: Predictor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes ``(L*H*D + n_warm,)`` of the per-channel and warm-up scales (mean |residual|) and the per-element
        scale ``(L, H, T, D)`` the decoder will rebuild from them."""
        group = pred.warm_group(resid.shape)
        n_warm = pred.n_warm(resid.shape)
        c_steady = scale_codes(_channel_mean(resid, group < 0), offset)  # (L, H, D)
        c_warm = scale_codes(_group_mean(resid, group, n_warm), offset)  # (n_warm,)
        codes = torch.cat([c_steady.reshape(-1), c_warm])
        return codes, self._element_scales(codes, pred, resid.shape, offset)

    @staticmethod
    def _element_scales(codes: torch.Tensor, pred: Predictor, shape, offset: int) -> torch.Tensor:
        L, H, _, D = shape
        s = scales_from_codes(codes, offset)
        return _broadcast_scales(s[: L * H * D].reshape(L, H, D), s[L * H * D :], pred.warm_group(shape))

    def _encode_exact(self, x: torch.Tensor, pred: Predictor):
        mu = pred.predict_all(x)  # (L, H, T, D) float64; open loop == closed loop when nothing is lost
        codes, b = self._scales((x.double() - mu).abs(), pred, VALUE_SCALE_OFFSET)
        enc, ideal = StreamEncoder(), 0.0
        for xg, mg, bg in zip(pred.groups(x), pred.groups(mu), pred.groups(b)):
            ideal += encode_values(enc, xg, mg.numpy(), bg.numpy())
        return codes.numpy(), enc.finish(), ideal

    def _decode_exact(self, raw: bytes, codes: torch.Tensor, pred: Predictor, shape, dtype) -> torch.Tensor:
        b = self._element_scales(codes, pred, shape, VALUE_SCALE_OFFSET)
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
        if isinstance(pred, Temporal) and pred.weights is None:
            # previous: predictions stay on the grid step*Z, so the closed loop is plain rounding to the grid
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
        codes, b = self._scales(q.abs(), pred, SYMBOL_SCALE_OFFSET)
        symbols = torch.cat([g.reshape(-1) for g in pred.groups(q)]).to(torch.int64).numpy()
        scales = torch.cat([g.reshape(-1) for g in pred.groups(b)]).numpy()
        lo, hi = int(min(symbols.min(), -1)), int(max(symbols.max(), 1))
        if lo < -(2**31) or hi >= 2**31:
            raise ValueError(f"delta.step={self.step} is too fine for these values: residual symbols span [{lo}, {hi}]")
        enc = StreamEncoder()
        enc.laplace(symbols, scales, lo, hi)
        return codes.numpy(), enc.finish(), ideal_bits_leaky_laplace(symbols, scales), [lo, hi], recon

    def _decode_quantized(self, raw, codes, pred: Predictor, shape, dtype, step, lo_hi) -> torch.Tensor:
        lo, hi = lo_hi
        b = self._element_scales(codes, pred, shape, SYMBOL_SCALE_OFFSET)
        dec = StreamDecoder(raw)
        index = torch.arange(math.prod(shape)).reshape(shape)
        idx_groups, b_groups = pred.groups(index), pred.groups(b)
        if isinstance(pred, Temporal) and pred.weights is None:
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
