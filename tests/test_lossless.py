"""lossless: byte planes, histogram side information, bit-exact roundtrips for every coder and split."""

import numpy as np
import pytest
import torch

from compressors.exact.lossless import Lossless
from compressors.exact.plane_coder import (
    GROUPINGS,
    Histograms,
    PlaneModel,
    choose_grouping,
    count_levels,
    from_planes,
    level_weights,
    to_planes,
)
from kvbench.coding.bitstream import Bitstream
from kvbench.coding.entropy import StreamDecoder, StreamEncoder
from kvbench.core.config import compose, make_compressor
from kvbench.core.kv import Context, KVSequence


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("split", ["exponent", "bytes"])
def test_planes_invert_on_every_bit_pattern(dtype, split):
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).reshape(1, 4, 128, 128)
    a, b = to_planes(x, split)
    assert a.dtype == b.dtype == np.uint8 and a.shape == x.shape
    assert torch.equal(from_planes(a, b, dtype, split).view(torch.int16), x.view(torch.int16))


def test_bfloat16_exponent_split_keeps_the_exponent_whole():
    x = torch.tensor([1.0, -1.0, 2.0, 0.5, 3.0e-20, -6.0e20], dtype=torch.bfloat16)
    exp, rest = to_planes(x, "exponent")
    assert exp.tolist() == [127, 127, 128, 126, 127 - 65, 127 + 69]  # the biased exponent, sign not in it
    assert [r >> 7 for r in rest.tolist()] == [0, 1, 0, 0, 0, 1]  # the sign rides with the mantissa
    hi, _ = to_planes(x, "bytes")  # the plain byte split cuts the exponent: s e7 in the high byte
    assert hi.tolist()[:2] == [63, 191]


def test_level_weights_are_exact_and_close_to_the_counts():
    c = np.array([0, 1, 2, 3, 10, 999, 123456, 5_000_000])
    w = level_weights(count_levels(c))
    assert w[0] == 0 and (w[1:] > 0).all()
    # within 2^(1/4) of the count, plus the 1/64 rounding of sqrt(2) (91/64 = 2^0.508)
    assert np.all(np.abs(np.log2(w[1:] / c[1:])) <= 0.25 + 0.01)
    assert np.array_equal(w * 64, np.round(w * 64))  # dyadic: no libm rounding can differ between machines


def test_histograms_roundtrip_through_the_side_stream():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 500, size=(40, 64)) * (rng.random((40, 64)) < 0.3)
    counts[0] = 0
    counts[0, 17] = 9  # a one-bin group
    counts[1, [0, 63]] = [1, 2]  # a group that spans the whole alphabet
    h = Histograms.fit(counts)
    scales = h.scales()
    enc = StreamEncoder()
    h.encode(enc, scales)
    raw, nbits = enc.finish()
    back = Histograms.decode(StreamDecoder(raw), scales, 40, 64)
    assert np.array_equal(back.levels, h.levels) and np.array_equal(back.lo, h.lo) and np.array_equal(back.hi, h.hi)
    assert nbits <= h.ideal_bits(scales) + 64


def test_float16_high_byte_model_factorises_field_and_mantissa_bits():
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 50, size=(6, 256))
    m = PlaneModel.fit(counts, shift=2)
    rows = m.rows()
    assert m.field.levels.shape == (6, 64) and rows.shape == (6, 256)
    # p(rest | field) is shared: within each field the rows of all groups are proportional
    r = rows.reshape(6, 64, 4)
    ratio = r / r.sum(2, keepdims=True)
    assert np.allclose(ratio, ratio[:1])


def test_auto_grouping_follows_the_data():
    rng = np.random.default_rng(2)
    L, H, T, D = 2, 2, 512, 32
    # each channel lives in its own binade: per-channel histograms pay off
    scale = 2.0 ** rng.integers(-8, 8, size=(L, H, 1, D))
    outliers = torch.from_numpy(rng.standard_normal((L, H, T, D)) * scale).half()
    assert choose_grouping(to_planes(outliers, "exponent")[0], 2)[0] == "channel"
    # skewed bytes that are the same everywhere: one histogram for the tensor is the cheapest side information
    skewed = rng.geometric(0.05, size=(L, H, T, D)).clip(0, 255).astype(np.uint8)
    assert choose_grouping(skewed, 0)[0] == "tensor"
    # uniform random bytes: no histogram beats storing them as they are
    noise = rng.integers(0, 256, size=(L, H, T, D), dtype=np.uint8)
    assert choose_grouping(noise, 0)[0] == "raw"


def _kv(dtype, L=2, H=2, T=160, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, H, T, D, generator=g) * torch.logspace(-2, 2, D)  # channel outliers, as real keys have
    v = torch.randn(L, H, T, D, generator=g)
    return KVSequence(k.to(dtype), v.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("coder,split,histogram", [
    ("range", "exponent", "auto"), ("range", "bytes", "auto"), ("range", "exponent", "channel"),
    ("range", "exponent", "head"), ("range", "exponent", "layer"), ("range", "exponent", "tensor"),
    ("lzma", "exponent", "auto"), ("zlib", "bytes", "auto"),
])
def test_roundtrip_is_bit_exact_and_compresses(dtype, coder, split, histogram):
    kv = _kv(dtype)
    comp = Lossless(coder=coder, split=split, histogram=histogram)
    ctx = Context.for_kv(kv)
    bs = comp.encode(kv, ctx)
    out = comp.decode(Bitstream.from_bytes(bs.data), ctx)
    assert out.k.dtype == dtype
    assert torch.equal(out.k.view(torch.int16), kv.k.view(torch.int16))
    assert torch.equal(out.v.view(torch.int16), kv.v.view(torch.int16))
    if histogram == "auto" or coder != "range":  # forced per-channel histograms on 160 tokens may not pay
        assert bs.num_bits < 16 * kv.n_elements  # gaussian data has a few-bit exponent entropy


def test_float16_low_mantissa_byte_is_stored_raw():
    kv = _kv(torch.float16, T=512)
    comp = Lossless()
    bs = comp.encode(kv, Context.for_kv(kv))
    assert bs.parts["k.mant"] == 8 * kv.k.numel() and "k.mant.hist" not in bs.parts
    assert comp.stats()["histogram.k.mant.raw"] == 1
    out = comp.decode(Bitstream.from_bytes(bs.data), Context.for_kv(kv))
    assert torch.equal(out.k.view(torch.int16), kv.k.view(torch.int16))


def test_range_coder_charges_histograms_and_stays_near_its_estimate():
    kv = _kv(torch.bfloat16, T=512)
    comp = Lossless()
    bs = comp.encode(kv, Context.for_kv(kv))
    assert {"header", "k.exp", "k.exp.hist", "k.mant", "k.mant.hist", "v.exp", "v.exp.hist"} <= set(bs.parts)
    assert bs.parts["k.exp.hist"] > 0
    payload = bs.num_bits - bs.parts["frame"] - bs.parts["header"]
    ideal = comp.stats()["ideal_bits"]
    # the model's own estimate, up to the coder's fixed-point rounding and one 32-bit flush per section
    assert abs(payload - ideal) <= 0.01 * ideal + 32 * 8
    assert sum(v for k, v in comp.stats().items() if k.startswith("histogram.")) == 4


def test_bfloat16_exponent_split_beats_the_plain_byte_split():
    kv = _kv(torch.bfloat16, T=512)
    ctx = Context.for_kv(kv)
    assert Lossless(split="exponent").encode(kv, ctx).num_bits < Lossless(split="bytes").encode(kv, ctx).num_bits


def test_header_from_other_settings_is_refused():
    kv = _kv(torch.float16)
    ctx = Context.for_kv(kv)
    bs = Lossless(coder="zlib").encode(kv, ctx)
    with pytest.raises((ValueError, KeyError)):
        Lossless(coder="range").decode(Bitstream.from_bytes(bs.data), ctx)


def test_groupings_are_the_histogram_choices():
    assert set(GROUPINGS) == {"channel", "head", "layer", "tensor"}


@pytest.mark.parametrize("field,value,allowed", [
    ("coder", "zstd", "range.*lzma.*zlib"),
    ("split", "nibbles", "exponent.*bytes"),
    ("histogram", "token", "auto.*channel.*head.*layer.*tensor"),
])
def test_bad_fields_say_what_is_allowed(field, value, allowed):
    cfg = compose(["+compressor=lossless", f"compressor.{field}={value}"])
    with pytest.raises(ValueError, match=f"lossless\\.{field}='{value}'.*{allowed}"):
        make_compressor(cfg.compressor)


def test_harness_records_lossless_on_the_tiny_model(tiny_cfg, tiny_handle):
    from kvbench.measure.run import measure

    for dtype in ("float16", "bfloat16"):
        cfg = tiny_cfg("+compressor=lossless", f"dtype={dtype}", "metrics.nll=false")
        s, _ = measure(cfg, make_compressor(cfg.compressor), tiny_handle)
        assert s["lossless"] is True and s["max_abs_err_k"] == 0.0 and s["max_abs_err_v"] == 0.0
        assert s["compressor_stats"]["ideal_bits"] > 0
