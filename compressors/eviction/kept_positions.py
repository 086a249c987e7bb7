"""The kept positions of an eviction stream: which of the ``T`` tokens every (layer, KV head) keeps, entropy coded.

The positions are coded as whichever of two encodings is smaller for the stream, a flag in the header saying
which: the bitmask under the Bernoulli model the kept count fixes, or the gaps between kept positions (cheap where
kept tokens come in runs: sinks, windows, pooled neighbourhoods).

Header, varints: ``k, flag`` where every row keeps the same count ``k`` (most methods), then the gap code's
histogram of bit lengths. A method whose rows keep different counts (AdaKV's heads sharing a layer's budget,
PyramidKV's layers, KVzip's whole-cache selection) sets :data:`PER_ROW` in the flag, writes the largest count as
``k`` and then every row's count, layer by layer and head by head: the decoder needs them to know where a row's
gaps end, and the bitmask is coded under each row's own Bernoulli model (rows that keep nothing or everything cost
no bits beyond their count).
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
#: set in the flag when the rows keep different counts and the header lists them
PER_ROW = 4


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


def _row_models(counts: np.ndarray, T: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """The rows whose bitmask is not fixed by their count (``0 < k_r < T``) and each one's Bernoulli model."""
    open_rows = np.nonzero((counts > 0) & (counts < T))[0]
    return open_rows, [np.array([1 - counts[r] / T, counts[r] / T]) for r in open_rows]


def _code_mask_rows(mask: np.ndarray, counts: np.ndarray) -> CodedPositions:
    """:func:`_code_mask` with each row under the model its own count fixes, the counts in the header."""
    T = mask.shape[1]
    open_rows, models = _row_models(counts, T)
    enc = StreamEncoder()
    enc.categorical_rows(mask[open_rows].astype(np.int32), models)
    header = varints([int(counts.max()), MASK | PER_ROW, *counts.tolist()])
    return CodedPositions(header, {"positions": enc.finish()}, MASK | PER_ROW)


def _gaps(mask: np.ndarray) -> np.ndarray:
    """Tokens skipped before each kept one, row by row (a row's first gap counts from its start): ``(N,)``."""
    rows, cols = np.nonzero(mask)  # (N,) each, row-major
    prev = np.concatenate([[-1], cols[:-1]])
    prev[np.concatenate([[True], rows[1:] != rows[:-1]])] = -1  # every row starts afresh
    return cols - prev - 1


def _max_gap_length(T: int, k_min: int) -> int:
    """Bit lengths a gap can take in a row keeping at least ``k_min`` of ``T``: the histogram's size."""
    return int(_bit_length(np.array([T - k_min]))[0]) + 1


def _code_gaps(mask: np.ndarray, k: int) -> CodedPositions:
    """Gaps between kept positions (tokens skipped before each kept one), Elias-gamma style: the gap's bit length
    range-coded under the stream's own histogram of bit lengths (sent in the header), then its bits below the
    leading one, stored as they are. Runs of kept tokens (sinks, windows, pooled neighbourhoods) are gaps of 0 and
    cost a fraction of a bit each; the gap after the last kept token is implied by ``T``."""
    head, sections = _gap_sections(_gaps(mask), _max_gap_length(mask.shape[1], k))
    return CodedPositions(varints([k, GAPS, *head]), sections, GAPS)


def _code_gaps_rows(mask: np.ndarray, counts: np.ndarray) -> CodedPositions:
    """:func:`_code_gaps` for rows of different counts: the counts, then every row's gaps in turn."""
    k_min = int(counts[counts > 0].min())
    head, sections = _gap_sections(_gaps(mask), _max_gap_length(mask.shape[1], k_min))
    header = varints([int(counts.max()), GAPS | PER_ROW, *counts.tolist(), *head])
    return CodedPositions(header, sections, GAPS | PER_ROW)


def _gap_sections(g: np.ndarray, n_len: int) -> tuple[list[int], dict[str, Section]]:
    """The histogram of the gaps' bit lengths (for the header) and the coded sections."""
    length = _bit_length(g)  # (N,) 0 for a gap of 0
    counts = np.bincount(length, minlength=n_len)
    enc = StreamEncoder()
    enc.categorical(length.astype(np.int32), counts / counts.sum())
    return counts.tolist(), {"positions": enc.finish(), "positions.low_bits": pack_codes(_low_bits(g, length), 1)}


def _low_bits(g: np.ndarray, length: np.ndarray) -> np.ndarray:
    width = np.maximum(length - 1, 0)  # (N,) bits below the leading one
    j = np.arange(max(int(width.max(initial=0)), 1))
    bits = (g[:, None] >> j) & 1  # (N, W)
    return bits[j < width[:, None]].astype(np.uint8)  # gap by gap, low bit first


def encode_positions(kept: torch.Tensor) -> CodedPositions:
    """The kept positions ``(L, H, T)`` bool in whichever of the bitmask and the gap code is smaller, counting the
    header of each; the rows' counts go in the header where they differ."""
    L, H, T = kept.shape
    mask = kept.reshape(L * H, T).numpy()
    counts = mask.sum(1)  # (R,)
    if counts.max(initial=0) == 0:
        raise ValueError("an eviction stream must keep at least one entry")
    k = int(counts[0])
    if (counts == k).all():
        if k == T:
            return CodedPositions(varints([k, ALL]), {}, ALL)
        return min(_code_mask(mask, k), _code_gaps(mask, k), key=lambda c: c.bits)
    return min(_code_mask_rows(mask, counts), _code_gaps_rows(mask, counts), key=lambda c: c.bits)


def decode_positions(header: bytes, sec: Mapping[str, bytes], shape: tuple[int, int, int]) -> torch.Tensor:
    """Inverse of :func:`encode_positions`: the kept mask ``(L, H, T)``."""
    L, H, T = shape
    R = L * H
    (k, flag), at = read_varints(header, 2)
    if not 1 <= k <= T or flag not in (MASK, GAPS, ALL, MASK | PER_ROW, GAPS | PER_ROW):
        raise BitstreamError(f"eviction header says {k} kept of {T} tokens with position code {flag}")
    if flag == ALL:
        if k != T:
            raise BitstreamError(f"eviction header says every token is kept but only {k} of {T}")
        return torch.ones(L, H, T, dtype=torch.bool)
    counts = np.full(R, k, dtype=np.int64)
    if flag & PER_ROW:
        listed, at = read_varints(header, R, at)
        counts = np.asarray(listed, dtype=np.int64)
        if counts.max() != k:
            raise BitstreamError(f"eviction header lists row counts up to {counts.max()} of {T} tokens; it says {k}")
    if "positions" not in sec:
        raise BitstreamError("eviction bitstream has no positions section")
    dec = StreamDecoder(sec["positions"])
    if flag == MASK:
        mask = dec.categorical(R * T, np.array([1 - k / T, k / T])).reshape(R, T).astype(bool)
    elif flag == MASK | PER_ROW:
        mask = np.repeat(counts[:, None] == T, T, axis=1)  # (R, T) the rows that keep everything, and no others
        open_rows, models = _row_models(counts, T)
        mask[open_rows] = dec.categorical_rows(T, models).astype(bool)
    else:
        mask = _decode_gaps(dec, header, at, sec, counts, T)
    dec.finish("eviction positions")
    if not (mask.sum(1) == counts).all():
        raise BitstreamError("eviction positions do not keep the entries the header counts in every (layer, KV head)")
    return torch.from_numpy(mask).reshape(L, H, T)


def _decode_gaps(dec: StreamDecoder, header: bytes, at: int, sec: Mapping[str, bytes], counts: np.ndarray,
                 T: int) -> np.ndarray:
    """The ``(R, T)`` mask from the gap code, each row keeping ``counts[r]`` entries."""
    N = int(counts.sum())
    hist, _ = read_varints(header, _max_gap_length(T, int(counts[counts > 0].min())), at)
    hist = np.asarray(hist, dtype=np.int64)
    if hist.sum() != N:
        raise BitstreamError(f"eviction gap histogram counts {hist.sum()} gaps; expected {N}")
    length = dec.categorical(N, hist / hist.sum()).astype(np.int64)  # (N,)
    width = np.maximum(length - 1, 0)
    low = unpack_codes(sec.get("positions.low_bits", b""), 1, int(width.sum())).numpy().astype(np.int64)
    j = np.arange(max(int(width.max(initial=0)), 1))
    below = j < width[:, None]  # (N, W)
    bits = np.zeros(below.shape, dtype=np.int64)
    bits[below] = low
    g = np.where(length > 0, np.left_shift(1, width) + (bits << j).sum(1), 0)  # (N,)
    row = np.repeat(np.arange(counts.size), counts)  # (N,) the row of every kept entry
    run = np.cumsum(g + 1)  # (N,) positions + 1, counted across rows
    first = np.cumsum(counts) - counts  # (R,) index of each row's first entry
    base = np.zeros(counts.size, dtype=np.int64)
    later = (counts > 0) & (first > 0)
    base[later] = run[first[later] - 1]
    pos = run - base[row] - 1  # (N,) within each row
    if (pos >= T).any():
        raise BitstreamError(f"eviction positions run past the {T} tokens of the sequence")
    mask = np.zeros((counts.size, T), dtype=bool)
    mask[row, pos] = True
    return mask
