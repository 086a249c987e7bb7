"""The 16-bit baseline: the cache bytes as they are. Every compression ratio is measured against it."""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.coding.bitstream import Bitstream
from kvbench.coding.packing import tensor_from_bytes, tensor_to_bytes
from kvbench.core.compressor import Compressor
from kvbench.core.kv import Context, KVSequence
from kvbench.core.resident import Layered, restored


@dataclass
class Identity(Compressor):
    """Stores K and V verbatim in the cache dtype; bit-exact, ratio 1.0 up to the frame."""

    name = "identity"
    family = "exact"
    lossless = True
    max_rel_mse = 0.0

    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream:
        return Bitstream.pack(self.name, {"k": tensor_to_bytes(kv.k), "v": tensor_to_bytes(kv.v)})

    def decode(self, bs: Bitstream, ctx: Context) -> KVSequence:
        sec = bs.sections(expect=self.name)
        return KVSequence(tensor_from_bytes(sec["k"], ctx.dtype, ctx.shape), tensor_from_bytes(sec["v"], ctx.dtype, ctx.shape))

    def resident(self, bs: Bitstream, ctx: Context) -> Layered:
        return restored(self.decode(bs, ctx))
