"""AQUA-KV: cross-layer prediction of keys and values, residual quantized (Shutova, Malinovskii, Egiazarian,
Kuznedelev, Mazur, Surkov, Ermakov, Alistarh, "Cache Me If You Must: Adaptive Key-Value Quantization for Large
Language Models", arXiv 2501.19392).

One token's keys (or values) of one layer are taken as a single vector over all KV heads, ``H·D`` wide (the
``k_proj`` / ``v_proj`` output the paper's predictors read). Layer by layer, a linear predictor guesses that vector
from what the decoder has already *reconstructed*, and only the residual (true − prediction) is quantized:

- ``scope=prev_layer_and_k`` (the paper's): ``K_l ≈ [K̂_{l-1}, 1]·W^K_l`` and ``V_l ≈ [K̂_l, V̂_{l-1}, 1]·W^V_l``;
- ``scope=prev_layer``: keys as above, values from ``V̂_{l-1}`` alone;
- ``scope=none``: no predictor, every layer quantized directly (the inner quantizer alone, for ablations).

Hats are this codec's own reconstructions, so the encoder runs the decoder's loop (closed loop): it predicts from
reconstructed layers, codes the residual, reconstructs, moves on. Layer 0 has no layer below and is quantized
directly. Keys are predicted and quantized before RoPE (``pre_rope``, as the paper's ``k_proj`` outputs): RoPE is
undone from the free model config and positions (:class:`kvbench.core.rope.Rotary`) and redone after decoding. On a
SmolLM2-135M trace, pre-RoPE keys leave about half the open-loop residual energy of post-RoPE ones (relative MSE
0.07 vs 0.15 for keys, 0.23 vs 0.36 for values): a fixed linear map cannot follow a position-dependent rotation.

**Fitting** (:meth:`AquaKV.fit`), as in the paper's one-shot calibration: layer by layer, ridge least squares
``min ||Y − [X, 1] W||² + λ||W||²`` with ``λ = ridge · mean diag([X, 1]ᵀ[X, 1])`` (the authors' code's ``percdamp``,
1e-3), where X is built from calibration caches *already reconstructed by this codec* for the layers below (and
this layer's keys for the values), so that the predictor is trained on the inputs it will see. The fit uses the
stored (quantized) weights for those reconstructions, so calibration and coding agree exactly. Solved per layer in
float64, one layer's system at a time (:func:`compressors.transform.aquakv_predict.ridge_fit`).

**Residual quantizer**: TurboQuant_mse (arXiv 2504.19874, as in :class:`compressors.quantizers.turboquant.TurboQuant`, whose
codebooks and bit split it reuses) at ``bits`` per element: a float16 norm per vector, a seeded random rotation
(randomized Hadamard when the vector length is a power of two, else a dense random orthogonal matrix) and the
``bits``-bit Lloyd-Max code of a rotated unit vector's coordinates (:mod:`compressors.quantizers.sphere_codebook`).
``vector=token`` quantizes each token's residual over all heads as one vector (H·D; one norm per token, like the
paper's HIGGS groups, which span heads); ``vector=head`` quantizes per head (D; TurboQuant's own layout). Rotation
and codebooks are derived from (length, bits, seed), so they cost nothing.

The rotation is orthogonal and the predictors linear, so the whole codec runs in the rotated basis: the caches are
rotated once, predictors are fitted and evaluated on rotated vectors (ridge regression commutes with an orthogonal
change of basis, so the predictions are the same), each residual is already a rotated vector ready for the scalar
code, and the reconstruction is rotated back once at the end. Per-layer work is then a predictor matmul and a
scalar quantizer, not two rotations per layer.

**Attention sinks** (``sinks``, 4 as in the authors' code): the tokens at the first ``sinks`` positions of a
sequence are stored exactly (16 bit), neither predicted nor used to fit the predictors. Most heads put much of
their attention on them, so their errors count far beyond their share of the MSE: on SmolLM2-135M at ``bits=2``
(4 windows of 1024 tokens, 2,048 scored tokens) the ΔNLL is +0.004 nats with them exact and +0.041 with them coded,
for 0.05 more stream bits per element.

**Codec state** (:meth:`AquaKV.state`, charged once per run by the harness): the predictor weights and biases of
layers 1..L-1 as :class:`compressors.predictive.integer_weights.QuantizedWeights`, ``weight_bits``-bit integers with
a power-of-two scale (int8) per output channel. 8 bits by default: on a SmolLM2-135M window they predict as well as
16-bit weights (relative MSE of the coded keys 0.0097 either way, values 0.0376 vs 0.0375 at ``bits=2``) at half
the codec bits (25.8 instead of 51.5 Mbit for 30 layers of 3 x 64 channels); 6 bits start to cost (0.0103, 0.0397).

Simplified against the paper:

- HIGGS (Hadamard transform over groups of 1024 + a 2-d vector-quantization grid, one scale per group) is replaced
  by TurboQuant's rotation + scalar Lloyd-Max code with a float16 norm per vector (H·D or D long); at ``bits=2``
  and SmolLM2's H·D = 192 the norms add 0.08 bits per element.
- The authors' code quantizes layer 0 with a 4-bit quantizer (it has no predictor); here layer 0 is coded at
  ``first_layer_bits`` (default: ``bits``, so that the stream rate is ``bits`` plus norms).
- The authors' code also keeps a 128-token recent window in 16 bit at inference; here every token after the sinks
  is coded (on 1024-token windows that window alone would cost about 2 bits per element).
- No reduced-rank predictors.

Calibration keys must be pre-RoPE too: :meth:`AquaKV.fit` undoes RoPE with the model config, else reads them captured.

Measured on SmolLM2-135M (SOTU, 4 windows of 1024 tokens, 2,048 scored tokens, calibration on 2 other windows):
``bits=2`` stores 2.14 stream bits per element at ΔNLL +0.004 nats (95% CI [-0.003, +0.011]), where TurboQuant at
``bits=2`` stores 2.25 at +0.048 ([+0.029, +0.065]); the 8-bit predictors are 25.8 Mbit of codec state.

Determinism: encoder and decoder evaluate the same predictions (on one thread,
:func:`compressors.transform.aquakv_predict.one_thread`) from the same reconstructions, so decoding reproduces the
encoder's reconstruction bit for bit. The decoder never re-quantizes, so a last-bit difference in a matmul elsewhere
stays a last-bit difference instead of flipping codes. The fit is the same bytes on any machine: every product it
rounds (rotations, predictions, normal equations) is summed in float64 and rounded once to float32 or to the stored
8-bit weights, the norms likewise, the solve and the weights' scales go through
:mod:`compressors.predictive.fit_numerics`, so that another BLAS's order of sums moves a stored value only when a
float64 result lies within a few ulps of a rounding boundary (``tests/test_fit_determinism.py`` fits it with sums
in another order, another factorization, other thread counts and calibration orders, and compares the bytes).
Encoder and decoder run the same float64 sums, so that a stream decodes alike on another machine too, at a cost in
encode and decode time that ``scripts/bench_compressors.py`` measures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from compressors.predictive import fit_numerics
from compressors.predictive.integer_weights import QuantizedWeights
from compressors.quantizers.rotation import is_power_of_two, make_rotation
from compressors.transform.aquakv_code import LayerReader, ScalarCode, code_layer, reconstruction
from compressors.transform.aquakv_predict import one_thread, predict, real_weights, ridge_fit
from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.coding.packing import tensor_from_bytes, tensor_to_bytes
from kvbench.core.checks import check_choice, check_range
from kvbench.core.compressor import Compressor, Kept, Section
from kvbench.core.kv import Context, KVSequence
from kvbench.core.rope import Rotary

SCOPES = ("prev_layer_and_k", "prev_layer", "none")
VECTORS = ("token", "head")
KINDS = ("k", "v")


def _number(owner: str, field: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{owner}.{field}={value!r} must be a number in [{lo}, {hi}]")
    check_range(owner, field, value, lo, hi)


def _tokens_by_layer(x: torch.Tensor) -> np.ndarray:
    """``(L, H, T, D)`` -> ``(L, T, H·D)`` float32: each token's vector over all heads, per layer."""
    L, H, T, D = x.shape
    return x.float().permute(0, 2, 1, 3).reshape(L, T, H * D).contiguous().numpy()


def _heads_back(x: np.ndarray, H: int, D: int) -> torch.Tensor:
    """Inverse of :func:`_tokens_by_layer`: ``(L, T, H·D)`` -> ``(L, H, T, D)`` float32."""
    L, T, _ = x.shape
    return torch.from_numpy(x).view(L, T, H, D).permute(0, 2, 1, 3)


def _empty_hats(L: int, T: int, width: int) -> dict[str, np.ndarray]:
    """Room for the reconstructions of K and V, ``(L, T, H·D)`` float32 each, filled layer by layer."""
    return {kind: np.empty((L, T, width), dtype=np.float32) for kind in KINDS}


@dataclass
class AquaKV(Compressor):
    """AQUA-KV (arXiv 2501.19392): linear predictors of each layer's K and V from the reconstructed layer below (and
    V from this layer's K), fitted layer by layer on reconstructed calibration caches; the residual quantized with
    TurboQuant_mse at ``bits`` per element. ``vector`` and ``ridge`` are the development split's (the paper's too)."""

    bits: float = 2
    scope: str = "prev_layer_and_k"
    ridge: float = 1e-3
    vector: str = "token"
    first_layer_bits: float | None = None
    weight_bits: int = 8
    pre_rope: bool = True
    sinks: int = 4
    seed: int = 0

    name: ClassVar[str] = "aquakv"
    family: ClassVar[str] = "transform"
    max_rel_mse: ClassVar[float] = 0.15  # 2 bits: 0.086 (K), 0.073 (V) measured
    tuned: ClassVar[tuple[str, ...]] = ("vector", "ridge")
    needs_config: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _number("aquakv", "bits", self.bits, 1, 8)
        check_choice("aquakv", "scope", self.scope, SCOPES)
        _number("aquakv", "ridge", self.ridge, 0, 1e3)
        check_choice("aquakv", "vector", self.vector, VECTORS)
        if self.first_layer_bits is not None:
            _number("aquakv", "first_layer_bits", self.first_layer_bits, 1, 8)
        check_range("aquakv", "weight_bits", self.weight_bits, 4, 16, integer=True)
        if not isinstance(self.pre_rope, bool):
            raise ValueError(f"aquakv.pre_rope={self.pre_rope!r} must be true or false")
        check_range("aquakv", "sinks", self.sinks, 0, 1 << 24, integer=True)
        check_range("aquakv", "seed", self.seed, 0, 2**32 - 1, integer=True)
        self.weight_bits, self.sinks, self.seed, self.ridge = int(self.weight_bits), int(self.sinks), int(self.seed), float(self.ridge)
        self._codes: dict[tuple[int, float], ScalarCode] = {}
        self._rotations: dict[int, torch.Tensor] = {}
        self._rotary: tuple[Any, Rotary] | None = None  # (the config it was built from, its RoPE)
        self._state: dict[str, Section] = {}  # the predictor weights as state sections (fitted or loaded)
        self._weights: dict[str, torch.Tensor] | None = None  # kind -> (L-1, n_in + 1, H·D) float32, parsed
        self._weights_shape: tuple[int, int] | None = None  # (L, H·D) the parsed weights are for
        self._stats: dict[str, float] = {}

    # ---- layout -------------------------------------------------------------------------------------------------

    @property
    def predicts(self) -> bool:
        return self.scope != "none"

    def layer_bits(self, layer: int) -> float:
        return self.first_layer_bits if layer == 0 and self.first_layer_bits is not None else self.bits

    def _vector_len(self, H: int, D: int) -> int:
        return H * D if self.vector == "token" else D

    def _n_in(self, kind: str, width: int) -> int:
        """Predictor inputs of ``kind`` for vectors ``width`` = H·D wide (the bias not counted)."""
        return 2 * width if kind == "v" and self.scope == "prev_layer_and_k" else width

    def _code(self, d: int, layer: int) -> ScalarCode:
        key = (d, self.layer_bits(layer))
        if key not in self._codes:
            self._codes[key] = ScalarCode(*key)
        return self._codes[key]

    def _rotation(self, d: int) -> torch.Tensor:
        """The seeded rotation of length-``d`` vectors as a matrix ``Π`` ``(d, d)`` float32: ``y = x Π``."""
        if d not in self._rotations:
            rot = make_rotation("hadamard" if is_power_of_two(d) else "orthogonal", d, self.seed)
            self._rotations[d] = rot.forward(torch.eye(d)).contiguous()
        return self._rotations[d]

    def _rotate(self, x: np.ndarray, d: int, inverse: bool = False) -> np.ndarray:
        """Rotate every length-``d`` vector of ``x`` ``(..., H·D)`` (per token or per head), or rotate back."""
        m = self._rotation(d)
        # float64 sums rounded once to float32: the same rotated vectors on any machine (see fit_numerics)
        return fit_numerics.gemm(torch.from_numpy(x).reshape(-1, d), m.T if inverse else m).float().numpy().reshape(x.shape)

    def _rope(self, config: Any, what: str) -> Rotary:
        if config is None:
            raise ValueError(f"aquakv.pre_rope=true undoes RoPE with the model config, but {what} has none "
                             "(ctx.config is None); pass the model config, or use compressor.pre_rope=false")
        if self._rotary is None or self._rotary[0] is not config:
            self._rotary = (config, Rotary(config))
        return self._rotary[1]

    # ---- the closed loop ----------------------------------------------------------------------------------------

    def _inputs(self, kind: str, layer: int, k_hat: np.ndarray, v_hat: np.ndarray) -> list[np.ndarray]:
        """What predicts ``kind`` at ``layer`` (>= 1): reconstructed rotated vectors, each ``(T, H·D)``."""
        if kind == "k":
            return [k_hat[layer - 1]]
        if self.scope == "prev_layer_and_k":
            return [k_hat[layer], v_hat[layer - 1]]
        return [v_hat[layer - 1]]

    def _prediction(self, weights: Mapping[str, torch.Tensor] | None, kind: str, layer: int,
                    hats: Mapping[str, np.ndarray]) -> np.ndarray | None:
        """``kind``'s prediction at ``layer`` from the reconstructions so far, ``(T, H·D)``; None where nothing is
        predicted (layer 0, ``scope=none``)."""
        if not layer or not self.predicts:
            return None
        return predict(weights[kind][layer - 1], *self._inputs(kind, layer, hats["k"], hats["v"]))

    def _encode_layers(self, k: np.ndarray, v: np.ndarray, shape: tuple[int, int, int, int],
                       weights: Mapping[str, torch.Tensor] | None) -> tuple[dict[str, Section], np.ndarray, np.ndarray]:
        """The encoder's closed loop over the rotated caches ``K, V`` ``(L, T, H·D)``: layer by layer, K then V, the
        residual from the prediction quantized and reconstructed as the decoder will. Returns the sections written
        and the rotated reconstructions ``K̂, V̂`` ``(L, T, H·D)`` float32."""
        L, H, T, D = shape
        d = self._vector_len(H, D)
        hats = _empty_hats(L, T, H * D)
        parts: dict[str, list[bytes]] = {}
        for layer in range(L):
            code = self._code(d, layer)
            for kind, true in (("k", k), ("v", v)):  # K first: the value predictor reads this layer's K̂
                mu = self._prediction(weights, kind, layer, hats)  # (T, H·D) or None
                res, norms, codes, hat = code_layer(code, true[layer], mu, kind)
                hats[kind][layer] = hat
                if mu is not None:
                    self._count(kind, true[layer], res)
                parts.setdefault(f"{kind}.norm", []).append(norms)
                for b, raw in codes:
                    parts.setdefault(f"{kind}.codes{b}", []).append(raw)
        # each layer's codes fill whole bytes (a pad of at most 7 bits per layer, charged with the rest)
        return {name: b"".join(chunks) for name, chunks in parts.items()}, hats["k"], hats["v"]

    def _decode_layers(self, sec: Mapping[str, bytes], shape: tuple[int, int, int, int],
                       weights: Mapping[str, torch.Tensor] | None) -> tuple[np.ndarray, np.ndarray]:
        """The decoder's loop over layers, in the encoder's order (layer by layer, K then V): the prediction from the
        reconstructions so far plus the residual read from ``sec``. Returns ``K̂, V̂`` ``(L, T, H·D)`` float32."""
        L, H, T, D = shape
        d = self._vector_len(H, D)
        n = T * H * D // d  # vectors per layer and kind
        hats = _empty_hats(L, T, H * D)
        reader = LayerReader(sec)
        for layer in range(L):
            code = self._code(d, layer)
            for kind in KINDS:  # K first: the value predictor reads this layer's K̂
                mu = self._prediction(weights, kind, layer, hats)  # (T, H·D) or None
                norms = reader.take(f"{kind}.norm", 2 * n)
                codes = [reader.take(f"{kind}.codes{b}", size) for b, size in code.code_bytes(n)]
                hats[kind][layer] = reconstruction(mu, code.dequantize(norms, codes, n).reshape(T, H * D))
        reader.finish()
        return hats["k"], hats["v"]

    def _count(self, kind: str, target: np.ndarray, res: np.ndarray) -> None:
        """Energy of the predicted layers' targets and of their residuals (the prediction gain), summed."""
        for key, x in ((f"{kind}.target_energy", target), (f"{kind}.residual_energy", res)):
            flat = x.reshape(-1)
            self._stats[key] = self._stats.get(key, 0.0) + float(np.einsum("i,i->", flat, flat))  # not BLAS: see predict

    def stats(self) -> dict[str, float]:
        """Summed over the sequences encoded: the energy (sum of squares, pre-RoPE for keys) of the predicted
        layers' targets and of the residuals actually quantized; their ratio is the predictor's relative MSE."""
        return dict(self._stats)

    # ---- fitting and state --------------------------------------------------------------------------------------

    def _calib_keys(self, kv: KVSequence, config: Any) -> torch.Tensor:
        if not self.pre_rope:
            return kv.k
        if config is not None:
            return self._rope(config, "fit").undo(kv.k, 0)  # calibration windows start a sequence
        if kv.k_pre_rope is not None:
            return kv.k_pre_rope
        raise ValueError("aquakv.fit needs pre-RoPE calibration keys: call fit(calib, config=model_config), capture "
                         "the calibration windows with capture.pre_rope=true, or set compressor.pre_rope=false")

    def exact_tokens(self, n_tokens: int) -> Kept:
        return Kept(sinks=self.sinks)

    def fit(self, calib: Sequence[KVSequence], config: Any = None) -> None:
        """Fit the predictors layer by layer on calibration caches reconstructed by this codec (closed loop).

        Pre-RoPE calibration keys come from ``config`` (RoPE undone here, as encode does) or from the windows'
        captured ``k_pre_rope``.
        """
        with one_thread():
            self._fit(list(calib), config)

    def _fit(self, calib: list[KVSequence], config: Any) -> None:
        if not calib:
            raise ValueError("aquakv.fit needs at least one calibration sequence")
        shapes = {kv.shape[:2] + kv.shape[3:] for kv in calib}
        if len(shapes) != 1:
            raise ValueError(f"aquakv.fit: calibration sequences have different (layers, heads, head_dim): {sorted(shapes)}")
        L, H, _, D = calib[0].shape
        self._state, self._weights, self._weights_shape = {}, None, None
        if not self.predicts or L < 2:
            return
        d = self._vector_len(H, D)
        # calibration windows start a sequence: their first ``sinks`` tokens are stored exactly, never predicted
        keys = [self._calib_keys(kv, config)[:, :, self.sinks :] for kv in calib]
        true = {"k": [self._rotate(_tokens_by_layer(k), d) for k in keys],  # each (L, T_i - sinks, H·D)
                "v": [self._rotate(_tokens_by_layer(kv.v[:, :, self.sinks :]), d) for kv in calib]}
        if not sum(x.shape[1] for x in true["k"]):
            raise ValueError(f"aquakv.fit: no calibration tokens after the {self.sinks} sinks of each window")
        hats = {kind: [np.empty_like(x) for x in true[kind]] for kind in KINDS}
        fitted: dict[str, list[QuantizedWeights]] = {"k": [], "v": []}
        for layer in range(L):
            code = self._code(d, layer)
            for kind in KINDS:
                mus = [None] * len(calib)
                if layer:
                    inputs = [self._inputs(kind, layer, kh, vh) for kh, vh in zip(hats["k"], hats["v"])]
                    X = np.concatenate([np.concatenate(x, axis=1) for x in inputs])  # (N, n_in)
                    Y = np.concatenate([t[layer] for t in true[kind]])  # (N, H·D)
                    q = QuantizedWeights.from_real(torch.from_numpy(ridge_fit(X, Y, self.ridge)), self.weight_bits)
                    fitted[kind].append(q)
                    W = real_weights(q)  # the stored weights, as the decoder will use them
                    mus = [predict(W, *x) for x in inputs]
                for target, hat, mu in zip(true[kind], hats[kind], mus):
                    hat[layer] = code_layer(code, target[layer], mu, kind)[3]
        self._state = {f"{kind}.weights": QuantizedWeights(torch.stack([q.w for q in fitted[kind]]),
                                                           torch.stack([q.shift for q in fitted[kind]]),
                                                           self.weight_bits).to_bytes() for kind in KINDS}
        # the encoder codes with the weights as parsed back from the state bytes: both sides use the same numbers
        self._parse(L, H * D)

    def state(self) -> dict[str, Section]:
        """The predictor weights of layers 1..L-1 (``k.weights``, ``v.weights``); empty before fitting."""
        return dict(self._state)

    def load_state(self, sections: Mapping[str, bytes]) -> None:
        sections = dict(sections)
        if not self.predicts and sections:
            raise ValueError(f"aquakv with scope=none has no fitted state, but state sections {sorted(sections)} were given")
        want = {f"{kind}.weights" for kind in KINDS}
        if sections and set(sections) != want:
            raise BitstreamError(f"aquakv state has sections {sorted(sections)}; expected {sorted(want)}")
        self._state, self._weights, self._weights_shape = {k: bytes(v) for k, v in sections.items()}, None, None

    def _parse(self, n_layers: int, width: int) -> dict[str, torch.Tensor] | None:
        """The predictor weights for ``n_layers`` layers of vectors ``width`` = H·D wide, parsed from the state bytes
        on first use (the bytes carry no shape); None where nothing is predicted."""
        if not self.predicts or n_layers < 2:
            return None
        if not self._state:
            raise ValueError("aquakv has no predictor weights: call fit(calibration windows) first, or load its state "
                             "(kvbench.core.codec.decoder_for(encoder, state_bytes(encoder)))")
        if self._weights_shape != (n_layers, width):
            parsed = {}
            for kind in KINDS:
                shape = (n_layers - 1, self._n_in(kind, width) + 1, width)
                what = f"aquakv state section {kind}.weights (scope={self.scope}, {n_layers} layers of {width} channels)"
                sec = self._state[f"{kind}.weights"]
                raw = sec if isinstance(sec, bytes) else sec[0]
                parsed[kind] = real_weights(QuantizedWeights.from_bytes(raw, shape, self.weight_bits, what))
            self._weights, self._weights_shape = parsed, (n_layers, width)
        return self._weights

    # ---- coding -------------------------------------------------------------------------------------------------

    def _encode(self, kv: KVSequence, ctx: Context, reconstruct: bool) -> tuple[Bitstream, KVSequence | None]:
        with one_thread():
            return self._encode_loop(kv, ctx, reconstruct)

    def _n_sink(self, ctx: Context) -> int:
        """Tokens at absolute positions below ``sinks`` in this sequence (none in a segment that starts later)."""
        return min(ctx.n_tokens, max(0, self.sinks - ctx.start))

    def _encode_loop(self, kv: KVSequence, ctx: Context, reconstruct: bool) -> tuple[Bitstream, KVSequence | None]:
        L, H, T, D = kv.shape
        n_sink = self._n_sink(ctx)
        start = ctx.start + n_sink  # the first coded token's position
        sections: dict[str, Section] = {"k.sinks": tensor_to_bytes(kv.k[:, :, :n_sink]),
                                        "v.sinks": tensor_to_bytes(kv.v[:, :, :n_sink])}
        coded = kv.slice_tokens(n_sink, T)
        rope = self._rope(ctx.config, "the encoder's context") if self.pre_rope else None
        weights = self._parse(L, H * D)
        d = self._vector_len(H, D)
        k = self._rotate(_tokens_by_layer(rope.undo(coded.k, start) if rope else coded.k), d)  # (L, T', H·D)
        v = self._rotate(_tokens_by_layer(coded.v), d)  # (L, T', H·D)
        written, k_hat, v_hat = self._encode_layers(k, v, coded.shape, weights)
        sections.update(written)
        bs = Bitstream.pack(self.name, sections)
        if not reconstruct:
            return bs, None
        return bs, self._assemble(kv.k[:, :, :n_sink], kv.v[:, :, :n_sink], k_hat, v_hat, ctx, rope, start)

    def encode_with_reconstruction(self, kv: KVSequence, ctx: Context) -> tuple[Bitstream, KVSequence]:
        """The bitstream and the reconstruction the encoder's closed loop computed (what decode gives back)."""
        return self._encode(kv, ctx, reconstruct=True)  # type: ignore[return-value]

    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream:
        return self._encode(kv, ctx, reconstruct=False)[0]

    def decode(self, bs: Bitstream, ctx: Context) -> KVSequence:
        with one_thread():
            return self._decode(bs, ctx)

    def _decode(self, bs: Bitstream, ctx: Context) -> KVSequence:
        sec = bs.sections(expect=self.name)
        L, H, T, D = ctx.shape
        n_sink = self._n_sink(ctx)
        sinks = []
        for kind in KINDS:
            raw = sec.get(f"{kind}.sinks")
            if raw is None or len(raw) != L * H * n_sink * D * 2:
                got = "no section" if raw is None else f"{len(raw)} bytes"
                raise BitstreamError(f"aquakv bitstream has {got} for the {n_sink} sink tokens' {kind} ({L * H * n_sink * D * 2} bytes)")
            sinks.append(tensor_from_bytes(raw, ctx.dtype, (L, H, n_sink, D)))
        rope = self._rope(ctx.config, "the decoder's context") if self.pre_rope else None
        coded = {name: raw for name, raw in sec.items() if not name.endswith(".sinks")}
        k_hat, v_hat = self._decode_layers(coded, (L, H, T - n_sink, D), self._parse(L, H * D))
        return self._assemble(*sinks, k_hat, v_hat, ctx, rope, ctx.start + n_sink)

    def _assemble(self, k_sink: torch.Tensor, v_sink: torch.Tensor, k_hat: np.ndarray, v_hat: np.ndarray, ctx: Context,
                  rope: Rotary | None, start: int) -> KVSequence:
        """Exact sinks ``(L, H, n_sink, D)`` and the coded tokens' rotated reconstructions ``(L, T', H·D)`` -> the
        cache: the coded tokens rotated back, heads split, RoPE redone on keys from position ``start``."""
        _, H, _, D = ctx.shape
        d = self._vector_len(H, D)
        k = _heads_back(self._rotate(k_hat, d, inverse=True), H, D)  # (L, H, T', D) float32
        if rope is not None:
            k = rope.apply(k, start)
        v = _heads_back(self._rotate(v_hat, d, inverse=True), H, D)  # (L, H, T', D)
        return KVSequence(torch.cat([k_sink, k.to(ctx.dtype)], dim=2), torch.cat([v_sink, v.to(ctx.dtype)], dim=2))
