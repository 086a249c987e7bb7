"""Speculative KV coding: the strongest form of Layer 2 (predictive delta coding) of "Sequential KV Cache Compression
via Probabilistic Language Tries" (arXiv 2604.15356), where the prediction of the KV is the KV itself, recomputed
by a cheaper copy of the model from the token ids.

The stream holds the token ids and the residual of the true KV against the copy's prediction:

- ``tokens``: by default (``token_coding=model``) the ids range-coded under the cheap copy's own next-token
  distribution by :class:`compressors.exact.recompute.Recompute` (its bitstream embedded whole), which costs a
  one-token-at-a-time pass of the copy on both sides; ``token_coding=plain`` stores them at ceil(log2 V) bits
  each, and decoding is then one prefill.
- the residual, coded by :class:`compressors.predictive.residual.ResidualCoder` like ``delta``'s: every 16-bit value exactly
  under a value-space Laplace (``step=0``, lossless; ``delta``'s ``exact_coder=laplace``) or uniformly quantized
  with ``step`` (error at most ``step/2`` before rounding to the cache dtype). The prediction does not depend on
  the reconstruction, so there is no loop over units.
- ``crc``: encoder and decoder must compute the same prediction to the bit, so the stream carries a CRC-32 of the
  reconstruction and a decoder whose kernels round differently fails loudly instead of returning another cache.

The cheap copy (``predictor_dtype``) has its weights rounded to bfloat16 (``bf16``) or to int8 per output row
(``int8``), computing in float32, or is the whole model cast to bfloat16, activations included (``bf16_compute``),
which is what makes it cheaper to run. The decoder needs the model (``needs_model``); nothing is fitted.
"""

from __future__ import annotations

import copy
import math
import zlib
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from compressors.exact.recompute import Recompute, vocab_size
from compressors.predictive.delta_predictors import FromModel
from compressors.predictive.residual import KINDS, ResidualCoder
from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.coding.packing import pack_codes, tensor_to_bytes, unpack_codes
from kvbench.core.checks import check_choice, check_range
from kvbench.core.compressor import Compressor
from kvbench.core.flops import prefill_flops_per_token
from kvbench.core.kv import Context, KVSequence
from kvbench.core.resident import Layered, restored
from kvbench.core.timing import Stopwatch

PREDICTOR_DTYPES = ("bf16", "int8", "bf16_compute")
TOKEN_CODINGS = ("model", "plain")
MISMATCH = ("speculative: the decoded cache fails its checksum: the predictor model computed other KV than on the "
            "encoder's side (another device, kernel or thread count?)")


def make_cheap_copy(model: Any, predictor_dtype: str) -> Any:
    """The predictor model: a copy of ``model`` with rounded weights (``bf16``: to bfloat16; ``int8``: symmetric
    int8 per output row of every matrix, norms and biases kept) computing in float32, or (``bf16_compute``) the
    whole copy cast to bfloat16, activations included."""
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


def _id_bits(model: Any) -> int:
    return max(1, math.ceil(math.log2(vocab_size(model))))


def plain_tokens(tokens: torch.Tensor, model: Any) -> tuple[bytes, int]:
    """Token ids at a fixed ceil(log2 V) bits each, little-endian bit packing."""
    return pack_codes(tokens.reshape(-1), _id_bits(model))


def plain_tokens_from(raw: bytes, n: int, model: Any) -> torch.Tensor:
    """Inverse of :func:`plain_tokens`: ``n`` ids, ``(n,)`` int64."""
    nb = _id_bits(model)
    if len(raw) != -(-n * nb // 8):
        raise BitstreamError(f"speculative: token section holds {len(raw)} bytes, not {n} ids of {nb} bits")
    return unpack_codes(raw, nb, n).long()


def _crc(*tensors: torch.Tensor) -> bytes:
    crc = 0
    for t in tensors:
        crc = zlib.crc32(tensor_to_bytes(t), crc)
    return crc.to_bytes(4, "big")


@dataclass
class Speculative(Compressor):
    """Speculative KV coding (arXiv 2604.15356, Layer 2 with a model predictor): token ids plus the residual of the
    KV against a cheaper copy of the model's recomputation of it."""

    predictor_dtype: str = "bf16"
    token_coding: str = "model"
    step: float = 0.0

    # a CRC-32 of the reconstructed K and V: a changed token or residual that alters them is refused
    content_check = True
    name = "speculative"
    family = "predictive"
    max_rel_mse = 0.0  # step 0: bit-exact
    needs_model = True

    def __post_init__(self) -> None:
        check_choice("speculative", "predictor_dtype", self.predictor_dtype, PREDICTOR_DTYPES)
        check_choice("speculative", "token_coding", self.token_coding, TOKEN_CODINGS)
        check_range("speculative", "step", self.step, 0.0, 1e4)
        self.step = float(self.step)
        self._tokens = Recompute()  # the token coder, run on the cheap copy
        # the value-space Laplace: the copy's prediction is so close that modelling it in value space pays
        # (5.09 bits/element on a SmolLM2 window against 5.77 with byte planes); the copy's passes dominate the time
        self._coder = ResidualCoder("speculative", invalid=MISMATCH, exact="laplace")
        self._cheap: tuple[int, Any] | None = None
        self._stats: Counter = Counter()

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        return self.step == 0

    def stats(self) -> dict:
        """Model-estimated residual sizes, time per stage (the copy's setup and passes) and the token coder's own
        stats under ``tokens.``, summed over sequences."""
        return {**self._stats, **{f"tokens.{k}": v for k, v in self._tokens.stats().items()}}

    def _inner_ctx(self, ctx: Context) -> Context:
        """The token coder's context: the cheap copy as its model, float32 KV out (the prediction)."""
        if ctx.model is None:
            raise ValueError("speculative needs the model in the context (needs_model=True): the harness passes it")
        model = ctx.model.model
        if self._cheap is None or self._cheap[0] != id(model):
            watch = Stopwatch(str(next(model.parameters()).device))
            with watch():
                self._cheap = (id(model), make_cheap_copy(model, self.predictor_dtype))
            self._stats["predictor_setup_s"] += watch.seconds
        return Context(ctx.n_layers, ctx.n_heads, ctx.n_tokens, ctx.head_dim, torch.float32,
                       SimpleNamespace(model=self._cheap[1]))

    def _steps(self) -> dict[str, torch.Tensor] | None:
        return None if self.lossless else {kind: torch.tensor(self.step, dtype=torch.float64) for kind in KINDS}

    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream:
        from kvbench.inputs.capture import capture_window

        if kv.tokens is None:
            raise ValueError("speculative needs the token ids the cache was computed from (KVSequence.tokens)")
        inner = self._inner_ctx(ctx)
        cheap = inner.model.model
        watch = Stopwatch(str(next(cheap.parameters()).device))
        with watch():
            if self.token_coding == "model":
                tokens = self._tokens.encode(kv, inner).data
            else:
                tokens = plain_tokens(kv.tokens, cheap)
            got = capture_window(cheap, kv.tokens, kv.n_tokens, torch.float32)
        self._stats["encode_model_s"] += watch.seconds
        coded = self._coder.encode(kv, {kind: FromModel(got[kind]) for kind in KINDS}, self._steps())
        for kind, bits in coded.ideal_bits.items():
            self._stats[f"ideal_bits.{kind}.residual"] += bits
        # the prediction is a float computation on the decoder's side: a decoder whose kernels round
        # differently must fail loudly, not return another cache
        crc = _crc(coded.recon["k"], coded.recon["v"])
        return Bitstream.pack(self.name, {"tokens": tokens, **coded.sections, "crc": crc})

    def resident(self, bs: Bitstream, ctx: Context) -> Layered:
        return restored(self.decode(bs, ctx))  # the model runs once per stored segment, not per step

    def decode_flops_per_token(self, config: Any, n_tokens: int) -> float:
        # the cheap copy has the model's shapes: its token pass (as recompute's) or one prefill, for the prediction
        if self.token_coding == "model":
            return self._tokens.decode_flops_per_token(config, n_tokens)
        return prefill_flops_per_token(config, n_tokens)

    def decode(self, bs: Bitstream, ctx: Context) -> KVSequence:
        from kvbench.inputs.capture import capture_window

        sec = bs.sections(expect=self.name)
        for name in ("tokens", "crc"):
            if name not in sec:
                raise BitstreamError(f"speculative: the bitstream has no section {name!r} (sections: {sorted(sec)})")
        inner = self._inner_ctx(ctx)
        cheap = inner.model.model
        watch = Stopwatch(str(next(cheap.parameters()).device))
        with watch():
            if self.token_coding == "model":
                pred_kv = self._tokens.decode(Bitstream.from_bytes(sec["tokens"]), inner)
                mus, tokens = {"k": pred_kv.k, "v": pred_kv.v}, pred_kv.tokens
            else:
                tokens = plain_tokens_from(sec["tokens"], ctx.n_tokens, cheap)
                mus = capture_window(cheap, tokens, ctx.n_tokens, torch.float32)
        self._stats["decode_model_s"] += watch.seconds
        preds = {kind: FromModel(mus[kind]) for kind in KINDS}
        out = self._coder.decode(sec, preds, ctx.shape, ctx.dtype, self._steps())
        if _crc(out["k"], out["v"]) != sec["crc"]:
            raise BitstreamError(MISMATCH)
        return KVSequence(out["k"], out["v"], tokens)
