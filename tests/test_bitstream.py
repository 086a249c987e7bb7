import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.coding.packing import pack_codes, tensor_from_bytes, tensor_to_bytes, unpack_codes


def test_parts_sum_to_num_bits_and_fit_in_data():
    bs = Bitstream.pack("demo", {"a": b"\x01\x02\x03", "b": (b"\xff", 3), "empty": b""})
    assert sum(bs.parts.values()) == bs.num_bits
    assert len(bs.data) * 8 >= bs.num_bits
    assert bs.parts["b"] == 3 and bs.parts["a"] == 24 and bs.parts["frame"] > 0
    assert bs.sections("demo") == {"a": b"\x01\x02\x03", "b": b"\xff", "empty": b""}


def test_from_bytes_rebuilds_the_same_accounting():
    bs = Bitstream.pack("demo", {"x": (b"\x0f\x01", 9)})
    again = Bitstream.from_bytes(bs.data)
    assert (again.num_bits, dict(again.parts), again.compressor) == (bs.num_bits, dict(bs.parts), "demo")


@pytest.mark.parametrize("pos", [0, 3, 10, -5, -1])
def test_any_flipped_byte_is_caught(pos):
    data = bytearray(Bitstream.pack("demo", {"x": bytes(range(32))}).data)
    data[pos] ^= 0x40
    with pytest.raises(BitstreamError):
        Bitstream.from_bytes(bytes(data)).sections()


def test_truncated_and_foreign_streams_raise():
    bs = Bitstream.pack("demo", {"x": b"abc"})
    with pytest.raises(BitstreamError, match="magic|truncated|checksum"):
        Bitstream.from_bytes(bs.data[:-3])
    with pytest.raises(BitstreamError, match="not 'other'"):
        bs.sections(expect="other")
    with pytest.raises(BitstreamError, match="magic"):
        Bitstream.from_bytes(b"hello world, not a stream")


def test_bits_must_fit_the_section():
    with pytest.raises(ValueError, match="do not fit"):
        Bitstream.pack("demo", {"x": (b"\x00", 12)})


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_pack_codes_roundtrip_and_size(bits, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.int64).to(torch.uint8)
    raw, nbits = pack_codes(codes, bits)
    assert nbits == n * bits and len(raw) == -(-n * bits // 8)
    assert torch.equal(unpack_codes(raw, bits, n), codes)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int64])
def test_tensor_bytes_roundtrip_is_exact(dtype):
    t = (torch.randn(3, 5, 7) * 100).to(dtype)
    assert torch.equal(tensor_from_bytes(tensor_to_bytes(t), dtype, (3, 5, 7)), t)


def test_a_declared_bit_count_that_its_bytes_cannot_hold_is_refused():
    import zlib

    from kvbench.coding.bitstream import FORMAT_VERSION, MAGIC, _string, varints

    # a well-formed frame with a valid checksum whose header claims 20 bits for a 1-byte section
    body = MAGIC + bytes([FORMAT_VERSION]) + _string("demo") + varints([1]) + _string("x") + varints([20, 1]) + b"\x07"
    data = body + zlib.crc32(body).to_bytes(4, "big")
    with pytest.raises(BitstreamError, match="declares 20 bits in 1 bytes"):
        Bitstream.from_bytes(data)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.integers(0, 2**63 - 1), max_size=40))
def test_varints_roundtrip(values):
    from kvbench.coding.bitstream import read_varints, varints

    raw = varints(values)
    assert read_varints(raw + b"tail", len(values)) == (values, len(raw))
    if values:
        with pytest.raises(BitstreamError, match="truncated"):
            read_varints(raw[:-1], len(values))


@pytest.mark.parametrize("width", [0, 1, 7, 8, 9, 16, 17, 40, 64])
def test_wide_codes_pack_as_one_lsb_first_stream(width):
    import numpy as np

    v = np.random.default_rng(width).integers(0, 1 << min(width, 63), 1001, dtype=np.int64) if width else np.zeros(1001, np.int64)
    raw, bits = pack_codes(torch.from_numpy(v), width)
    assert bits == 1001 * width and len(raw) == -(-bits // 8)
    assert np.array_equal(unpack_codes(raw, width, 1001).numpy().astype(np.int64), v)
    if 1 <= width:  # code 0's low bit is the stream's first bit
        assert raw[0] & 1 == v[0] & 1
    with pytest.raises(BitstreamError, match="cannot hold"):
        unpack_codes(raw + b"\x00", width, 1001)


def test_a_missing_or_repeated_section_is_a_bitstream_error_that_names_it():
    sec = Bitstream.pack("kivi", {"k.codes": b"\x01", "v.codes": b"\x02"}).sections(expect="kivi")
    assert sec["k.codes"] == b"\x01" and "k.scale" not in sec and sec.get("k.scale") is None
    with pytest.raises(BitstreamError, match=r"kivi bitstream has no section 'k.scale'; it holds \['k.codes', 'v.codes'\]"):
        sec["k.scale"]
    once = Bitstream.pack("kivi", {"a": b"\x01", "b": b"\x02"}).data
    body = once[:-4].replace(b"\x01b", b"\x01a")  # the second section's name written as the first's
    import zlib

    with pytest.raises(BitstreamError, match="names a section twice"):
        Bitstream.from_bytes(body + zlib.crc32(body).to_bytes(4, "big"))


def test_a_tensor_section_of_the_wrong_size_is_a_bitstream_error():
    raw = tensor_to_bytes(torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(BitstreamError, match=r"10 bytes for a torch.float16 tensor of shape \(2, 3\) \(needs 12\)"):
        tensor_from_bytes(raw[:-2], torch.float16, (2, 3))
