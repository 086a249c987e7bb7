"""KVQuant: non-uniform KV quantization with pre-RoPE per-channel keys (Hooper et al., arXiv 2401.18079).

What is implemented, following the paper's 3-bit, 1%-outlier configuration:

- **Per-channel keys, quantized before RoPE** (``pre_rope``): the cached keys are rotated back with the model's
  own RoPE (:class:`kvbench.core.rope.Rotary`, from the free model config and positions), quantized per channel over the
  window's tokens, decoded and rotated again. Pre-RoPE channels keep their outlier structure in fixed channels,
  which RoPE smears across channel pairs.
- **Per-token values**: one scale per token over the layer's whole value row (all KV heads, ``H * D``
  elements), as the paper's per-token quantization of the value projection's output.
- **Non-uniform datatypes (nuq)**: one ``2**bits``-level codebook per layer for keys and one for values, on values
  normalized to [-1, 1] by each vector's centre ``(max + min) / 2`` and half-range ``(max - min) / 2`` (the
  paper's normalization). The paper fits them with Fisher-information-weighted k-means; here they are plain
  (unweighted) 1-D k-means, i.e. Lloyd iterations on a 4,096-bin histogram of the normalized calibration values of
  each layer. Codebooks are codec state (:meth:`KVQuant.state`, charged once per run as ``codec_bits``).
- **Per-vector dense-and-sparse outliers**: ``round(outlier_fraction * n)`` values of every length-``n`` vector
  (key channel over tokens, value row over channels) are kept in the cache's 16-bit dtype with their positions
  (``ceil(log2 n)`` bits each); the normalization range is that of the remaining values. The paper removes
  values beyond upper and lower percentile thresholds (half the fraction each side); here each vector removes
  ``i`` values from its top and ``count - i`` from its bottom, ``i`` chosen to minimise the remaining range, so
  every vector spends exactly the same count and no per-vector count is stored.

Charged in the stream: the packed codes of every position (outlier positions included: the dense part keeps its
shape, as in the paper), each vector's centre and half-range in the cache dtype, the outlier values and positions.

Simplified or left out: scales and outlier thresholds are computed per window at encode time (the paper calibrates
the key scales offline and computes value scales online); no Q-Norm, no attention-sink token kept in 16 bit, and
no sensitivity weighting of the k-means.

The fit is the same bytes on any machine: the histograms are integer counts (any order of windows adds them
alike) and Lloyd's iterations run in float64 on fixed bin centres, rounded once to the stored float32. Its one
input computed with the machine's vector math is RoPE's cos and sin table (undone on the calibration keys), as in
the model's own forward pass.

Fitting the key codebooks on pre-RoPE keys needs those keys: ``fit`` takes them from the calibration windows
(``capture.pre_rope=true``) or undoes RoPE itself when it is given the model config. Without either it fits on
the cached (post-RoPE) keys, warns, and says so in :meth:`KVQuant.stats`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.coding.packing import pack_codes, tensor_from_bytes, tensor_to_bytes, unpack_codes
from kvbench.core.checks import check_range
from kvbench.core.compressor import Compressor, Section
from kvbench.core.kv import Context, KVSequence
from kvbench.core.rope import Rotary

KINDS = ("k", "v")
#: histogram bins on [-1, 1] for the codebook fit; a bin is far narrower than any cell of a 4-bit codebook
HIST_BINS = 4096
LLOYD_ITERS = 200


def outlier_count(fraction: float, n: int) -> int:
    """Outliers kept per vector of ``n`` values: ``fraction * n`` rounded half up, leaving at least two dense values
    on each side so that the top and bottom candidates never overlap."""
    return max(0, min(math.floor(fraction * n + 0.5), (n - 2) // 2))


def index_bits(n: int) -> int:
    """Bits of one position in a vector of ``n`` values."""
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


def _float32(x: torch.Tensor) -> np.ndarray:
    """A 16-bit (or float32) tensor as a float32 numpy array, converted in numpy (bfloat16 through its bits)."""
    if x.dtype == torch.bfloat16:  # bfloat16 is the top half of a float32
        return (x.contiguous().view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    return x.numpy().astype(np.float32)


def _to_store(x: np.ndarray, store: torch.dtype) -> torch.Tensor:
    """float32 array -> contiguous tensor in the cache dtype (numpy's conversion for float16)."""
    if store == torch.float16:
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float16))
    return torch.from_numpy(np.ascontiguousarray(x)).to(store)


class _ChannelRoPE:
    """RoPE undone and redone on channel-major keys ``(L, H, D, T)``, the layout the per-channel quantizer reads.

    The angles are :meth:`kvbench.core.rope.Rotary.angles` (the model family's own rotary class, scaling included),
    cached per (tokens, start) so that windows of one length pay for them once; the rotation is
    :class:`~kvbench.core.rope.Rotary`'s own formula (inverse divided by cos^2 + sin^2, partial rotary passing the
    trailing channels through), run in numpy on the channel-major layout to save a transpose each way.
    """

    def __init__(self, config: Any) -> None:
        self.config = config
        self.rotary = Rotary(config)
        self._angles: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}

    def _tables(self, n_tokens: int, start: int) -> tuple[np.ndarray, ...]:
        key = (n_tokens, start)
        if key not in self._angles:
            cos, sin = self.rotary.angles(n_tokens, start)  # (L, 1, T, R)
            cos = np.ascontiguousarray(cos.numpy().transpose(0, 1, 3, 2), dtype=np.float32)  # (L, 1, R, T)
            sin = np.ascontiguousarray(sin.numpy().transpose(0, 1, 3, 2), dtype=np.float32)  # (L, 1, R, T)
            norm = cos * cos + sin * sin
            if len(self._angles) >= 8:  # segments of a growing cache each start elsewhere: keep a few
                self._angles.clear()
            self._angles[key] = (cos, -sin, cos / norm, sin / norm)
        return self._angles[key]

    def _rotate(self, x: np.ndarray, start: int, inverse: bool) -> np.ndarray:
        L, _, D, T = x.shape
        if L != self.rotary.config.num_hidden_layers:
            raise ValueError(f"keys have {L} layers; the model config has {self.rotary.config.num_hidden_layers}")
        cos, neg_sin, cos_inv, sin_inv = self._tables(T, start)
        R = cos.shape[2]
        h = R // 2
        c, s = (cos_inv, sin_inv) if inverse else (cos, neg_sin)  # undo rotates by -angle (and unscales)
        out = x.copy() if R < D else np.empty_like(x)  # channels past R are not rotated
        x1, x2 = x[:, :, :h], x[:, :, h:R]
        # rotate_half(x) = (-x2, x1): out1 = x1 c1 + x2 s1 and out2 = x2 c2 - x1 s2 with s = sin (undo) or -sin
        np.multiply(x1, c[:, :, :h], out=out[:, :, :h])
        out[:, :, :h] += x2 * s[:, :, :h]
        np.multiply(x2, c[:, :, h:], out=out[:, :, h:R])
        out[:, :, h:R] -= x1 * s[:, :, h:]
        return out

    def undo(self, x: np.ndarray, start: int) -> np.ndarray:
        return self._rotate(x, start, inverse=True)

    def apply(self, x: np.ndarray, start: int) -> np.ndarray:
        return self._rotate(x, start, inverse=False)


@dataclass
class _Rows:
    """One kind (K or V) of one window as ``(L, M, n)`` float32 vectors, and what encode computed on them."""

    x: np.ndarray  # (L, M, n) float32
    center: torch.Tensor  # (L, M) in the stored dtype
    half_range: torch.Tensor  # (L, M) in the stored dtype
    out_idx: torch.Tensor  # (L, M, k) int64 positions in the vector
    out_val: torch.Tensor  # (L, M, k) in the stored dtype

    def normalized(self) -> np.ndarray:
        """``(x - centre) / half_range`` with the stored (rounded) scales, as the decoder will undo it: (L, M, n)."""
        c = self.center.float().numpy()[..., None]
        r = self.half_range.float().numpy()[..., None]
        r = np.where(r > 0, r, 1.0)  # a constant vector: every value is its centre, code 0 of anything works
        return (self.x - c) / r


def _extremes(xn: np.ndarray, count: int, largest: bool) -> tuple[np.ndarray, np.ndarray]:
    """The ``count`` largest (or smallest) values of every vector (last dim) of ``xn`` and their positions, in order.

    ``count`` passes of numpy's vectorised argmax, each setting its pick aside with an infinity, cost a fraction
    of a general top-k when ``count`` is small (about 1 ms a pass per 6M values, against 20 ms for torch.topk);
    the picked values are put back before returning, so ``xn`` is unchanged.
    """
    pick, fence = (np.argmax, -np.inf) if largest else (np.argmin, np.inf)
    vals = np.empty((*xn.shape[:-1], count), dtype=xn.dtype)
    idx = np.empty((*xn.shape[:-1], count), dtype=np.int64)
    for j in range(count):  # count is the few outliers per vector, never the vector length
        i = pick(xn, axis=-1)[..., None]  # (L, M, 1)
        idx[..., j : j + 1] = i
        vals[..., j : j + 1] = np.take_along_axis(xn, i, -1)
        np.put_along_axis(xn, i, fence, -1)
    np.put_along_axis(xn, idx, vals, -1)
    return vals, idx


def _split_outliers(xn: np.ndarray, k: int, store: torch.dtype) -> _Rows:
    """Remove ``k`` outliers from every vector (last dim) of ``xn`` (L, M, n): ``i`` from the top and ``k - i`` from
    the bottom, with the ``i`` that leaves the narrowest range; centre and half-range of the rest."""
    L, M, n = xn.shape
    if k == 0:
        hi, lo = xn.max(-1), xn.min(-1)  # (L, M)
        idx = np.zeros((L, M, 0), dtype=np.int64)
    else:
        t_val, t_idx = _extremes(xn, k + 1, largest=True)  # (L, M, k+1) descending
        b_val, b_idx = _extremes(xn, k + 1, largest=False)  # (L, M, k+1) ascending
        span = t_val - b_val[..., ::-1]  # (L, M, k+1): [i] = range left after removing i top and k - i bottom
        i = span.argmin(-1)[..., None]  # (L, M, 1)
        hi = np.take_along_axis(t_val, i, -1)[..., 0]
        lo = np.take_along_axis(b_val, k - i, -1)[..., 0]
        j = np.arange(k)
        take = np.concatenate([j < i, j < k - i], axis=-1)  # (L, M, 2k): exactly k per vector
        idx = np.concatenate([t_idx[..., :k], b_idx[..., :k]], axis=-1)[take].reshape(L, M, k)
    center = torch.from_numpy((hi + lo) / 2).to(store)
    half = torch.from_numpy((hi - lo) / 2).to(store)
    # inf and nan sort to the ends, so any left after the outliers shows up here
    if not (torch.isfinite(center).all() and torch.isfinite(half).all()):
        raise ValueError(f"kvquant: the KV has non-finite values (inf or nan) beyond the outliers, or a vector's range "
                         f"exceeds what {store} can store; nothing to quantize")
    idx_t = torch.from_numpy(idx)
    return _Rows(xn, center, half, idx_t, _to_store(np.take_along_axis(xn, idx, -1), store))


def _quantize(u: np.ndarray, codebook: np.ndarray) -> np.ndarray:
    """Nearest-centroid codes of normalized ``u`` (L, M, n) under per-layer ascending ``codebook`` (L, K): uint8."""
    thr = ((codebook[:, :-1] + codebook[:, 1:]) / 2).astype(np.float32)  # (L, K-1)
    codes = np.zeros(u.shape, dtype=np.uint8)
    above = np.empty(u.shape, dtype=bool)
    for j in range(thr.shape[1]):  # K - 1 whole-array passes; ties go to the lower cell
        np.greater(u, thr[:, j, None, None], out=above)
        codes += above.view(np.uint8)
    return codes


def _centroids(codes: np.ndarray, codebook: np.ndarray) -> np.ndarray:
    """Per-layer table lookup: codes (L, M, n) -> float32 centroids (L, M, n)."""
    out = np.empty(codes.shape, dtype=np.float32)
    for layer in range(codes.shape[0]):  # one gather per layer, each over all of its vectors
        np.take(codebook[layer].astype(np.float32), codes[layer], out=out[layer])
    return out


def lloyd_1d(hist: np.ndarray, levels: int, iters: int = LLOYD_ITERS) -> np.ndarray:
    """k-means (Lloyd) on histograms over [-1, 1]: ``hist`` (L, B) counts -> (L, levels) ascending centroids.

    Starts at the quantiles of each histogram; a cell that empties keeps its centroid. A layer without samples
    gets the uniform grid.
    """
    L, B = hist.shape
    w = hist.astype(np.float64)
    x = -1 + (np.arange(B) + 0.5) * (2 / B)  # (B,) bin centres
    total = w.sum(1, keepdims=True)  # (L, 1)
    cdf = np.cumsum(w, 1) / np.maximum(total, 1)  # (L, B)
    targets = (np.arange(levels) + 0.5) / levels  # (K,)
    first = (cdf[:, :, None] < targets[None, None, :]).sum(1).clip(0, B - 1)  # (L, K) bin of each quantile
    c = x[first]
    c = np.where(total > 0, c, np.linspace(-1, 1, levels)[None, :])
    offsets = (np.arange(L) * levels)[:, None]  # (L, 1)
    for _ in range(iters):
        thr = (c[:, :-1] + c[:, 1:]) / 2  # (L, K-1)
        cell = (x[None, :, None] > thr[:, None, :]).sum(-1) + offsets  # (L, B) cell of each bin
        mass = np.bincount(cell.ravel(), w.ravel(), L * levels).reshape(L, levels)
        moment = np.bincount(cell.ravel(), (w * x).ravel(), L * levels).reshape(L, levels)
        new = np.where(mass > 0, moment / np.maximum(mass, 1e-300), c)
        new.sort(axis=1)
        done = np.max(np.abs(new - c)) < 1e-9
        c = new
        if done:
            break
    return c


@dataclass
class KVQuant(Compressor):
    """KVQuant (arXiv 2401.18079): pre-RoPE per-channel keys, per-token values, per-layer nuq codebooks fitted on
    calibration, per-vector dense-and-sparse outliers. Defaults: nuq3 with 1% outliers."""

    bits: int = 3
    outlier_fraction: float = 0.01
    pre_rope: bool = True

    name: ClassVar[str] = "kvquant"
    family: ClassVar[str] = "quantizer"
    max_rel_mse: ClassVar[float] = 0.05  # 3-bit codebooks: 0.026 (K), 0.024 (V) measured
    # none chosen on dev: the outlier share is part of the rate (each outlier costs its 16-bit value and position),
    # like the codebook width, so the frontier sweeps it as a rate, at the paper's 1% by default
    tuned: ClassVar[tuple[str, ...]] = ()
    needs_config: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_range("kvquant", "bits", self.bits, 2, 4, integer=True)
        if isinstance(self.outlier_fraction, bool) or not isinstance(self.outlier_fraction, (int, float)):
            raise ValueError(f"kvquant.outlier_fraction={self.outlier_fraction!r} must be a number in [0, 0.2]")
        check_range("kvquant", "outlier_fraction", self.outlier_fraction, 0.0, 0.2)
        if not isinstance(self.pre_rope, bool):
            raise ValueError(f"kvquant.pre_rope={self.pre_rope!r} must be true or false")
        self.bits, self.outlier_fraction = int(self.bits), float(self.outlier_fraction)
        self._codebooks: dict[str, np.ndarray] = {}  # kind -> (L, 2**bits) float32, as the state bytes hold them
        self._rotary: _ChannelRoPE | None = None
        self._stats: dict[str, Any] = {}

    # ---- vectors ---------------------------------------------------------------------------------------------

    def _rope(self, ctx_config: Any, what: str) -> _ChannelRoPE:
        if ctx_config is None:
            raise ValueError(f"kvquant.pre_rope=true undoes RoPE with the model config, but {what} has none "
                             "(ctx.config is None); pass the model config, or use compressor.pre_rope=false")
        if self._rotary is None or self._rotary.config is not ctx_config:
            self._rotary = _ChannelRoPE(ctx_config)
        return self._rotary

    @staticmethod
    def _key_rows(k: torch.Tensor, rope: _ChannelRoPE | None = None, start: int = 0) -> np.ndarray:
        """(L, H, T, D) keys -> (L, H*D, T) float32: one vector per channel, over the tokens (RoPE undone if given)."""
        L, H, T, D = k.shape
        x = np.ascontiguousarray(_float32(k).transpose(0, 1, 3, 2))  # (L, H, D, T)
        if rope is not None:
            x = rope.undo(x, start)
        return x.reshape(L, H * D, T)

    @staticmethod
    def _value_rows(v: torch.Tensor) -> np.ndarray:
        """(L, H, T, D) values -> (L, T, H*D) float32: one vector per token, over all heads' channels."""
        L, H, T, D = v.shape
        return np.ascontiguousarray(_float32(v).transpose(0, 2, 1, 3)).reshape(L, T, H * D)

    # ---- calibration -----------------------------------------------------------------------------------------

    def fit(self, calib: Sequence[KVSequence], config: Any = None) -> None:
        """Per-layer nuq codebooks for K and V by 1-D k-means on normalized, outlier-free calibration values.

        Pre-RoPE keys come from ``config`` (RoPE undone here, as encode does) or from the windows' captured
        ``k_pre_rope``; without either the key codebooks are fitted on the cached keys (see the module docstring).
        """
        if not calib:
            raise ValueError("kvquant fits its codebooks on calibration windows; none were given")
        levels = 1 << self.bits
        hist = {kind: None for kind in KINDS}
        space = "post_rope"
        if self.pre_rope:
            if config is not None:
                space = "pre_rope (config)"
            elif all(kv.k_pre_rope is not None for kv in calib):
                space = "pre_rope (captured)"
            else:
                warnings.warn("kvquant.pre_rope=true but the calibration windows carry no pre-RoPE keys and no model "
                              "config was given: key codebooks are fitted on post-RoPE keys (capture them with "
                              "capture.pre_rope=true)", stacklevel=2)
        for kv in calib:
            for kind in KINDS:
                if kind == "v":
                    x = self._value_rows(kv.v)
                elif space == "pre_rope (captured)":
                    x = self._key_rows(kv.k_pre_rope)
                else:
                    x = self._key_rows(kv.k, self._rope(config, "fit") if space == "pre_rope (config)" else None)
                rows = _split_outliers(x, outlier_count(self.outlier_fraction, x.shape[-1]), kv.k.dtype)
                u = rows.normalized()  # (L, M, n)
                L = u.shape[0]
                inlier = torch.ones(u.shape, dtype=torch.bool).scatter_(-1, rows.out_idx, False).numpy()
                b = np.clip(((u + 1) * (HIST_BINS / 2)).astype(np.int64), 0, HIST_BINS - 1)
                b += (np.arange(L) * HIST_BINS)[:, None, None]
                h = np.bincount(b[inlier], minlength=L * HIST_BINS).reshape(L, HIST_BINS)
                if hist[kind] is not None and hist[kind].shape != h.shape:
                    raise ValueError(f"calibration windows have different layer counts ({hist[kind].shape[0]} and {L})")
                hist[kind] = h if hist[kind] is None else hist[kind] + h
        for kind in KINDS:
            # the encoder uses what the decoder will load: the float32 centroids of the state bytes
            self._codebooks[kind] = lloyd_1d(hist[kind], levels).astype(np.float32)
        self._stats = {"k_codebook_fit_on": space}

    def state(self) -> dict[str, Section]:
        """The per-layer codebooks, ``(L, 2**bits)`` float32 for K and for V."""
        if not self._codebooks:
            return {}
        return {f"{kind}.codebook": tensor_to_bytes(torch.from_numpy(self._codebooks[kind])) for kind in KINDS}

    def load_state(self, sections: Mapping[str, bytes]) -> None:
        want = [f"{kind}.codebook" for kind in KINDS]
        if not sections:
            self._codebooks = {}
            return
        if sorted(sections) != sorted(want):
            raise BitstreamError(f"kvquant takes the state sections {want}; got {sorted(sections)}")
        levels = 1 << self.bits
        books = {}
        for kind in KINDS:
            raw = bytes(sections[f"{kind}.codebook"])
            if not raw or len(raw) % (4 * levels):
                raise BitstreamError(f"kvquant: state section {kind}.codebook holds {len(raw)} bytes, not whole "
                                     f"{levels}-level float32 codebooks (bits={self.bits})")
            books[kind] = tensor_from_bytes(raw, torch.float32, (len(raw) // (4 * levels), levels)).numpy()
        self._codebooks = books

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def _codebook(self, kind: str, n_layers: int) -> np.ndarray:
        if kind not in self._codebooks:
            raise ValueError("kvquant has no codebooks: call fit(calibration windows) first (or load its state)")
        cb = self._codebooks[kind]
        if cb.shape[0] != n_layers:
            raise ValueError(f"kvquant codebooks were fitted for {cb.shape[0]} layers; this KV has {n_layers}")
        return cb

    # ---- coding ----------------------------------------------------------------------------------------------

    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream:
        rope = self._rope(ctx.config, "the encoder's context") if self.pre_rope else None
        store = kv.k.dtype
        sections: dict[str, Section] = {}
        for kind in KINDS:
            x = self._key_rows(kv.k, rope, ctx.start) if kind == "k" else self._value_rows(kv.v)  # (L, M, n)
            L, M, n = x.shape
            rows = _split_outliers(x, outlier_count(self.outlier_fraction, n), store)
            codes = _quantize(rows.normalized(), self._codebook(kind, L))  # (L, M, n)
            sections[f"{kind}.codes"] = pack_codes(codes, self.bits)
            sections[f"{kind}.center"] = tensor_to_bytes(rows.center)
            sections[f"{kind}.range"] = tensor_to_bytes(rows.half_range)
            sections[f"{kind}.outliers"] = tensor_to_bytes(rows.out_val)
            sections[f"{kind}.outlier_pos"] = pack_codes(rows.out_idx.numpy(), index_bits(n))
        return Bitstream.pack(self.name, sections)

    def _decode_rows(self, sec: Mapping[str, bytes], kind: str, shape: tuple[int, int, int], store: torch.dtype) -> np.ndarray:
        L, M, n = shape
        k = outlier_count(self.outlier_fraction, n)
        for part in ("codes", "center", "range", "outliers", "outlier_pos"):
            if f"{kind}.{part}" not in sec:
                raise BitstreamError(f"kvquant bitstream has no section {kind}.{part!r}")
        codes = unpack_codes(sec[f"{kind}.codes"], self.bits, L * M * n).numpy().reshape(L, M, n)
        c = tensor_from_bytes(sec[f"{kind}.center"], store, (L, M)).float().numpy()[..., None]
        r = tensor_from_bytes(sec[f"{kind}.range"], store, (L, M)).float().numpy()[..., None]
        x = _centroids(codes, self._codebook(kind, L))  # (L, M, n)
        x *= r
        x += c
        if k:
            pos = unpack_codes(sec[f"{kind}.outlier_pos"], index_bits(n), L * M * k).numpy().astype(np.int64)
            if pos.size and pos.max() >= n:
                raise BitstreamError(f"kvquant: an outlier position {int(pos.max())} lies beyond the vector length {n}")
            flat = pos + np.repeat(np.arange(L * M, dtype=np.int64) * n, k)
            vals = tensor_from_bytes(sec[f"{kind}.outliers"], store, (L * M * k,)).float().numpy()
            x.reshape(-1)[flat] = vals
        return x

    def decode(self, bs: Bitstream, ctx: Context) -> KVSequence:
        sec = bs.sections(expect=self.name)
        L, H, T, D = ctx.shape
        store = ctx.dtype
        k = self._decode_rows(sec, "k", (L, H * D, T), store).reshape(L, H, D, T)  # channel-major
        if self.pre_rope:
            k = self._rope(ctx.config, "the decoder's context").apply(k, ctx.start)
        v = self._decode_rows(sec, "v", (L, T, H * D), store).reshape(L, T, H, D)
        return KVSequence(_to_store(k.transpose(0, 1, 3, 2), store),  # (L, H, T, D)
                          _to_store(v.transpose(0, 2, 1, 3), store))  # (L, H, T, D)
