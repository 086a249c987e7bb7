"""Self-describing, checksummed container for a compressor's output.

Layout (all integers unsigned LEB128 varints unless noted)::

    b"KVB" | format version (1 byte) | compressor name (len, utf-8) | n sections
    per section: name (len, utf-8) | exact bit count | byte count
    section payloads, concatenated
    CRC-32 of everything above (4 bytes, big-endian)

The harness charges every bit of it: section payloads at their exact bit count (the packer or entropy coder says
how many bits are meaningful; the pad to a whole byte is not) and the frame (header and CRC) at its byte size, as
the part ``frame``. A compressor never states its own rate.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

MAGIC = b"KVB"
FORMAT_VERSION = 1


class BitstreamError(ValueError):
    """A bitstream is corrupted, truncated, of another format version or from another compressor."""


class Sections(dict):
    """Section payloads by name, as :meth:`Bitstream.sections` returns them. Reading a section the stream does
    not hold raises a :class:`BitstreamError` that names it and the sections there are (a ``KeyError`` would
    not say that the stream, not the code, is wrong); ``in`` and ``get`` ask as for any dict."""

    def __init__(self, compressor: str, payloads: Mapping[str, bytes]) -> None:
        super().__init__(payloads)
        self.compressor = compressor

    def __missing__(self, name: str) -> bytes:
        raise BitstreamError(f"{self.compressor or 'the'} bitstream has no section {name!r}; it holds {sorted(self)}")


def varints(values) -> bytes:
    """Unsigned LEB128: seven bits a byte, low groups first, the high bit set on every byte but a number's last."""
    out = bytearray()
    for n in values:
        n = int(n)
        if n < 0:
            raise ValueError(f"varint must be >= 0, got {n}")
        while n >= 0x80:
            out.append((n & 0x7F) | 0x80)
            n >>= 7
        out.append(n)
    return bytes(out)


def read_varints(raw: bytes, count: int, pos: int = 0) -> tuple[list[int], int]:
    """``count`` varints from ``raw`` at ``pos``; returns them and the position after the last."""
    out = []
    for _ in range(count):
        shift = value = 0
        while True:
            if pos >= len(raw):
                raise BitstreamError("bitstream is truncated inside an integer")
            byte = raw[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
            if shift > 63:
                raise BitstreamError("bitstream has a malformed integer")
        out.append(value)
    return out, pos


class _Reader:
    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data, self.pos = data, pos

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise BitstreamError("bitstream is truncated")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def varint(self) -> int:
        (value,), self.pos = read_varints(self.data, 1, self.pos)
        return value

    def string(self) -> str:
        try:
            return self.take(self.take(1)[0]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise BitstreamError("bitstream header has a malformed name") from e


def _string(s: str) -> bytes:
    raw = s.encode("utf-8")
    if len(raw) > 255:
        raise ValueError(f"name too long for a bitstream header: {s!r}")
    return bytes([len(raw)]) + raw


@dataclass(frozen=True)
class Bitstream:
    """Real bytes plus their exact accounting.

    ``num_bits`` is every bit the decoder needs; ``parts`` names where they go and sums to ``num_bits``.
    Build one with :meth:`pack`; read it back with :meth:`sections`.
    """

    data: bytes
    num_bits: int
    parts: Mapping[str, int] = field(default_factory=dict)
    compressor: str = ""

    @classmethod
    def pack(cls, compressor: str, sections: Mapping[str, bytes | tuple[bytes, int]]) -> Bitstream:
        """Frame named sections. A section is ``bytes`` (all bits count) or ``(bytes, exact_bits)``."""
        header = bytearray(MAGIC + bytes([FORMAT_VERSION]) + _string(compressor) + varints([len(sections)]))
        payloads, parts = [], {}
        for name, sec in sections.items():
            raw, nbits = (sec, 8 * len(sec)) if isinstance(sec, (bytes, bytearray)) else sec
            raw = bytes(raw)
            if not 8 * len(raw) - 7 <= nbits <= 8 * len(raw) and not (nbits == 0 == len(raw)):
                raise ValueError(f"section {name!r}: {nbits} bits do not fit {len(raw)} bytes")
            if name == "frame" or name in parts:
                raise ValueError(f"section name {name!r} is reserved or repeated")
            header += _string(name) + varints([nbits, len(raw)])
            payloads.append(raw)
            parts[name] = nbits
        body = bytes(header) + b"".join(payloads)
        data = body + zlib.crc32(body).to_bytes(4, "big")
        frame_bits = 8 * (len(data) - sum(len(p) for p in payloads))
        return cls(data, frame_bits + sum(parts.values()), {"frame": frame_bits, **parts}, compressor)

    @classmethod
    def from_bytes(cls, data: bytes) -> Bitstream:
        """Parse and verify stored bytes; the accounting is rebuilt from the header."""
        _, compressor, layout = _parse(bytes(data))
        parts = {name: nbits for name, nbits, _, _ in layout}
        frame_bits = 8 * (len(data) - sum(n for _, _, _, n in layout))
        return cls(bytes(data), frame_bits + sum(parts.values()), {"frame": frame_bits, **parts}, compressor)

    def sections(self, expect: str | None = None) -> Sections:
        """Verify the checksum (and the compressor name if given) and return the section payloads."""
        body, compressor, layout = _parse(self.data)
        if expect is not None and compressor != expect:
            raise BitstreamError(f"bitstream was written by compressor {compressor!r}, not {expect!r}")
        return Sections(compressor, {name: body[start : start + n] for name, _, start, n in layout})


def _parse(data: bytes) -> tuple[bytes, str, list[tuple[str, int, int, int]]]:
    if len(data) < len(MAGIC) + 6 or data[: len(MAGIC)] != MAGIC:
        raise BitstreamError("not a kvbench bitstream (bad magic bytes)")
    body, crc = data[:-4], int.from_bytes(data[-4:], "big")
    if zlib.crc32(body) != crc:
        raise BitstreamError("bitstream checksum mismatch: the data is corrupted")
    r = _Reader(body, len(MAGIC))
    version = r.take(1)[0]
    if version != FORMAT_VERSION:
        raise BitstreamError(f"bitstream format version {version}; this kvbench reads version {FORMAT_VERSION}")
    compressor = r.string()
    entries = [(r.string(), r.varint(), r.varint()) for _ in range(r.varint())]
    if len({name for name, _, _ in entries}) != len(entries):
        raise BitstreamError(f"{compressor} bitstream names a section twice")
    layout, pos = [], r.pos
    for name, nbits, nbytes in entries:
        # every declared bit must lie in the section's bytes, and at most the last byte may be padding
        if not (8 * nbytes - 7 <= nbits <= 8 * nbytes or nbits == 0 == nbytes):
            raise BitstreamError(f"section {name!r} declares {nbits} bits in {nbytes} bytes")
        layout.append((name, nbits, pos, nbytes))
        pos += nbytes
    if pos != len(body):
        raise BitstreamError("bitstream length does not match its header")
    return body, compressor, layout
