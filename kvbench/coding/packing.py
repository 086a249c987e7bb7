"""Turning tensors into real bytes and back, vectorised.

``pack_codes`` stores n b-bit codes (any b up to 64) in exactly ceil(n*b/8) bytes as one LSB-first bit stream:
code i occupies bits ``[i*b, (i+1)*b)``, its low bit first. For b <= 8, eight codes make b whole bytes, so each
group of eight is assembled in one uint64 lane and its low b bytes are kept; wider codes go through a bit matrix.
"""

from __future__ import annotations

import numpy as np
import torch

from kvbench.coding.bitstream import BitstreamError

_NUMPY_OF = {
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
}


def _check_width(bits: int) -> None:
    if not 0 <= bits <= 64 or int(bits) != bits:
        raise ValueError(f"code width must be a whole number of bits in 0..64, got {bits}")


def pack_codes(codes, bits: int) -> tuple[bytes, int]:
    """Pack integer codes in ``[0, 2**bits)`` (a tensor or array) densely. Returns ``(bytes, exact_bit_count)``;
    0-bit codes take no bytes."""
    _check_width(bits)
    if bits == 0:
        return b"", 0
    if bits > 8:
        v = np.asarray(codes).astype(np.uint64).reshape(-1)  # (n,)
        planes = ((v[:, None] >> np.arange(bits, dtype=np.uint64)) & np.uint64(1)).astype(np.uint8)  # (n, bits)
        return np.packbits(planes.reshape(-1), bitorder="little").tobytes(), v.size * bits
    flat = torch.as_tensor(codes).reshape(-1).to(torch.uint8).numpy()
    n = flat.size
    if n == 0:
        return b"", 0
    nbits = n * bits
    if bits == 1:  # the layout is an LSB-first bit stream: exactly numpy's little-endian packbits
        return np.packbits(flat, bitorder="little").tobytes(), nbits
    groups = -(-n // 8)
    if groups * 8 != n:
        flat = np.concatenate([flat, np.zeros(groups * 8 - n, dtype=np.uint8)])
    lanes = flat.reshape(groups, 8)  # (G, 8); widened one column at a time (no 8-byte copy of every code)
    wide, le = (np.uint32, "<u4") if bits <= 4 else (np.uint64, "<u8")  # 8 codes fit the narrower word
    word = lanes[:, 0].astype(wide)
    for i in range(1, 8):
        word |= lanes[:, i].astype(wide) << wide(bits * i)
    raw = word.astype(le, copy=False).view(np.uint8).reshape(groups, -1)[:, :bits]  # (G, bits)
    return raw.tobytes()[: -(-nbits // 8)], nbits


def unpack_codes(raw: bytes, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``n`` codes, uint8 up to 8 bits, int64 above (0-bit codes are zeros)."""
    _check_width(bits)
    if len(raw) != -(-n * bits // 8):
        raise BitstreamError(f"{len(raw)} bytes cannot hold exactly {n} codes of {bits} bits")
    if bits > 8:
        planes = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")[: n * bits].reshape(n, bits)
        weights = np.uint64(1) << np.arange(bits, dtype=np.uint64)
        return torch.from_numpy((planes.astype(np.uint64) * weights).sum(1, dtype=np.uint64).astype(np.int64))
    if n == 0 or bits == 0:
        return torch.zeros(n, dtype=torch.uint8)
    groups = -(-n // 8)
    buf = np.zeros(groups * bits, dtype=np.uint8)
    buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    padded = np.zeros((groups, 8), dtype=np.uint8)
    padded[:, :bits] = buf.reshape(groups, bits)
    word = padded.view("<u8").reshape(groups)
    mask = np.uint64((1 << bits) - 1)
    out = np.empty((groups, 8), dtype=np.uint8)
    for i in range(8):
        out[:, i] = (word >> np.uint64(bits * i)) & mask
    return torch.from_numpy(out.reshape(-1)[:n].copy())


def unpack_codes_tensor(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`unpack_codes` on a held uint8 tensor of whole bytes, in torch (a resident cache's per-layer read):
    every ``8 * len / bits`` code of ``packed`` as uint8, for widths 1..8 whose codes fill the bytes exactly."""
    _check_width(bits)
    n_bytes = packed.numel()
    if not 1 <= bits <= 8 or (n_bytes * 8) % bits or (bits not in (1, 2, 4, 8) and n_bytes % bits):
        raise ValueError(f"{n_bytes} bytes do not hold whole {bits}-bit codes in groups of 8")
    if bits == 8:
        return packed
    if 8 % bits == 0:  # whole codes per byte
        if n_bytes % 4 == 0 and packed.is_contiguous() and packed.storage_offset() % 4 == 0:
            # shifting little-endian 32-bit words is ~3x faster on the CPU than shifting bytes; same code order
            shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
            return ((packed.view(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8).reshape(-1)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(-1)
    lanes = packed.reshape(-1, bits).long()  # (G, bits): 8 codes in ``bits`` bytes
    word = (lanes << (8 * torch.arange(bits, device=packed.device))).sum(-1)  # (G,) little-endian
    shifts = bits * torch.arange(8, device=packed.device)
    return ((word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8).reshape(-1)


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a tensor (bfloat16 goes through its int16 bit pattern)."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    if t.dtype not in _NUMPY_OF:
        raise TypeError(f"cannot serialise dtype {t.dtype}")
    return t.numpy().astype(np.dtype(_NUMPY_OF[t.dtype]).newbyteorder("<"), copy=False).tobytes()


def tensor_from_bytes(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`tensor_to_bytes`."""
    store = torch.int16 if dtype == torch.bfloat16 else dtype
    np_dtype = np.dtype(_NUMPY_OF[store]).newbyteorder("<")
    expected = int(np.prod(shape)) * np_dtype.itemsize
    if len(raw) != expected:
        raise BitstreamError(f"{len(raw)} bytes for a {dtype} tensor of shape {tuple(shape)} (needs {expected})")
    arr = np.frombuffer(raw, dtype=np_dtype).astype(np_dtype.newbyteorder("="))
    t = torch.from_numpy(arr.copy()).reshape(shape)
    return t.view(dtype) if dtype == torch.bfloat16 else t
