"""The ``planes`` exact coder of delta coding's residuals: each 16-bit value as the zigzag difference of its bit
pattern from its prediction's, or as itself where its channel codes cheaper without the prediction, both bytes
through the byte-plane coder (:mod:`compressors.exact.plane_coder`). How and why is described in
:mod:`compressors.predictive.residual`, whose :class:`~compressors.predictive.residual.ResidualCoder` uses it."""

from __future__ import annotations

import numpy as np
import torch

from compressors.exact.plane_coder import (
    PlaneHeader,
    channel_counts,
    decode_plane,
    encode_plane,
    field_shift,
    from_planes,
    to_planes,
)
from compressors.predictive.delta_predictors import Predictor
from kvbench.coding.bitstream import BitstreamError
from kvbench.coding.entropy import StreamDecoder, StreamEncoder
from kvbench.coding.packing import pack_codes, unpack_codes


def bit_patterns(x: torch.Tensor) -> np.ndarray:
    """The 16-bit patterns of a 16-bit float tensor, uint16, same shape."""
    return x.detach().contiguous().cpu().view(torch.int16).numpy().view(np.uint16)


def from_bit_patterns(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`bit_patterns`."""
    return torch.from_numpy(np.ascontiguousarray(bits, dtype=np.uint16).view(np.int16)).view(dtype)


def zigzag(d: np.ndarray) -> np.ndarray:
    """Differences of 16-bit patterns (uint16, i.e. modulo 2**16) -> 0, -1, 1, -2, ... mapped to 0, 1, 2, 3, ..."""
    s = d.view(np.int16)
    return ((s << 1) ^ (s >> 15)).view(np.uint16)  # s >> 15 is -1 for a negative s (arithmetic shift)


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of :func:`zigzag`, modulo 2**16."""
    return (z >> 1) ^ ((z & 1) * np.uint16(0xFFFF))


def prediction_bits(x: torch.Tensor, pred: Predictor) -> np.ndarray:
    """Bit patterns ``(L, H, T, D)`` uint16 of every prediction rounded to the cache dtype, from the exact cache.

    A predictor that copies the previous token predicts its bit pattern (0, i.e. +0.0, at token 0): what rounding
    its float64 copy gives too, except for a signalling NaN, which the round trip through float64 quiets; the
    decoder's cumulative sum depends on the copy being exact."""
    if pred.copies_previous_token:
        base = np.zeros(x.shape, dtype=np.uint16)
        base[:, :, 1:] = bit_patterns(x)[:, :, :-1]
        return base
    return bit_patterns(pred.predict_all(x).to(x.dtype))


def channel_bits(counts: np.ndarray, shift: int) -> np.ndarray:
    """Two-part code length (Rissanen's MDL) of each channel's bytes ``(C, 256)`` under its own histogram:
    ``n H`` of the empirical distribution plus ``log2(n) / 2`` per further occupied bin (of the ``256 >> shift``
    fields the histograms are stored over); ``(C,)``. What picks each channel's mode, not what is coded."""
    n = counts.sum(1)
    c_log_c = np.arange(int(n.max(initial=0)) + 1, dtype=np.float64)
    c_log_c *= np.log2(np.maximum(c_log_c, 1))  # c log2 c for every count that can occur: one lookup per bin
    data = c_log_c[n] - c_log_c[counts].sum(1)
    bins = (counts.reshape(len(counts), 256 >> shift, 1 << shift).sum(2) > 0).sum(1)
    return data + 0.5 * np.maximum(bins - 1, 0) * np.log2(np.maximum(n, 2))


def encode_planes(x: torch.Tensor, pred: Predictor) -> tuple[bytes, float]:
    """The exact ``planes`` residual section of one kind ``(L, H, T, D)`` and the model's estimate of its bits."""
    L, H, T, D = x.shape
    z = zigzag(bit_patterns(x) - prediction_bits(x, pred))  # (L, H, T, D) uint16
    resid = ((z >> 8).astype(np.uint8), z.astype(np.uint8))  # how far the prediction is off, high byte first
    value = to_planes(x, "exponent")  # the bytes of a prediction of zero, exponent whole in the first
    shifts = (field_shift(x.dtype, "exponent", 0), 0)
    counts = [(channel_counts(a), channel_counts(b)) for a, b in zip(resid, value)]  # per plane, (L*H*D, 256) each
    # each channel's mode by its own two-part code length; a second plane is at worst stored as it is
    cost = [sum(np.minimum(channel_bits(c[j], s), 8.0 * T) for c, s in zip(counts, shifts)) for j in (0, 1)]
    use = cost[0] < cost[1]  # (L*H*D,)
    m = use.reshape(L, H, 1, D)
    stream = StreamEncoder()
    heads, ideal, verbatim = [], 0.0, []
    for r_plane, v_plane, (c_resid, c_value), s in zip(resid, value, counts, shifts):
        plane = np.where(m, r_plane, v_plane)  # (L, H, T, D) uint8
        head, bits = encode_plane(plane, s, "auto", stream, stream, np.where(use[:, None], c_resid, c_value))
        heads.append(head)
        ideal += bits
        if head.grouping == "raw":
            verbatim.append(plane.tobytes())
    front = pack_codes(torch.from_numpy(use), 1)[0] + b"".join(h.to_bytes() for h in heads)
    return front + stream.finish()[0] + b"".join(verbatim), ideal + 8 * len(front)


def decode_planes(raw: bytes, pred: Predictor, shape, dtype: torch.dtype, owner: str) -> torch.Tensor:
    """Inverse of :func:`encode_planes`: the cache of one kind ``(L, H, T, D)`` in ``dtype``."""
    L, H, T, D = shape
    n, n_modes = L * H * T * D, -(-L * H * D // 8)
    if len(raw) < n_modes:
        raise BitstreamError(f"{owner}: residual section is truncated")
    use = unpack_codes(raw[:n_modes], 1, L * H * D).bool()  # (L*H*D,)
    shift = field_shift(dtype, "exponent", 0)
    heads, pos = [], n_modes
    for s in (shift, 0):
        head, pos = PlaneHeader.read(raw, pos, s, owner)
        heads.append(head)
    end = len(raw) - n * sum(h.grouping == "raw" for h in heads)
    coded = any(h.grouping != "raw" for h in heads)
    if end < pos or (end - pos) % 4 or coded != (end > pos):
        raise BitstreamError(f"{owner}: residual section has {len(raw)} bytes, which its plane headers do not account for")
    stream = StreamDecoder(raw[pos:end])
    planes = []
    for head, s in zip(heads, (shift, 0)):
        if head.grouping == "raw":
            planes.append(np.frombuffer(raw, dtype=np.uint8, count=n, offset=end).reshape(shape).copy())
            end += n
        else:
            planes.append(decode_plane(head, shape, s, stream, stream))
    stream.finish(f"{owner} residual")
    m = use.numpy().reshape(L, H, 1, D)
    value = bit_patterns(from_planes(*planes, dtype, "exponent"))  # (L, H, T, D) uint16
    if not m.any():
        return from_bit_patterns(value, dtype)
    r = unzigzag((planes[0].astype(np.uint16) << 8) | planes[1])  # (L, H, T, D) uint16: residuals modulo 2**16
    if pred.copies_previous_token:
        # x_t = x_{t-1} + r_t (mod 2**16) from x_{-1} = +0.0: a cumulative sum of residuals along the tokens
        return from_bit_patterns(np.where(m, np.cumsum(r, axis=2, dtype=np.uint16), value), dtype)
    # value channels are known now; residual channels unit by unit, each from the reconstruction so far
    recon = from_bit_patterns(np.where(m, 0, value), dtype)
    flat = recon.view(-1)
    index = torch.arange(n).reshape(shape)
    r32 = torch.from_numpy(r.astype(np.int32))
    mask = torch.from_numpy(np.broadcast_to(m, shape).copy())
    for g, (idx, rg, mg) in enumerate(zip(pred.groups(index), pred.groups(r32), pred.groups(mask))):
        for c in range(idx.shape[0]):
            sel = idx[c][mg[c]]
            if sel.numel():
                base = torch.from_numpy(bit_patterns(pred.predict(recon, g, c).to(dtype)).astype(np.int32))  # (N,)
                flat[sel] = from_bit_patterns(((base + rg[c])[mg[c]] & 0xFFFF).numpy().astype(np.uint16), dtype)
    return recon
