"""FP8 storage of the cache, as in vLLM's fp8 KV cache (formats from Micikevicius et al., arXiv 2209.05433)."""

from dataclasses import dataclass

import torch

from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.coding.packing import tensor_from_bytes, tensor_to_bytes
from kvbench.core.checks import check_choice, check_range
from kvbench.core.compressor import Compressor, Kept
from kvbench.core.kv import Context, KVSequence

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass
class FP8(Compressor):
    """Every 16-bit value rounded to an 8-bit float (saturating, no scales): 8 bits per element, except the most
    recent ``window`` tokens, stored exactly in the cache dtype."""

    format: str = "e4m3"
    window: int = 0

    name = "fp8"
    family = "quantizer"
    max_rel_mse = 0.0015  # e4m3 keeps 3 mantissa bits: 0.0007 measured
    quality_reference = True  # the format serving stacks accept: the yardstick of the frontier's recall axis

    def __post_init__(self) -> None:
        check_choice("fp8", "format", self.format, FORMATS)
        check_range("fp8", "window", self.window, 0, 1 << 30, integer=True)

    def exact_tokens(self, n_tokens: int) -> Kept:
        return Kept(recent=min(self.window, n_tokens))

    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream:
        n = ctx.n_tokens - self.exact_tokens(ctx.n_tokens).recent  # tokens rounded to FP8; the rest stay exact

        def raw(x):  # (L, H, n, D) -> one byte per element
            return x[:, :, :n].to(FORMATS[self.format]).view(torch.uint8).numpy().tobytes()

        exact = {"k.exact": tensor_to_bytes(kv.k[:, :, n:]), "v.exact": tensor_to_bytes(kv.v[:, :, n:])}
        return Bitstream.pack(self.name, {"k": raw(kv.k), "v": raw(kv.v), **(exact if n < ctx.n_tokens else {})})

    def decode(self, bs: Bitstream, ctx: Context) -> KVSequence:
        L, H, T, D = ctx.shape
        n = T - self.exact_tokens(T).recent
        sec = bs.sections(expect=self.name)

        def back(kind):  # one byte per element and the exact window's bytes -> (L, H, T, D) in the cache dtype
            if len(sec[kind]) != L * H * n * D:
                raise BitstreamError(f"fp8: {len(sec[kind])} {kind} code bytes for {L}x{H}x{n}x{D} elements")
            raw = bytearray(sec[kind])  # torch.frombuffer refuses an empty buffer: every token in the window
            codes = (torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)).view(
                FORMATS[self.format])
            parts = [codes.reshape(L, H, n, D).to(ctx.dtype)]
            if n < T:
                parts.append(tensor_from_bytes(sec[f"{kind}.exact"], ctx.dtype, (L, H, T - n, D)))
            return torch.cat(parts, dim=2)

        return KVSequence(back("k"), back("v"))
