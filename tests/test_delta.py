"""delta: predictive delta coding. Exactness, the closed-loop error bound, side information, fields, the model
predictor on the tiny model, and the exact float coder underneath."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from compressors.delta import Delta
from kvbench.bitstream import Bitstream
from kvbench.config import compose, make_compressor
from kvbench.entropy import StreamDecoder, StreamEncoder
from kvbench.float_coding import decode_values, encode_values, from_codes, to_codes
from kvbench.kv import Context, KVSequence

FITTED = ["previous", "linear", "cross_layer"]


def _roundtrip(comp, kv, ctx=None):
    ctx = ctx or Context.for_kv(kv)
    bs = comp.encode(kv, ctx)
    assert sum(bs.parts.values()) == bs.num_bits
    return bs, comp.decode(Bitstream.from_bytes(bs.data), ctx)


def _same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _walk(L=3, H=2, T=160, D=16, dtype=torch.float16, seed=0):
    """Correlated KV (random walks with channel offsets): what delta coding is for; open loop would drift on it."""
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(L, H, T, D, generator=g).cumsum(2) * 0.3 + torch.linspace(-4, 4, D)).to(dtype)
    v = (torch.randn(L, H, T, D, generator=g).cumsum(2) * 0.2).to(dtype)
    return KVSequence(k, v, torch.randint(0, 128, (T,), generator=g))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("predictor", FITTED)
def test_lossless_is_bit_exact_for_every_predictor(predictor, dtype, random_kv):
    comp = Delta(predictor=predictor, step=0)
    comp.fit([random_kv(T=64, seed=3, dtype=dtype)])
    kv = random_kv(T=64, dtype=dtype)
    kv.k[0, 0, 5, :4] = torch.tensor([0.0, -0.0, float("inf"), -1e-7]).to(dtype)  # zeros, inf, subnormal
    bs, out = _roundtrip(comp, kv)
    assert comp.lossless
    assert _same_bits(out.k, kv.k) and _same_bits(out.v, kv.v)
    assert bs.parts["k.residual"] > 0 and bs.parts["scales"] > 0


@pytest.mark.parametrize("predictor", FITTED)
def test_prediction_pays_on_correlated_kv(predictor):
    """On random walks every predictor codes exactly below the 16-bit baseline, and the coder's actual size
    sits within 1% of the model's own -log2 p estimate."""
    comp = Delta(predictor=predictor)
    comp.fit([_walk(seed=4)])
    kv = _walk()
    bs, out = _roundtrip(comp, kv)
    assert _same_bits(out.k, kv.k)
    assert bs.num_bits / kv.n_elements < 13.0
    st = comp.stats()
    for kind in ("k", "v"):
        assert st[f"ideal_bits.{kind}.residual"] == pytest.approx(bs.parts[f"{kind}.residual"], rel=0.01, abs=64)


def test_lossy_model_estimate_tracks_the_coded_size_with_outliers():
    """Heavy-tailed residuals: the estimate must use the coder's own floor, not the bare Laplace tail."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 200, 32, generator=g)
    outliers = torch.distributions.StudentT(1.5).sample((2, 2, 200, 32)) * 0.05
    kv = KVSequence((x + outliers).half(), (0.5 * x).half())
    comp = Delta(predictor="previous", step=0.01)
    bs = comp.encode(kv, Context.for_kv(kv))
    for kind in ("k", "v"):
        assert comp.stats()[f"ideal_bits.{kind}.residual"] == pytest.approx(bs.parts[f"{kind}.residual"], rel=0.01)


def _ulp(x):
    return (torch.nextafter(x, torch.full_like(x, math.inf)) - x).abs().double()


@pytest.mark.parametrize("predictor", FITTED)
@pytest.mark.parametrize("step", [0.05, 0.3])
def test_lossy_error_is_bounded_by_half_a_step_everywhere(predictor, step):
    """Closed loop: every element within step/2 of the truth (plus the rounding of the reconstruction to the
    cache dtype), at the last token as at the first. An open loop would let 160 quantization errors add up."""
    comp = Delta(predictor=predictor, step=step)
    comp.fit([_walk(seed=4)])
    kv = _walk()
    bs, out = _roundtrip(comp, kv)
    assert not comp.lossless and bs.parts["bounds"] == 128
    for x, y in ((kv.k, out.k), (kv.v, out.v)):
        err = (x.double() - y.double()).abs()
        assert (err <= step / 2 + _ulp(y) / 2 + 1e-12).all(), float((err - step / 2).max())


def test_previous_on_a_dyadic_step_is_within_half_a_step_exactly():
    kv = _walk()
    comp = Delta(predictor="previous", step=0.125)
    _, out = _roundtrip(comp, kv)
    assert (out.k.double() - kv.k.double()).abs().max() <= 0.0625
    # the reconstruction is the grid step * round(x / step): predictions never leave the grid
    assert torch.equal(out.v.double(), torch.round(kv.v.double() / 0.125) * 0.125)


def test_coarser_steps_cost_fewer_bits_and_more_error():
    kv = _walk()
    sizes, errs = [], []
    for step in (0.01, 0.05, 0.25, 1.0):
        comp = Delta(predictor="linear", step=step)
        comp.fit([_walk(seed=4)])
        bs, out = _roundtrip(comp, kv)
        sizes.append(bs.num_bits)
        errs.append(float((out.k.double() - kv.k.double()).pow(2).mean()))
    assert sizes == sorted(sizes, reverse=True) and errs == sorted(errs)


def test_linear_side_info_is_charged_per_weight():
    L, H, D = 3, 2, 16
    for order, wb in ((1, 8), (3, 8), (2, 16)):
        comp = Delta(predictor="linear", order=order, weight_bits=wb)
        comp.fit([_walk(seed=4)])
        per_kind = L * H * D * (order + 1) * wb + L * H * D * 8  # weights + an int8 shift per channel
        assert comp.side_info_bits() == 2 * per_kind
    assert Delta(predictor="previous").side_info_bits() == 0


def test_cross_layer_side_info_is_charged_per_weight():
    L, H, D = 3, 2, 16
    comp = Delta(predictor="cross_layer", weight_bits=6)
    comp.fit([_walk(seed=4)])
    n = H * D
    assert comp.side_info_bits() == 2 * (L - 1) * ((n + 1) * n * 6 + n * 8)


def test_bits_chooses_a_step_per_channel_and_charges_it():
    kv = _walk()
    comp = Delta(predictor="previous", bits=4.0)
    comp.fit([_walk(seed=4)])
    assert comp.side_info_bits() == 2 * 3 * 2 * 16 * 16  # one float16 step per channel, K and V
    steps = comp._steps["k"].double()
    assert steps.std() > 0  # channels differ
    bs, out = _roundtrip(comp, kv)
    err = (out.k.double() - kv.k.double()).abs()
    assert (err <= steps.unsqueeze(2) / 2 + _ulp(out.k) / 2 + 1e-12).all()
    # about `bits` bits per element at high rate (the rule is approximate)
    assert 2.5 < bs.num_bits / kv.n_elements < 5.5


def test_side_info_reaches_the_summary(tiny_cfg, tiny_handle):
    from kvbench.runner import measure

    cfg = tiny_cfg("+compressor=delta", "compressor.predictor=linear", "metrics.nll=false")
    comp = make_compressor(cfg.compressor)
    s = measure(cfg, comp, tiny_handle)[0]
    assert s["lossless"] is True
    assert s["side_info_bits"] == comp.side_info_bits() > 0
    assert s["bits_by_part"]["side_info"] == comp.side_info_bits()
    assert s["total_bits"] == sum(s["bits_by_part"].values())
    assert s["compressor_stats"]["ideal_bits.k.residual"] > 0


@pytest.mark.parametrize("override,match", [
    ("predictor=nearest", r"delta\.predictor='nearest' is not allowed; choose one of \['previous', 'linear', 'cross_layer', 'model'\]"),
    ("order=0", r"delta\.order=0 is out of range; allowed: 1 <= order <= 16"),
    ("order=1.5", r"delta\.order=1\.5 must be a whole number"),
    ("step=-0.1", r"delta\.step=-0\.1 is out of range; allowed: 0\.0 <= step"),
    ("weight_bits=3", r"delta\.weight_bits=3 is out of range; allowed: 4 <= weight_bits <= 16"),
    ("predictor_dtype=fp8", r"delta\.predictor_dtype='fp8' is not allowed; choose one of \['bf16', 'int8', 'bf16_compute'\]"),
    ("bits=40", r"delta\.bits=40.* allowed: 0\.25 <= bits <= 12"),
    ("token_coding=zip", r"delta\.token_coding='zip' is not allowed; choose one of \['model', 'plain'\]"),
])
def test_bad_fields_name_what_is_allowed(override, match):
    cfg = compose(["+compressor=delta", f"compressor.{override}"])
    with pytest.raises(ValueError, match=match):
        make_compressor(cfg.compressor)


def test_conflicting_fields_are_refused():
    with pytest.raises(ValueError, match="step=0.1 or bits=3.0, not both"):
        Delta(step=0.1, bits=3.0)
    with pytest.raises(ValueError, match="bits is not available with predictor=model"):
        Delta(predictor="model", bits=3.0)


@pytest.mark.parametrize("predictor", ["linear", "cross_layer"])
def test_unfitted_predictor_says_to_fit(predictor, random_kv):
    kv = random_kv()
    with pytest.raises(ValueError, match="call fit"):
        Delta(predictor=predictor).encode(kv, Context.for_kv(kv))


def test_predictor_fitted_on_another_shape_is_refused(random_kv):
    comp = Delta(predictor="linear")
    comp.fit([random_kv(L=2, H=2, D=16)])
    kv = random_kv(L=3, H=2, D=16)
    with pytest.raises(ValueError, match="another cache shape"):
        comp.encode(kv, Context.for_kv(kv))


@pytest.fixture(scope="module")
def tiny_trace():
    from conftest import tiny_llama

    from kvbench.capture import capture_window

    model = tiny_llama()
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0))
    got = capture_window(model, ids, 40, torch.float16)
    return model, KVSequence(got["k"], got["v"], ids)


@pytest.mark.parametrize("dtype", ["bf16", "int8", "bf16_compute"])
def test_model_predictor_is_exact_and_charges_the_tokens(tiny_trace, dtype):
    model, kv = tiny_trace
    comp = Delta(predictor="model", predictor_dtype=dtype)
    assert comp.needs_model
    comp.fit([])
    handle = SimpleNamespace(model=model)
    bs, out = _roundtrip(comp, kv, Context.for_kv(kv, handle))
    assert _same_bits(out.k, kv.k) and _same_bits(out.v, kv.v)
    assert torch.equal(out.tokens, kv.tokens)
    # the ids cost about the cheap copy's cross-entropy plus the token coder's small header
    st = comp.stats()
    assert bs.parts["tokens"] >= st["tokens.ideal_token_bits"]
    # a good prediction leaves far less than the 16-bit baseline to code
    assert (bs.parts["k.residual"] + bs.parts["v.residual"]) / kv.n_elements < 10


def test_plain_token_coding_stores_fixed_width_ids(tiny_trace):
    model, kv = tiny_trace
    comp = Delta(predictor="model", token_coding="plain")
    bs, out = _roundtrip(comp, kv, Context.for_kv(kv, SimpleNamespace(model=model)))
    assert _same_bits(out.k, kv.k) and torch.equal(out.tokens, kv.tokens)
    assert bs.parts["tokens"] == 7 * kv.n_tokens  # vocabulary of 128: 7 bits per id


def test_a_decoder_with_another_predictor_fails_loudly(tiny_trace):
    from kvbench.bitstream import BitstreamError

    model, kv = tiny_trace
    ctx = Context.for_kv(kv, SimpleNamespace(model=model))
    bs = Delta(predictor="model", token_coding="plain", predictor_dtype="bf16").encode(kv, ctx)
    other = Delta(predictor="model", token_coding="plain", predictor_dtype="int8")
    with pytest.raises(BitstreamError, match="fails its checksum"):
        other.decode(Bitstream.from_bytes(bs.data), ctx)


def test_model_predictor_lossy_is_bounded_and_nearly_free(tiny_trace):
    model, kv = tiny_trace
    comp = Delta(predictor="model", step=0.01)
    handle = SimpleNamespace(model=model)
    bs, out = _roundtrip(comp, kv, Context.for_kv(kv, handle))
    err = (out.k.double() - kv.k.double()).abs()
    assert (err <= 0.005 + _ulp(out.k) / 2 + 1e-12).all()
    # the bf16-weight copy already predicts within the step almost everywhere
    assert (bs.parts["k.residual"] + bs.parts["v.residual"]) / kv.n_elements < 0.2


def test_model_predictor_needs_tokens_and_model(tiny_trace):
    model, kv = tiny_trace
    comp = Delta(predictor="model")
    with pytest.raises(ValueError, match="needs the model"):
        comp.encode(kv, Context.for_kv(kv))
    with pytest.raises(ValueError, match="token ids"):
        comp.encode(KVSequence(kv.k, kv.v), Context.for_kv(kv, SimpleNamespace(model=model)))


# ---- the exact float coder ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16_bit_pattern_codes_exactly_even_far_from_its_prediction(dtype):
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)  # NaNs and infinities too
    assert _same_bits(from_codes(to_codes(x), dtype), x)
    values = x.double().numpy()
    order = np.argsort(to_codes(x))
    finite = np.isfinite(values[order])
    assert np.all(np.diff(values[order][finite]) >= 0)  # codes sort by value
    units = x.reshape(64, 1024)
    mu = np.full(units.shape, 3.0)
    b = np.full(units.shape, 0.01)  # almost every value is a wild outlier under this model
    enc = StreamEncoder()
    ideal = encode_values(enc, units, mu, b)
    raw, nbits = enc.finish()
    dec = StreamDecoder(raw)
    out = torch.stack([decode_values(dec, mu[c], b[c], dtype) for c in range(64)])
    assert _same_bits(out, units)
    # an outlier costs at most its 16 binary decisions at the probability floor
    assert nbits <= 16 * 20 * x.numel() and nbits == pytest.approx(ideal, rel=0.01)


def test_float_coder_costs_what_the_prediction_is_worth():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 4096, generator=g) * 4).half()
    noise = torch.randn(8, 4096, generator=g).double()
    costs = []
    for sigma in (1.0, 1e-2, 1e-4):
        mu = x.double() + sigma * noise
        enc = StreamEncoder()
        encode_values(enc, x, mu.numpy(), np.full(x.shape, sigma))
        costs.append(enc.finish()[1] / x.numel())
    assert costs[0] > 8 and costs[2] < 1.5 and costs == sorted(costs, reverse=True)
