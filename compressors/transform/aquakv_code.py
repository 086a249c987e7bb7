"""AQUA-KV's residual code (arXiv 2501.19392, with TurboQuant_mse in place of HIGGS): the scalar code of rotated
vectors that every layer's residual goes through, the closed-loop step that codes one layer's residual and
reconstructs it as the decoder will, and the per-layer slices of the stream. The method is described in
:mod:`compressors.transform.aquakv`."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from compressors.quantizers.scalar_codes import dequantize_packed, quantize
from compressors.quantizers.sphere_codebook import codebook
from compressors.quantizers.turboquant import split_bits
from kvbench.coding.bitstream import BitstreamError
from kvbench.coding.packing import pack_codes


class ScalarCode:
    """TurboQuant_mse's code for rotated vectors of length ``d`` at ``bits`` per coordinate: a float16 norm per
    vector and the Lloyd-Max code of the unit vector's coordinates under their law on the sphere. Fractional
    ``bits`` split the coordinates into two groups (:func:`compressors.quantizers.turboquant.split_bits`)."""

    def __init__(self, d: int, bits: float) -> None:
        self.d = d
        self.groups: list[tuple[int, int, int, np.ndarray, torch.Tensor]] = []  # start, stop, bits, centroids, thresholds
        start = 0
        for n, b in split_bits(bits, d):
            cb = codebook(d, b)
            self.groups.append((start, start + n, b, cb.centroids.astype(np.float32),
                                torch.tensor(cb.thresholds, dtype=torch.float32)))
            start += n

    def code_bytes(self, n: int) -> list[tuple[int, int]]:
        """``[(bits, bytes)]`` of each group's packed codes for ``n`` vectors."""
        return [(b, -(-n * (stop - start) * b // 8)) for start, stop, b, _, _ in self.groups]

    def quantize(self, z: np.ndarray, what: str) -> tuple[bytes, list[tuple[int, bytes]], np.ndarray]:
        """Rotated rows ``z`` ``(n, d)`` float32 -> float16 norms, packed codes per group ``[(bits, bytes)]`` and the
        reconstruction ``(n, d)`` float32 (the decoder's arithmetic, so the two agree bit for bit)."""
        # in float64: a float32 sum's last bit depends on the machine's SIMD order, and float16 norms round it
        # differently every few thousand vectors; a float64 one's almost never
        z64 = z.astype(np.float64)
        norm = np.sqrt(np.einsum("ij,ij->i", z64, z64))  # (n,)
        with np.errstate(over="ignore"):  # an overflow is reported below
            stored = norm.astype(np.float16)
        if not np.isfinite(stored).all():
            if not np.isfinite(norm).all():
                raise ValueError(f"aquakv: the {what} residual has non-finite values (inf or nan); nothing to quantize")
            raise ValueError(f"aquakv: a {what} residual norm exceeds the float16 maximum 65504")
        inv = np.divide(1.0, norm, out=np.zeros_like(norm), where=norm > 0)  # a zero vector stays zero
        u = (z64 * inv[:, None]).astype(np.float32)  # (n, d) unit vectors
        rec = np.empty_like(z)
        codes = []
        for start, stop, b, centroids, thresholds in self.groups:
            q = quantize(torch.from_numpy(u[:, start:stop]), thresholds).numpy()  # (n, width) uint8
            codes.append((b, pack_codes(q, b)[0]))
            rec[:, start:stop] = np.take(centroids, q)
        rec *= stored.astype(np.float32)[:, None]
        return stored.tobytes(), codes, rec

    def dequantize(self, norms: bytes, codes: list[bytes], n: int) -> np.ndarray:
        """Inverse of :meth:`quantize`: ``(n, d)`` float32."""
        rec = np.empty((n, self.d), dtype=np.float32)
        for (start, stop, b, centroids, _), raw in zip(self.groups, codes):
            width = stop - start
            rec[:, start:stop] = dequantize_packed(raw, b, n * width, torch.from_numpy(centroids)).numpy().reshape(n, width)
        rec *= np.frombuffer(norms, dtype="<f2").astype(np.float32)[:, None]
        return rec


def reconstruction(mu: np.ndarray | None, rec: np.ndarray) -> np.ndarray:
    """A layer's reconstruction from its prediction (None: nothing predicted) and its decoded residual."""
    return rec if mu is None else mu + rec


def code_layer(code: ScalarCode, target: np.ndarray, mu: np.ndarray | None,
               kind: str) -> tuple[np.ndarray, bytes, list[tuple[int, bytes]], np.ndarray]:
    """The closed-loop step of one layer and kind: the residual of ``target`` ``(T, H·D)`` from the prediction
    ``mu`` (None: none), quantized. Returns the residual, its norms and codes, and the reconstruction the decoder
    will compute from them."""
    res = target if mu is None else target - mu
    norms, codes, rec = code.quantize(res.reshape(-1, code.d), kind)
    return res, norms, codes, reconstruction(mu, rec.reshape(res.shape))


class LayerReader:
    """Consecutive per-layer slices of the stream's concatenated sections."""

    def __init__(self, sec: Mapping[str, bytes]) -> None:
        self.sec, self.pos = sec, dict.fromkeys(sec, 0)

    def take(self, name: str, n: int) -> bytes:
        if name not in self.sec:
            raise BitstreamError(f"aquakv bitstream has no section {name!r} (written with other settings?)")
        start = self.pos[name]
        if start + n > len(self.sec[name]):
            raise BitstreamError(f"aquakv bitstream section {name!r} is too short for this cache shape")
        self.pos[name] = start + n
        return self.sec[name][start : start + n]

    def finish(self) -> None:
        left = [name for name, pos in self.pos.items() if pos != len(self.sec[name])]
        if left:
            raise BitstreamError(f"aquakv bitstream sections {left} are longer than this cache shape needs")
