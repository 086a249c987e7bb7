"""Lossless byte-plane coding of the 16-bit cache: the per-vector lossless baseline.

Each 16-bit pattern is split into two byte planes and each plane is entropy-coded on its own, as ZipNN does for
model weights (Hershcovitch et al., arXiv 2411.05239) and DFloat11 for bf16 exponents (Zhang et al., arXiv
2504.11651); both land near 1.4-1.5x on bf16, because only the exponent carries much redundancy.

The split keeps the whole exponent in one byte (``split=exponent``):

* float16 (s | e5 | m10): the high byte ``s e5 m2`` and the low byte ``m8``, i.e. the plain byte split. The
  two top mantissa bits ride with the exponent: they are not uniform (leading digits of log-spread values lean
  low) and a byte alphabet has room for them.
* bfloat16 (s | e8 | m7): the plain byte split would cut the exponent (``s e7`` | ``e1 m7``), so the sign is
  rotated instead: the exponent byte ``e8`` and the byte ``s m7``.

``split=bytes`` is the plain high/low byte split for comparison (identical to ``exponent`` on float16).

``coder=range``: every plane gets static histograms, fitted per group of symbols and charged in the stream as
side information, then range-coded with constriction. A group is one channel (layer, head, dim), one head, one
layer or the whole tensor (``histogram=``); ``auto`` lets the encoder pick, per plane, the grouping whose
estimated total (data under the quantized histograms + histogram bits) is smallest, or stores the plane as it
is when nothing beats 8 bits per byte: keys have fixed outlier channels, so their exponents pay for per-channel
histograms, while near-uniform mantissas do not (float16's low mantissa byte is stored raw).
For float16 the high byte also holds the top two mantissa bits: it is modelled as p(s e5 | group) x p(m2 | s e5),
a per-group histogram of the 6-bit sign+exponent field times one conditional table for the whole plane, so the
per-channel side information covers ~20 exponent values instead of ~60 byte values.
Histograms are sent as log-count levels (``LEVELS_PER_OCTAVE`` steps per doubling), coded as Laplace-distributed
differences between neighbouring bins; the decoder rebuilds the very same float64 rows from exact dyadic values.
``coder=lzma|zlib``: the same planes, channel-major, through a general-purpose coder from the standard library.

The plane coder (:mod:`compressors.exact.plane_coder`) also codes the byte planes of ``delta``'s exact residuals
(:mod:`compressors.predictive.residual`).
"""

from __future__ import annotations

import lzma
import math
import zlib
from collections import Counter
from dataclasses import dataclass

import numpy as np

from compressors.exact.plane_coder import (
    HISTOGRAMS,
    PlaneHeader,
    decode_plane,
    encode_plane,
    field_shift,
    from_planes,
    grouped,
    plane_names,
    to_planes,
    ungrouped,
)
from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.coding.entropy import StreamDecoder, StreamEncoder
from kvbench.core.checks import check_choice
from kvbench.core.compressor import Compressor
from kvbench.core.kv import SIXTEEN_BIT, Context, KVSequence

CODERS = ("range", "lzma", "zlib")
SPLITS = ("exponent", "bytes")
_LZMA_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 6}]


@dataclass
class Lossless(Compressor):
    """Bit-exact byte-plane entropy coding (ZipNN arXiv 2411.05239 / DFloat11 arXiv 2504.11651 style)."""

    coder: str = "range"
    split: str = "exponent"
    histogram: str = "auto"

    name = "lossless"
    family = "exact"
    lossless = True
    max_rel_mse = 0.0

    def __post_init__(self) -> None:
        check_choice("lossless", "coder", self.coder, CODERS)
        check_choice("lossless", "split", self.split, SPLITS)
        check_choice("lossless", "histogram", self.histogram, HISTOGRAMS)
        self._stats: Counter = Counter()

    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream:
        if kv.k.dtype not in SIXTEEN_BIT:
            raise ValueError(f"lossless codes 16-bit caches ({SIXTEEN_BIT}); got {kv.k.dtype}")
        names = plane_names(kv.k.dtype, self.split)
        sections: dict[str, bytes | tuple[bytes, int]] = {}
        header = bytearray()
        for kind, x in (("k", kv.k), ("v", kv.v)):
            for i, (pname, plane) in enumerate(zip(names, to_planes(x, self.split))):
                key = f"{kind}.{pname}"
                if self.coder != "range":
                    sections[key] = _general_compress(self.coder, grouped(plane, "tensor").tobytes())
                    continue
                side, data = StreamEncoder(), StreamEncoder()
                head, ideal = encode_plane(plane, field_shift(kv.k.dtype, self.split, i), self.histogram, side, data)
                self._stats[f"histogram.{key}.{head.grouping}"] += 1
                self._stats["ideal_bits"] += ideal
                header += head.to_bytes()
                if head.grouping == "raw":
                    sections[key] = np.ascontiguousarray(plane).tobytes()
                else:
                    sections[f"{key}.hist"], sections[key] = side.finish(), data.finish()
        if self.coder == "range":
            sections = {"header": bytes(header), **sections}
        return Bitstream.pack(self.name, sections)

    def decode(self, bs: Bitstream, ctx: Context) -> KVSequence:
        sec = bs.sections(expect=self.name)
        names = plane_names(ctx.dtype, self.split)
        size = math.prod(ctx.shape)  # bytes of one plane
        header, pos, out = sec.get("header", b""), 0, []
        for kind in ("k", "v"):
            planes = []
            for i, pname in enumerate(names):
                key = f"{kind}.{pname}"
                if self.coder != "range":
                    raw = _general_decompress(self.coder, sec[key], size, key)
                    planes.append(ungrouped(np.frombuffer(raw, dtype=np.uint8), ctx.shape))
                    continue
                shift = field_shift(ctx.dtype, self.split, i)
                head, pos = PlaneHeader.read(header, pos, shift, "lossless")
                if head.grouping == "raw":
                    if len(sec[key]) != size:
                        raise BitstreamError(f"lossless {key}: a raw plane of {len(sec[key])} bytes; the shape "
                                             f"{tuple(ctx.shape)} has {size}")
                    planes.append(np.frombuffer(sec[key], dtype=np.uint8).reshape(ctx.shape))
                else:
                    side, data = StreamDecoder(sec[f"{key}.hist"]), StreamDecoder(sec[key])
                    planes.append(decode_plane(head, ctx.shape, shift, side, data))
                    side.finish(f"lossless {key}.hist")
                    data.finish(f"lossless {key}")
            out.append(from_planes(*planes, ctx.dtype, self.split))
        if pos != len(header):
            raise BitstreamError(f"lossless header holds {len(header)} bytes; its plane headers take {pos}")
        return KVSequence(out[0], out[1])

    def stats(self) -> dict:
        return dict(self._stats)


def _general_compress(coder: str, raw: bytes) -> bytes:
    if coder == "lzma":
        return lzma.compress(raw, format=lzma.FORMAT_RAW, filters=_LZMA_FILTERS)
    c = zlib.compressobj(level=9, wbits=-15)  # raw deflate: no zlib header or Adler-32 (the frame has a CRC)
    return c.compress(raw) + c.flush()


def _general_decompress(coder: str, raw: bytes, size: int, what: str) -> bytes:
    """The ``size`` bytes of a plane from its general-purpose stream, never inflating more than one byte past
    them (a corrupted or hostile stream could inflate to any size)."""
    d = lzma.LZMADecompressor(format=lzma.FORMAT_RAW, filters=_LZMA_FILTERS) if coder == "lzma" else \
        zlib.decompressobj(wbits=-15)
    try:
        out = d.decompress(raw, size + 1)
    except (lzma.LZMAError, zlib.error) as e:
        raise BitstreamError(f"lossless {what}: the {coder} stream is corrupted ({e})") from e
    if len(out) != size or not d.eof or d.unused_data:
        raise BitstreamError(f"lossless {what}: the {coder} stream does not hold exactly the plane's {size} bytes")
    return out
