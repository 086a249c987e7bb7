"""The kept positions of an eviction stream: which of the ``T`` tokens every (layer, KV head) keeps, entropy coded.

Every row keeps the same count ``k``. The positions are coded as whichever of two encodings is smaller for the
stream, a flag in the header saying which: the bitmask under the Bernoulli model the kept count fixes, or the gaps
between kept positions (cheap where kept tokens come in runs: sinks, windows, pooled neighbourhoods).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from kvbench.coding.bitstream import BitstreamError, read_varints, varints
from kvbench.coding.entropy import StreamDecoder, StreamEncoder
from kvbench.coding.packing import pack_codes, unpack_codes
from kvbench.core.compressor import Section

#: how the kept positions of a stream are coded (the flag in the header)
MASK, GAPS, ALL = 0, 1, 2


def _bit_length(x: np.ndarray) -> np.ndarray:
    return np.frexp(x.astype(np.float64))[1].astype(np.int64)  # exact for integers below 2**53; 0 -> 0


@dataclass(frozen=True)
class CodedPositions:
    """The kept positions of a stream: the header (kept count, flag, coder model) and the coded sections."""

    header: bytes
    sections: dict[str, Section]
    flag: int

    @property
    def bits(self) -> int:
        return 8 * len(self.header) + sum(8 * len(s) if isinstance(s, (bytes, bytearray)) else s[1]
                                          for s in self.sections.values())


def _code_mask(mask: np.ndarray, k: int) -> CodedPositions:
    """Every row's bitmask, range-coded under the Bernoulli model ``P(kept) = k / T`` that the kept count fixes
    (about ``log2 C(T, k)`` bits a row, the cost of a uniformly random choice: 0 bits of model side information)."""
    T = mask.shape[1]
    enc = StreamEncoder()
    enc.categorical(mask.reshape(-1).astype(np.int32), np.array([1 - k / T, k / T]))
    return CodedPositions(varints([k, MASK]), {"positions": enc.finish()}, MASK)


def _gaps(mask: np.ndarray, k: int) -> np.ndarray:
    pos = np.nonzero(mask)[1].reshape(mask.shape[0], k)  # (R, k), increasing within each row
    return np.diff(pos, axis=1, prepend=-1) - 1  # (R, k) tokens skipped before each kept one


def _code_gaps(mask: np.ndarray, k: int) -> CodedPositions:
    """Gaps between kept positions (tokens skipped before each kept one), Elias-gamma style: the gap's bit length
    range-coded under the stream's own histogram of bit lengths (sent in the header), then its bits below the
    leading one, stored as they are. Runs of kept tokens (sinks, windows, pooled neighbourhoods) are gaps of 0 and
    cost a fraction of a bit each; the gap after the last kept token is implied by ``T``."""
    T = mask.shape[1]
    g = _gaps(mask, k).reshape(-1)  # (R * k,)
    length = _bit_length(g)  # (R * k,) 0 for a gap of 0
    counts = np.bincount(length, minlength=int(_bit_length(np.array([T - k]))[0]) + 1)
    enc = StreamEncoder()
    enc.categorical(length.astype(np.int32), counts / counts.sum())
    low = _low_bits(g, length)
    return CodedPositions(varints([k, GAPS, *counts.tolist()]),
                          {"positions": enc.finish(), "positions.low_bits": pack_codes(low, 1)}, GAPS)


def _low_bits(g: np.ndarray, length: np.ndarray) -> np.ndarray:
    width = np.maximum(length - 1, 0)  # (N,) bits below the leading one
    j = np.arange(max(int(width.max(initial=0)), 1))
    bits = (g[:, None] >> j) & 1  # (N, W)
    return bits[j < width[:, None]].astype(np.uint8)  # gap by gap, low bit first


def encode_positions(kept: torch.Tensor) -> CodedPositions:
    """The kept positions ``(L, H, T)`` bool (the same count in every row) in whichever of the bitmask and the gap
    code is smaller, counting the header of each."""
    L, H, T = kept.shape
    mask = kept.reshape(L * H, T).numpy()
    k = int(mask[0].sum())
    if not (mask.sum(1) == k).all():
        raise ValueError("every (layer, KV head) must keep the same number of entries")
    if k == T:
        return CodedPositions(varints([k, ALL]), {}, ALL)
    return min(_code_mask(mask, k), _code_gaps(mask, k), key=lambda c: c.bits)


def decode_positions(header: bytes, sec: Mapping[str, bytes], shape: tuple[int, int, int]) -> torch.Tensor:
    """Inverse of :func:`encode_positions`: the kept mask ``(L, H, T)``."""
    L, H, T = shape
    R = L * H
    (k, flag), at = read_varints(header, 2)
    if not 1 <= k <= T or flag not in (MASK, GAPS, ALL):
        raise BitstreamError(f"eviction header says {k} kept of {T} tokens with position code {flag}")
    if flag == ALL:
        if k != T:
            raise BitstreamError(f"eviction header says every token is kept but only {k} of {T}")
        return torch.ones(L, H, T, dtype=torch.bool)
    if "positions" not in sec:
        raise BitstreamError("eviction bitstream has no positions section")
    dec = StreamDecoder(sec["positions"])
    if flag == MASK:
        mask = dec.categorical(R * T, np.array([1 - k / T, k / T])).reshape(R, T).astype(bool)
    else:
        n_len = int(_bit_length(np.array([T - k]))[0]) + 1
        counts, _ = read_varints(header, n_len, at)
        counts = np.asarray(counts, dtype=np.int64)
        if counts.sum() != R * k:
            raise BitstreamError(f"eviction gap histogram counts {counts.sum()} gaps; expected {R * k}")
        length = dec.categorical(R * k, counts / counts.sum()).astype(np.int64)  # (R * k,)
        width = np.maximum(length - 1, 0)
        low = unpack_codes(sec.get("positions.low_bits", b""), 1, int(width.sum())).numpy().astype(np.int64)
        j = np.arange(max(int(width.max(initial=0)), 1))
        below = j < width[:, None]  # (N, W)
        bits = np.zeros(below.shape, dtype=np.int64)
        bits[below] = low
        g = np.where(length > 0, np.left_shift(1, np.maximum(length - 1, 0)) + (bits << j).sum(1), 0)
        pos = np.cumsum(g.reshape(R, k) + 1, axis=1) - 1  # (R, k)
        if pos[:, -1].max() >= T:
            raise BitstreamError(f"eviction positions run past the {T} tokens of the sequence")
        mask = np.zeros((R, T), dtype=bool)
        np.put_along_axis(mask, pos, True, axis=1)
    dec.finish("eviction positions")
    if not (mask.sum(1) == k).all():
        raise BitstreamError(f"eviction positions do not keep {k} entries in every (layer, KV head)")
    return torch.from_numpy(mask).reshape(L, H, T)
