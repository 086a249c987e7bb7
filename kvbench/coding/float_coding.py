"""Exact (bit-exact) coding of 16-bit floats given a real-valued prediction of each one.

A float16/bfloat16 pattern is mapped to a monotone integer code in ``[0, 65536)`` (sign-magnitude turned into
two's-complement order, as in Lindstrom & Isenburg, "Fast and Efficient Compression of Floating-Point Data",
IEEE TVCG 2006), so that code order is value order. Each code owns a cell of the real line (half-way to its
neighbours). The probability model is a Laplace *in value space* centred on the prediction ``mu`` with scale ``b``:
a code costs ``-log2`` of the mass of its cell. That mass is coded exactly as 16 binary decisions, most significant
bit of the code first; each decision's probability is the Laplace mass of the chosen half of the current interval
over the mass of the interval. Sign, exponent and mantissa thus cost what the prediction says they are worth:
a value far from its prediction pays for its mantissa at its own precision, one close to it pays almost nothing.

(A Laplace on the *difference of the integer codes* is the simpler alternative; on real KV it spends 1-2 bits per
element more whenever predictions cross zero or a binade, because the code grid is logarithmic.)

Encoder and decoder must compute bit-identical probabilities. Each probability is rounded to a multiple of
``2**-20`` before it reaches the coder, and every element goes through the same elementwise float64 arithmetic
whatever the batch, so a decoder working one token at a time sees what an encoder working on all tokens saw.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from kvbench.coding.entropy import StreamDecoder, StreamEncoder

N_CODES = 1 << 16
LEVELS = 16
#: probabilities are rounded to this grid and kept this far from 0 and 1
P_GRID = float(1 << 20)
#: elements x levels per encoder batch (memory: about 40 bytes each)
_BATCH = 1 << 22


def to_codes(x: torch.Tensor) -> np.ndarray:
    """Monotone integer code in ``[0, 65536)`` of every 16-bit float (``-0`` sorts just below ``+0``)."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"float coding needs a 16-bit float tensor, got {x.dtype}")
    b = x.contiguous().view(torch.int16).numpy().astype(np.int64)
    m = np.where(b >= 0, b, -(b & 0x7FFF) - 1)
    return m + (N_CODES >> 1)


def from_codes(codes: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`to_codes`."""
    m = np.asarray(codes, dtype=np.int64) - (N_CODES >> 1)
    bits = np.where(m >= 0, m, (-m - 1) | 0x8000)
    return torch.from_numpy(bits.astype(np.uint16).view(np.int16).copy()).view(dtype)


@lru_cache(maxsize=4)
def cell_edges(dtype: torch.dtype) -> np.ndarray:
    """``(65537,)`` float64: code ``i`` owns ``[edges[i], edges[i + 1])``; the outermost edges are infinite.

    Infinities and NaNs get finite stand-in values that continue the last finite spacing, so every cell has a
    positive width (a model may give them tiny mass but never zero).
    """
    v = from_codes(np.arange(N_CODES), dtype).double().numpy().copy()
    finite = np.isfinite(v)
    top, bottom = np.flatnonzero(finite)[[-1, 0]]
    v[top + 1 :] = v[top] + (v[top] - v[top - 1]) * np.arange(1, N_CODES - top)
    v[:bottom] = v[bottom] - (v[bottom + 1] - v[bottom]) * np.arange(bottom, 0, -1)
    edges = np.empty(N_CODES + 1)
    edges[1:-1] = 0.5 * (v[:-1] + v[1:])
    edges[0], edges[-1] = -np.inf, np.inf
    if not np.all(np.diff(edges) > 0):
        raise RuntimeError(f"cell edges of {dtype} are not strictly increasing")
    return edges


class _Bisection:
    """The 16 binary decisions for a batch of elements, carrying the Laplace tail mass at the interval's ends.

    Each end ``e`` is kept as ``g = F(e)`` below the centre and ``g = F(e) - 1`` at or above it, i.e. plus or
    minus its tail mass ``0.5 exp(-|z|)``, so a split needs the CDF at the new point only, and masses on one side
    of the centre are differences of tails that never cancel against 1. An interval so far out that its tails
    underflow to 0 gets 1/2 per level (such a value costs about 16 bits, never more). Encoder and decoder run this
    same code.
    """

    def __init__(self, mu: np.ndarray, b: np.ndarray, edges: np.ndarray) -> None:
        self.mu = np.nan_to_num(np.asarray(mu, dtype=np.float64), posinf=1e300, neginf=-1e300)
        self.inv_b = 1.0 / np.asarray(b, dtype=np.float64)
        self.edges = edges
        shape = self.mu.shape
        self.lo, self.hi = np.zeros(shape, dtype=np.int64), np.full(shape, N_CODES, dtype=np.int64)
        self.g_lo, self.g_hi = np.zeros(shape), np.zeros(shape)  # -inf and +inf: no tail beyond either
        self.up_lo, self.up_hi = np.zeros(shape, dtype=bool), np.ones(shape, dtype=bool)

    def p_upper(self) -> np.ndarray:
        """P(code >= mid | lo <= code < hi), on the ``P_GRID`` grid and off 0 and 1."""
        self.mid = (self.lo + self.hi) >> 1
        z = (self.edges[self.mid] - self.mu) * self.inv_b
        self.up_mid = z >= 0
        self.g_mid = np.copysign(0.5 * np.exp(-np.abs(z)), -z)
        with np.errstate(invalid="ignore", divide="ignore"):
            # F(m) - F(a) over F(c) - F(a); the 1 comes back where an end crosses the centre
            num = self.g_mid - self.g_lo + (self.up_mid & ~self.up_lo)
            den = self.g_hi - self.g_lo + (self.up_hi & ~self.up_lo)
            p_upper = 1.0 - num / den
        np.nan_to_num(p_upper, copy=False, nan=0.5, posinf=0.5, neginf=0.5)
        return np.clip(np.round(p_upper * P_GRID), 1.0, P_GRID - 1.0) / P_GRID

    def take(self, up: np.ndarray) -> None:
        """Move to the chosen half: the split point becomes the lower end (``up``) or the upper end."""
        self.lo = np.where(up, self.mid, self.lo)
        self.hi = np.where(up, self.hi, self.mid)
        self.g_lo = np.where(up, self.g_mid, self.g_lo)
        self.g_hi = np.where(up, self.g_hi, self.g_mid)
        self.up_lo = self.up_lo ^ ((self.up_lo ^ self.up_mid) & up)
        self.up_hi = self.up_hi ^ ((self.up_hi ^ self.up_mid) & ~up)


def _rows(p_upper: np.ndarray) -> np.ndarray:
    rows = np.empty((p_upper.size, 2))  # (n, 2): P(bit=0), P(bit=1)
    rows[:, 1] = p_upper.reshape(-1)
    np.subtract(1.0, rows[:, 1], out=rows[:, 0])
    return rows


def encode_values(stream: StreamEncoder, x: torch.Tensor, mu: np.ndarray, b: np.ndarray) -> float:
    """Append units of 16-bit floats to ``stream``; return the model's ideal size in bits (sum of -log2 p).

    ``x`` is ``(C, N)``: ``C`` decoding units of ``N`` elements, in the order the decoder will ask for them; within a
    unit the stream holds level 0 of every element, then level 1, and so on. ``mu`` and ``b`` are ``(C, N)``.
    """
    C, N = x.shape
    codes = to_codes(x)  # (C, N)
    edges = cell_edges(x.dtype)
    mu, b = np.asarray(mu, dtype=np.float64), np.asarray(b, dtype=np.float64)
    rows_per_batch = max(1, _BATCH // max(1, N * LEVELS))
    ideal = 0.0
    for start in range(0, C, rows_per_batch):
        sl = slice(start, min(C, start + rows_per_batch))
        code, state = codes[sl], _Bisection(mu[sl], b[sl], edges)
        p_up = np.empty((code.shape[0], LEVELS, N))
        bits = np.empty((code.shape[0], LEVELS, N), dtype=np.int32)
        for level in range(LEVELS):
            p_up[:, level] = state.p_upper()
            up = code >= state.mid
            bits[:, level] = up
            state.take(up)
        stream.categorical(bits.reshape(-1), _rows(p_up))
        chosen = np.where(bits == 1, p_up, 1.0 - p_up)
        ideal -= float(np.log2(chosen, out=chosen).sum())
    return ideal


def decode_values(stream: StreamDecoder, mu: np.ndarray, b: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Read back one unit of ``N`` elements (``mu``, ``b``: ``(N,)``) as a 16-bit tensor ``(N,)``."""
    state = _Bisection(np.reshape(mu, -1), np.reshape(b, -1), cell_edges(dtype))
    for _ in range(LEVELS):
        state.take(stream.categorical(state.mu.size, _rows(state.p_upper())).astype(bool))
    return from_codes(state.lo, dtype)
