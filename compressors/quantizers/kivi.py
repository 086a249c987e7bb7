"""KIVI: tuning-free asymmetric 2-bit quantization for KV cache (Liu et al., arXiv 2402.02750).

Keys are quantized per channel (min/max over a group of ``group_size`` tokens, for each channel) because key
outliers live in fixed channels; values per token (min/max over ``group_size`` channels of one token). The
``residual`` most recent tokens stay in 16 bit, and so do keys that do not yet fill a whole token group — as in
the paper's streaming cache. Codes are packed densely; scales, zero points and the 16-bit window are charged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvbench.coding.bitstream import Bitstream
from kvbench.coding.packing import pack_codes, tensor_from_bytes, tensor_to_bytes, unpack_codes, unpack_codes_tensor
from kvbench.core.checks import check_range
from kvbench.core.compressor import Compressor, Kept
from kvbench.core.kv import Context, KVSequence
from kvbench.core.resident import Layered


def uniform_quantize(x: torch.Tensor, dim: int, bits: int, store: torch.dtype):
    """Asymmetric min/max quantization along ``dim``.

    Returns ``(codes uint8, scale, zero)``; scale and zero are rounded to ``store`` *before* the codes are
    computed, so the decoder, which only sees the stored values, reconstructs exactly what the encoder meant.
    """
    levels = (1 << bits) - 1
    x = x.float()
    lo = x.amin(dim=dim, keepdim=True).to(store)
    hi = x.amax(dim=dim, keepdim=True)
    scale = ((hi - lo.float()) / levels).to(store)
    safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(hi))
    codes = torch.clamp(torch.round((x - lo.float()) / safe), 0, levels).to(torch.uint8)
    return codes, scale, lo


def uniform_dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``codes * scale + zero`` in float32 (one fused pass; the cache's per-layer read uses this same function)."""
    return torch.addcmul(zero.float(), codes.float(), scale.float())


@dataclass
class KIVI(Compressor):
    """KIVI (arXiv 2402.02750). Defaults follow the paper: 2 bits, group 32, 128 residual tokens."""

    bits: int = 2
    group_size: int = 32
    residual: int = 128

    name = "kivi"
    family = "quantizer"
    max_rel_mse = 0.15  # 2 bits, 128 tokens exact: 0.074 (K), 0.054 (V) measured

    def __post_init__(self) -> None:
        check_range("kivi", "bits", self.bits, 1, 8, integer=True)
        check_range("kivi", "group_size", self.group_size, 1, 1 << 16, integer=True)
        check_range("kivi", "residual", self.residual, 0, 1 << 30, integer=True)
        self.bits, self.group_size, self.residual = int(self.bits), int(self.group_size), int(self.residual)

    def exact_tokens(self, n_tokens: int) -> Kept:
        return Kept(recent=self.residual)

    def recent_window(self) -> int:
        return self.residual

    def without_recent_window(self) -> KIVI:
        return dataclasses.replace(self, residual=0) if self.residual else self

    def _split(self, ctx: Context) -> tuple[int, int, int]:
        """Tokens quantized for K (whole groups only), for V, and the value group width."""
        T, D = ctx.n_tokens, ctx.head_dim
        quant = max(T - self.residual, 0)
        gv = min(self.group_size, D)
        if D % gv:
            raise ValueError(f"kivi.group_size={self.group_size} must divide head_dim={D} (or be >= it)")
        return (quant // self.group_size) * self.group_size, quant, gv

    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream:
        L, H, T, D = kv.shape
        nk, nv, gv = self._split(ctx)
        G = self.group_size
        kq = kv.k[:, :, :nk].reshape(L, H, nk // G, G, D)  # (L, H, T/G, G, D): per channel over G tokens
        vq = kv.v[:, :, :nv].reshape(L, H, nv, D // gv, gv)  # (L, H, T, D/g, g): per token over g channels
        kc, ks, kz = uniform_quantize(kq, 3, self.bits, kv.k.dtype)
        vc, vs, vz = uniform_quantize(vq, 4, self.bits, kv.v.dtype)
        return Bitstream.pack(
            self.name,
            {
                "k.codes": pack_codes(kc, self.bits),
                "k.scale": tensor_to_bytes(ks),
                "k.zero": tensor_to_bytes(kz),
                "k.fp16_window": tensor_to_bytes(kv.k[:, :, nk:]),
                "v.codes": pack_codes(vc, self.bits),
                "v.scale": tensor_to_bytes(vs),
                "v.zero": tensor_to_bytes(vz),
                "v.fp16_window": tensor_to_bytes(kv.v[:, :, nv:]),
            },
        )

    def decode(self, bs: Bitstream, ctx: Context) -> KVSequence:
        L, H, T, D = ctx.shape
        nk, nv, gv = self._split(ctx)
        G, dt = self.group_size, ctx.dtype
        sec = bs.sections(expect=self.name)
        ks_shape, vs_shape = (L, H, nk // G, 1, D), (L, H, nv, D // gv, 1)
        kc = unpack_codes(sec["k.codes"], self.bits, L * H * nk * D).reshape(L, H, nk // G, G, D)
        vc = unpack_codes(sec["v.codes"], self.bits, L * H * nv * D).reshape(L, H, nv, D // gv, gv)
        k_hat = uniform_dequantize(kc, tensor_from_bytes(sec["k.scale"], dt, ks_shape), tensor_from_bytes(sec["k.zero"], dt, ks_shape))
        v_hat = uniform_dequantize(vc, tensor_from_bytes(sec["v.scale"], dt, vs_shape), tensor_from_bytes(sec["v.zero"], dt, vs_shape))
        k = torch.cat([k_hat.reshape(L, H, nk, D).to(dt), tensor_from_bytes(sec["k.fp16_window"], dt, (L, H, T - nk, D))], dim=2)
        v = torch.cat([v_hat.reshape(L, H, nv, D).to(dt), tensor_from_bytes(sec["v.fp16_window"], dt, (L, H, T - nv, D))], dim=2)
        return KVSequence(k, v)

    def resident(self, bs: Bitstream, ctx: Context) -> Layered | None:
        """Packed codes per layer, scales, zero points and the 16-bit tails held as tensors; a layer dequantises
        alone (the codes of one layer fill whole bytes whenever ``H * T * D * bits`` is a multiple of 8)."""
        L, H, T, D = ctx.shape
        nk, nv, gv = self._split(ctx)
        G, dt, b = self.group_size, ctx.dtype, self.bits
        if (H * nk * D * b) % 8 or (H * nv * D * b) % 8:
            return None
        sec = bs.sections(expect=self.name)
        as_bytes = lambda raw: torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
        held = {
            "k.codes": as_bytes(sec["k.codes"]).reshape(L, -1),  # (L, H*nk*D*b/8) packed, LSB first
            "v.codes": as_bytes(sec["v.codes"]).reshape(L, -1),
            "k.scale": tensor_from_bytes(sec["k.scale"], dt, (L, H, nk // G, 1, D)),
            "k.zero": tensor_from_bytes(sec["k.zero"], dt, (L, H, nk // G, 1, D)),
            "v.scale": tensor_from_bytes(sec["v.scale"], dt, (L, H, nv, D // gv, 1)),
            "v.zero": tensor_from_bytes(sec["v.zero"], dt, (L, H, nv, D // gv, 1)),
            "k.tail": tensor_from_bytes(sec["k.fp16_window"], dt, (L, H, T - nk, D)),
            "v.tail": tensor_from_bytes(sec["v.fp16_window"], dt, (L, H, T - nv, D)),
        }

        def layer(h, i):
            kc = unpack_codes_tensor(h["k.codes"][i], b).reshape(H, nk // G, G, D)
            vc = unpack_codes_tensor(h["v.codes"][i], b).reshape(H, nv, D // gv, gv)
            k = uniform_dequantize(kc, h["k.scale"][i], h["k.zero"][i]).reshape(H, nk, D).to(dt)
            v = uniform_dequantize(vc, h["v.scale"][i], h["v.zero"][i]).reshape(H, nv, D).to(dt)
            return torch.cat([k, h["k.tail"][i]], dim=1), torch.cat([v, h["v.tail"][i]], dim=1), None

        return Layered(held, layer)
