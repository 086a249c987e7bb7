"""FP8 storage of the cache, as in vLLM's fp8 KV cache (formats from Micikevicius et al., arXiv 2209.05433)."""

from dataclasses import dataclass

import torch

from kvbench.coding.bitstream import Bitstream
from kvbench.core.checks import check_choice
from kvbench.core.compressor import Compressor
from kvbench.core.kv import Context, KVSequence

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass
class FP8(Compressor):
    """Every 16-bit value rounded to an 8-bit float (saturating, no scales): 8 bits per element."""

    format: str = "e4m3"

    name = "fp8"

    def __post_init__(self) -> None:
        check_choice("fp8", "format", self.format, FORMATS)

    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream:
        def raw(x):  # (L, H, T, D) -> one byte per element
            return x.to(FORMATS[self.format]).view(torch.uint8).numpy().tobytes()

        return Bitstream.pack(self.name, {"k": raw(kv.k), "v": raw(kv.v)})

    def decode(self, bs: Bitstream, ctx: Context) -> KVSequence:
        def back(raw):  # one byte per element -> (L, H, T, D) in the cache dtype
            codes = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(FORMATS[self.format])
            return codes.reshape(ctx.shape).to(ctx.dtype)

        sec = bs.sections(expect=self.name)
        return KVSequence(back(sec["k"]), back(sec["v"]))
