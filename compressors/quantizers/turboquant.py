"""TurboQuant: data-oblivious per-vector quantization (Zandieh, Daliri, Hadian, Mirrokni, arXiv 2504.19874).

Every K and V vector x (one layer, head and token; dimension d = head_dim) is coded on its own:

- **TQ_mse** (``variant=mse``): store ||x||; rotate the unit vector, u = Π x/||x||, with a seeded random rotation;
  quantize each coordinate of u with the ``bits``-bit Lloyd-Max codebook of the exact coordinate law of a uniform
  unit vector in d dimensions (:mod:`compressors.quantizers.sphere_codebook`). No per-block scales or zero points: the rotation
  makes every coordinate follow the same known law. Decoding is x̂ = ||x||·Πᵀ Q(u).
- **TQ_prod** (``variant=prod``): ``bits - 1`` bits of TQ_mse, then a 1-bit QJL sketch (m = d) of the rotated
  residual r = u - Q(u), stored as sign(S r) and ||r|| (:mod:`compressors.quantizers.qjl`). The inner-product estimate
  <q, x̂> is then unbiased, at the price of a larger squared error than TQ_mse at the same bits.

Fractional ``bits`` (2.5, 3.5, …) split the rotated coordinates into two groups coded at ⌊b⌋ and ⌈b⌉ bits, with
round((b - ⌊b⌋)·d) coordinates in the upper group (exact for b = 2.5 or 3.5 at even d; otherwise the rate is the
nearest achievable one). All coordinates are exchangeable after the rotation, so the upper group is simply the
first ones.

Charged per vector: the codes, the norm (``norm_bits``: 16 stores it as float16, 32 as float32) and, for TQ_prod,
m sign bits and ||r|| at the same precision; per sequence, the 32-bit seed from which the decoder regenerates
the rotation and S (so those cost 0 bits; so do the codebooks, which the decoder recomputes from (d, bits)).

``entropy_coding=true`` stores the same codes range-coded instead of packed at ``bits`` each. Lloyd-Max cells are
not equiprobable: under f_d the 3-bit codes carry about 2.8 bits of information and the 2-bit codes about 1.9, so
a coder modelled on each cell's probability under f_d (:attr:`compressors.quantizers.sphere_codebook.SphereCodebook.cell_probs`)
spends less while the reconstructions stay bit-identical. Encoder and decoder derive those probabilities from
(d, bits) alone, so the model costs 0 bits; the rotated coordinates of real KV only approximately follow f_d, and
any mismatch shows up as extra coded bits (the model's own estimate, sum of -log2 p, is reported in
:meth:`TurboQuant.stats` next to the coded size). Not in the paper, which stores codes at fixed length.

``rotation=hadamard`` (randomized Walsh–Hadamard, see :mod:`compressors.quantizers.rotation`) needs a power-of-two
head_dim; for any other head_dim encode **raises** a ValueError that points to ``rotation=orthogonal`` rather than
silently switching rotations, so a run's recorded configuration is always the one that produced its numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from compressors.quantizers.qjl import QJLSketch
from compressors.quantizers.rotation import RandomizedHadamard, RandomOrthogonal, is_power_of_two, make_rotation
from compressors.quantizers.scalar_codes import dequantize_packed, quantize
from compressors.quantizers.sphere_codebook import codebook
from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.coding.entropy import StreamDecoder, StreamEncoder
from kvbench.coding.packing import pack_codes, tensor_from_bytes, tensor_to_bytes
from kvbench.core.checks import check_choice, check_range
from kvbench.core.compressor import Compressor
from kvbench.core.kv import Context, KVSequence

_NORM_DTYPE = {16: torch.float16, 32: torch.float32}
_NORM_NUMPY = {16: np.float16, 32: np.float32}
_PLUS_MINUS = torch.tensor([-1.0, 1.0])  # a QJL sign bit as the value it stands for
#: cell probabilities are rounded to this grid before they reach the coder, so that last-bit differences in the
#: special functions between platforms cannot change the model an encoder and a decoder use
_PROB_GRID = float(1 << 40)


def code_model(probs: np.ndarray) -> np.ndarray:
    """The coder's probability row for a codebook's cell probabilities: on the ``_PROB_GRID`` grid, normalized."""
    p = np.round(np.asarray(probs, dtype=np.float64) * _PROB_GRID) / _PROB_GRID
    return p / p.sum()


@dataclass
class _Group:
    """Rotated coordinates [start, stop) quantized with one codebook."""

    start: int
    stop: int
    bits: int
    centroids: torch.Tensor  # (2**bits,) float32
    thresholds: torch.Tensor  # (2**bits - 1,) float32
    probs: np.ndarray  # (2**bits,) float64: each cell's probability under f_d, the entropy coder's model

    @property
    def width(self) -> int:
        return self.stop - self.start


@dataclass
class _Plan:
    """Everything derived from (head_dim, seed): rotation, codebooks, sketch. Rebuilt by the decoder, never stored."""

    d: int
    rotation: RandomizedHadamard | RandomOrthogonal
    groups: list[_Group]
    sketch: QJLSketch | None


def _float32_rows(x: torch.Tensor, d: int) -> np.ndarray:
    """``x`` as contiguous float32 rows of length d, converted in numpy (bfloat16 through its bit pattern)."""
    x = x.detach().cpu().reshape(-1, d)
    if x.dtype == torch.bfloat16:  # bfloat16 is the top half of a float32
        return (x.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    return np.ascontiguousarray(x.numpy(), dtype=np.float32)


def split_bits(bits: float, d: int) -> list[tuple[int, int]]:
    """``[(n_coords, bits), ...]`` for the upper then lower group; a whole ``bits`` gives one group."""
    lo = math.floor(bits)
    n_hi = round((bits - lo) * d)
    if n_hi == 0:
        return [(d, lo)]
    if n_hi == d:
        return [(d, lo + 1)]
    return [(n_hi, lo + 1), (d - n_hi, lo)]


@dataclass
class TurboQuant(Compressor):
    """TurboQuant (arXiv 2504.19874): per-vector norm + random rotation + Lloyd-Max scalar codes (+ QJL)."""

    bits: float = 3
    variant: str = "mse"
    rotation: str = "hadamard"
    norm_bits: int = 16
    seed: int = 0
    entropy_coding: bool = False

    name: ClassVar[str] = "turboquant"
    family: ClassVar[str] = "quantizer"
    max_rel_mse: ClassVar[float] = 0.06  # 3 bits: 0.030 (K), 0.031 (V) measured, the paper's 0.03

    def label(self) -> str:
        return f"{self.name} (range-coded)" if self.entropy_coding else self.name

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, (int, float)):
            raise ValueError(f"turboquant.bits={self.bits!r} must be a number in [1, 8] (fractions like 2.5 allowed)")
        check_range("turboquant", "bits", self.bits, 1, 8)
        check_choice("turboquant", "variant", self.variant, ("mse", "prod"))
        check_choice("turboquant", "rotation", self.rotation, ("hadamard", "orthogonal"))
        check_choice("turboquant", "norm_bits", self.norm_bits, tuple(_NORM_DTYPE))
        check_range("turboquant", "seed", self.seed, 0, 2**32 - 1, integer=True)
        self.seed = int(self.seed)
        if not isinstance(self.entropy_coding, bool):
            raise ValueError(f"turboquant.entropy_coding={self.entropy_coding!r} must be true or false")
        self._plans: dict[tuple[int, int], _Plan] = {}
        self._stats: dict[str, float] = {}

    # ---- derived state -------------------------------------------------------------------------------------

    @property
    def mse_bits(self) -> float:
        """Bits per coordinate spent on the scalar codes (TQ_prod gives one of them to the QJL sketch)."""
        return self.bits - 1 if self.variant == "prod" else self.bits

    def effective_bits(self, d: int) -> float:
        """Code bits per element at head_dim ``d`` (without norms), after rounding the fractional split."""
        code = sum(n * b for n, b in split_bits(self.mse_bits, d)) / d
        return code + (1 if self.variant == "prod" else 0)

    def _plan(self, d: int, seed: int) -> _Plan:
        key = (d, seed)
        if key not in self._plans:
            if self.rotation == "hadamard" and not is_power_of_two(d):
                raise ValueError(
                    f"turboquant.rotation=hadamard needs a power-of-two head_dim, got head_dim={d}; "
                    "use compressor.rotation=orthogonal (a dense random rotation) for this model"
                )
            if d < 2:
                raise ValueError(f"turboquant needs head_dim >= 2, got {d}")
            groups, start = [], 0
            for n, b in split_bits(self.mse_bits, d):
                cb = codebook(d, b)
                groups.append(_Group(start, start + n, b, torch.tensor(cb.centroids, dtype=torch.float32),
                                     torch.tensor(cb.thresholds, dtype=torch.float32), code_model(cb.cell_probs)))
                start += n
            sketch = QJLSketch(d, d, seed) if self.variant == "prod" else None
            self._plans[key] = _Plan(d, make_rotation(self.rotation, d, seed), groups, sketch)
        return self._plans[key]

    def fit(self, calib: list[KVSequence], config: Any = None) -> None:
        """Nothing to learn (the method is data-oblivious); builds the codebooks and rotation ahead of timing."""
        for kv in calib[:1]:
            self._plan(kv.shape[-1], self.seed)

    # ---- coding --------------------------------------------------------------------------------------------

    @staticmethod
    def _dequantize(plan: _Plan, packed: list[bytes | np.ndarray | None], n: int) -> np.ndarray:
        """Centroids of each group's codes, laid side by side: (N, d) float32 (0-bit groups give 0). A group's codes
        are packed bytes or, after entropy decoding, an integer array."""
        parts = [
            np.zeros((n, g.width), dtype=np.float32) if raw is None
            else dequantize_packed(raw, g.bits, n * g.width, g.centroids).numpy().reshape(n, g.width)
            if isinstance(raw, bytes)
            else np.take(g.centroids.numpy(), raw).reshape(n, g.width)
            for g, raw in zip(plan.groups, packed)
        ]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)

    def _code_group(self, kind: str, g: _Group, codes: torch.Tensor) -> tuple[bytes | tuple[bytes, int], bytes | np.ndarray]:
        """One group's codes (N, width) as a section, and what :meth:`_dequantize` reads back from it."""
        if not self.entropy_coding:
            raw, nbits = pack_codes(codes, g.bits)
            return (raw, nbits), raw
        flat = codes.numpy().reshape(-1)
        enc = StreamEncoder()
        enc.categorical(flat, g.probs)
        counts = np.bincount(flat, minlength=len(g.probs))
        key = f"{kind}.codes{g.bits}.model_bits"
        self._stats[key] = self._stats.get(key, 0.0) + float(-(counts * np.log2(np.maximum(g.probs, 1 / _PROB_GRID))).sum())
        return enc.finish(), flat

    def _read_group(self, sec: dict[str, bytes], kind: str, g: _Group, n: int) -> bytes | np.ndarray:
        raw = self._section(sec, f"{kind}.codes{g.bits}")
        if not self.entropy_coding:
            return raw
        dec = StreamDecoder(raw)
        codes = dec.categorical(n * g.width, g.probs)
        dec.finish(f"turboquant {kind}.codes{g.bits}")
        return codes

    def stats(self) -> dict[str, float]:
        """With entropy coding: the model's own estimate of each code section's size (sum of -log2 p under f_d's
        cell probabilities), summed over the sequences coded, to set beside the coded size."""
        return dict(self._stats)

    # Elementwise work runs in numpy (single-threaded); torch does only the matmuls and the final cast. On a
    # shared 2-core machine every torch parallel region waits for its second thread to be scheduled, which made
    # the elementwise torch version 3x slower under load than the same work on one thread.

    def _encode_part(self, kind: str, x: torch.Tensor, plan: _Plan) -> dict[str, bytes | tuple[bytes, int]]:
        d = plan.d
        x32 = _float32_rows(x, d)  # (N, d)
        n = x32.shape[0]
        norm = np.sqrt(np.einsum("ij,ij->i", x32, x32))  # (N,)
        with np.errstate(over="ignore"):  # an overflow is reported below, with what to do about it
            stored = norm.astype(_NORM_NUMPY[self.norm_bits])
        if not np.isfinite(stored).all():
            if not np.isfinite(norm).all():
                raise ValueError(f"turboquant: the {kind} cache has non-finite values (inf or nan); nothing to quantize")
            raise ValueError(f"turboquant: a {kind} vector's norm exceeds the float16 maximum 65504; "
                             "use compressor.norm_bits=32 to store norms as float32")
        inv = np.divide(1.0, norm, out=np.zeros_like(norm), where=norm > 0)  # a zero vector stays zero
        y = plan.rotation.forward(torch.from_numpy(x32)).numpy()  # (N, d)
        y *= inv[:, None]  # rotated unit vectors
        out: dict[str, bytes | tuple[bytes, int]] = {f"{kind}.norm": tensor_to_bytes(torch.from_numpy(stored))}
        packed: list[bytes | np.ndarray | None] = []
        for g in plan.groups:
            if g.bits == 0:
                packed.append(None)
                continue
            codes = quantize(torch.from_numpy(y[:, g.start : g.stop]), g.thresholds)  # (N, width) uint8
            out[f"{kind}.codes{g.bits}"], stored = self._code_group(kind, g, codes)
            packed.append(stored)
        if plan.sketch is not None:
            r = y - self._dequantize(plan, packed, n)  # (N, d) residual of the unit vector
            r_norm = np.sqrt(np.einsum("ij,ij->i", r, r)).astype(_NORM_NUMPY[self.norm_bits])  # (N,)
            out[f"{kind}.qjl"] = pack_codes(plan.sketch.signs(torch.from_numpy(r)), 1)
            out[f"{kind}.residual_norm"] = tensor_to_bytes(torch.from_numpy(r_norm))
        return out

    def _decode_part(self, kind: str, sec: dict[str, bytes], plan: _Plan, n: int, dtype: torch.dtype) -> torch.Tensor:
        ndt = _NORM_DTYPE[self.norm_bits]
        packed = [None if g.bits == 0 else self._read_group(sec, kind, g, n) for g in plan.groups]
        y = self._dequantize(plan, packed, n)  # (N, d)
        norm = tensor_from_bytes(self._section(sec, f"{kind}.norm"), ndt, (n,)).numpy().astype(np.float32)  # (N,)
        if plan.sketch is not None:
            m = plan.sketch.m
            signs = dequantize_packed(self._section(sec, f"{kind}.qjl"), 1, n * m, _PLUS_MINUS).view(n, m)  # ±1
            r_norm = tensor_from_bytes(self._section(sec, f"{kind}.residual_norm"), ndt, (n,))
            y += plan.sketch.reconstruct(signs, r_norm).numpy()
        y *= norm[:, None]
        return plan.rotation.inverse(torch.from_numpy(y)).to(dtype)  # (N, d)

    @staticmethod
    def _section(sec: dict[str, bytes], name: str) -> bytes:
        if name not in sec:
            raise BitstreamError(f"turboquant bitstream has no section {name!r} (written with other settings?)")
        return sec[name]

    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream:
        plan = self._plan(kv.shape[-1], self.seed)
        sections: dict[str, bytes | tuple[bytes, int]] = {"seed": self.seed.to_bytes(4, "little")}
        sections.update(self._encode_part("k", kv.k, plan))
        sections.update(self._encode_part("v", kv.v, plan))
        return Bitstream.pack(self.name, sections)

    def decode(self, bs: Bitstream, ctx: Context) -> KVSequence:
        sec = bs.sections(expect=self.name)
        seed = self._section(sec, "seed")
        if len(seed) != 4:
            raise BitstreamError(f"turboquant seed section holds {len(seed)} bytes, not 4")
        plan = self._plan(ctx.head_dim, int.from_bytes(seed, "little"))
        L, H, T, D = ctx.shape
        n = L * H * T
        k = self._decode_part("k", sec, plan, n, ctx.dtype).view(L, H, T, D)
        v = self._decode_part("v", sec, plan, n, ctx.dtype).view(L, H, T, D)
        return KVSequence(k, v)
