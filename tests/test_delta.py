"""delta: predictive delta coding. Exactness (both exact coders), the closed-loop error bound, codec state (its
bits, its bytes loaded on a fresh decoder, malformed sections), fields, and the exact coders underneath: residual
byte planes and the value-space float coder. The model predictor is ``speculative`` (tests/test_speculative.py)."""

import math

import numpy as np
import pytest
import torch

from compressors.exact.lossless import Lossless
from compressors.predictive.delta import Delta
from compressors.predictive.delta_predictors import FromModel, Previous
from compressors.predictive.residual import ResidualCoder
from compressors.predictive.residual_planes import unzigzag, zigzag
from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.coding.entropy import StreamDecoder, StreamEncoder
from kvbench.coding.float_coding import decode_values, encode_values, from_codes, to_codes
from kvbench.coding.packing import unpack_codes
from kvbench.core.compressor import rebuild
from kvbench.core.config import compose, make_compressor
from kvbench.core.kv import Context, KVSequence

FITTED = ["previous", "linear", "cross_layer"]
EXACT = ["planes", "laplace"]


def _roundtrip(comp, kv, ctx=None):
    ctx = ctx or Context.for_kv(kv)
    bs = comp.encode(kv, ctx)
    assert sum(bs.parts.values()) == bs.num_bits
    return bs, comp.decode(Bitstream.from_bytes(bs.data), ctx)


def _same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _state_bits(comp):
    """Every bit of the codec state's sections (the harness adds its frame)."""
    return sum(8 * len(b) if isinstance(b, bytes) else b[1] for b in comp.state().values())


def _plain(comp):
    """The state as the decoder receives it: section name -> bytes."""
    return {name: b if isinstance(b, bytes) else b[0] for name, b in comp.state().items()}


def _walk(L=3, H=2, T=160, D=16, dtype=torch.float16, seed=0):
    """Correlated KV (random walks with channel offsets): what delta coding is for; open loop would drift on it."""
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(L, H, T, D, generator=g).cumsum(2) * 0.3 + torch.linspace(-4, 4, D)).to(dtype)
    v = (torch.randn(L, H, T, D, generator=g).cumsum(2) * 0.2).to(dtype)
    return KVSequence(k, v, torch.randint(0, 128, (T,), generator=g))


@pytest.mark.parametrize("exact_coder", EXACT)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("predictor", FITTED)
def test_lossless_is_bit_exact_for_every_predictor(predictor, dtype, exact_coder, random_kv):
    comp = Delta(predictor=predictor, step=0, exact_coder=exact_coder)
    comp.fit([random_kv(T=64, seed=3, dtype=dtype)])
    kv = random_kv(T=64, dtype=dtype)
    kv.k[0, 0, 5, :4] = torch.tensor([0.0, -0.0, float("inf"), -1e-7]).to(dtype)  # zeros, inf, subnormal
    kv.v[1, 1, 7:9, 3] = torch.tensor([-float("inf"), float("nan")]).to(dtype)
    kv.v[1, 0, 7:10, 2] = torch.tensor([0x7C01, -0x0201, 0x7FFF], dtype=torch.int16).view(dtype)  # NaN payloads
    bs, out = _roundtrip(comp, kv)
    assert comp.lossless
    assert _same_bits(out.k, kv.k) and _same_bits(out.v, kv.v)
    assert bs.parts["k.residual"] > 0 and bs.parts["v.residual"] > 0
    # planes: each kind's section holds all it needs; laplace: the scales travel in their own section
    assert set(bs.parts) == {"frame", "k.residual", "v.residual"} | ({"scales"} if exact_coder == "laplace" else set())


@pytest.mark.parametrize("exact_coder", EXACT)
@pytest.mark.parametrize("predictor", FITTED)
def test_prediction_pays_on_correlated_kv(predictor, exact_coder):
    """On random walks every predictor codes exactly below the 16-bit baseline, and the coder's actual size
    sits within 1% of the model's own -log2 p estimate."""
    comp = Delta(predictor=predictor, exact_coder=exact_coder)
    comp.fit([_walk(seed=4)])
    kv = _walk()
    bs, out = _roundtrip(comp, kv)
    assert _same_bits(out.k, kv.k) and _same_bits(out.v, kv.v)
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


def test_linear_state_is_charged_per_weight():
    L, H, D = 3, 2, 16
    for order, wb in ((1, 8), (3, 8), (2, 16)):
        comp = Delta(predictor="linear", order=order, weight_bits=wb)
        comp.fit([_walk(seed=4)])
        per_kind = L * H * D * (order + 1) * wb + L * H * D * 8  # weights + an int8 shift per channel
        assert list(comp.state()) == ["k.weights", "v.weights"]
        assert _state_bits(comp) == 2 * per_kind
    assert Delta(predictor="previous").state() == {}


def test_cross_layer_state_is_charged_per_weight():
    L, H, D = 3, 2, 16
    comp = Delta(predictor="cross_layer", weight_bits=6)
    comp.fit([_walk(seed=4)])
    n = H * D
    assert _state_bits(comp) == 2 * (L - 1) * ((n + 1) * n * 6 + n * 8)


def test_bits_chooses_a_step_per_channel_and_charges_it():
    kv = _walk()
    comp = Delta(predictor="previous", bits=4.0)
    comp.fit([_walk(seed=4)])
    assert list(comp.state()) == ["k.steps", "v.steps"]
    assert _state_bits(comp) == 2 * 3 * 2 * 16 * 16  # one float16 step per channel, K and V
    steps = comp._steps["k"].double()
    assert steps.std() > 0  # channels differ
    bs, out = _roundtrip(comp, kv)
    err = (out.k.double() - kv.k.double()).abs()
    assert (err <= steps.unsqueeze(2) / 2 + _ulp(out.k) / 2 + 1e-12).all()
    # about `bits` bits per element at high rate (the rule is approximate)
    assert 2.5 < bs.num_bits / kv.n_elements < 5.5


@pytest.mark.parametrize("kw", [
    {"predictor": "linear"},
    {"predictor": "linear", "order": 3, "weight_bits": 12, "step": 0.05},
    {"predictor": "cross_layer", "weight_bits": 5},
    {"predictor": "cross_layer", "step": 0.1},
    {"predictor": "previous", "bits": 3.0},
    {"predictor": "linear", "bits": 2.0},
])
def test_a_decoder_rebuilt_from_the_state_bytes_decodes_the_same(kw):
    """What the harness does: the decoder is a fresh instance of the config that loaded the state as bytes."""
    enc = Delta(**kw)
    enc.fit([_walk(seed=4), _walk(seed=5, T=90)])
    kv = _walk()
    ctx = Context.for_kv(kv)
    bs = enc.encode(kv, ctx)
    dec = rebuild(enc)
    dec.load_state(_plain(enc))
    out = dec.decode(Bitstream.from_bytes(bs.data), ctx)
    ref = enc.decode(Bitstream.from_bytes(bs.data), ctx)
    assert _same_bits(out.k, ref.k) and _same_bits(out.v, ref.v)
    if enc.lossless:
        assert _same_bits(out.k, kv.k) and _same_bits(out.v, kv.v)
    # once used, the loaded state is the encoder's, bit for bit
    assert dec.state() == enc.state()
    assert enc.encode(kv, ctx).data == dec.encode(kv, ctx).data


def test_a_state_framed_by_the_harness_roundtrips():
    from kvbench.core.codec import decoder_for, state_bits, state_bytes

    enc = Delta(predictor="cross_layer", bits=3.0)
    enc.fit([_walk(seed=4)])
    state = state_bytes(enc)
    assert state_bits(state) > _state_bits(enc)  # the sections plus their frame
    kv = _walk()
    ctx = Context.for_kv(kv)
    out = decoder_for(enc, state).decode(enc.encode(kv, ctx), ctx)
    ref = enc.decode(enc.encode(kv, ctx), ctx)
    assert _same_bits(out.k, ref.k) and _same_bits(out.v, ref.v)


def _fitted_state(**kw):
    enc = Delta(**kw)
    enc.fit([_walk(seed=4)])
    return enc, _plain(enc)


@pytest.mark.parametrize("kw,section,cut", [
    ({"predictor": "linear"}, "k.weights", 1),
    ({"predictor": "linear", "weight_bits": 12}, "v.weights", 2),
    ({"predictor": "cross_layer"}, "v.weights", 5),
])
def test_a_weights_section_of_the_wrong_length_is_refused(kw, section, cut):
    enc, state = _fitted_state(**kw)
    kv = _walk()
    bs = enc.encode(kv, Context.for_kv(kv))
    for bad in (state[section][:-cut], state[section] + b"\x00" * cut):
        dec = rebuild(enc)
        dec.load_state({**state, section: bad})
        with pytest.raises(BitstreamError, match=rf"state section {section} .*holds {len(bad)} bytes"):
            dec.decode(bs, Context.for_kv(kv))


def test_malformed_state_sections_are_refused():
    enc, state = _fitted_state(predictor="linear", bits=3.0)
    kv = _walk()
    ctx = Context.for_kv(kv)
    bs = enc.encode(kv, ctx)
    with pytest.raises(BitstreamError, match=r"missing \['v\.steps'\], unexpected \[\]"):
        rebuild(enc).load_state({k: v for k, v in state.items() if k != "v.steps"})
    with pytest.raises(BitstreamError, match=r"unexpected \['tokens'\]"):
        rebuild(enc).load_state({**state, "tokens": b"\x00"})
    with pytest.raises(BitstreamError, match="k.steps holds 7 bytes, not a whole number of float16 steps"):
        rebuild(enc).load_state({**state, "k.steps": state["k.steps"][:7]})
    with pytest.raises(BitstreamError, match="k.weights is empty"):
        rebuild(enc).load_state({**state, "k.weights": b""})
    dec = rebuild(enc)
    dec.load_state({**state, "k.steps": state["k.steps"][:-2]})
    with pytest.raises(BitstreamError, match="k.steps holds 190 bytes, not the 192"):
        dec.decode(bs, ctx)
    dec = rebuild(enc)
    dec.load_state({**state, "v.steps": b"\x00\xfc" * (len(state["v.steps"]) // 2)})  # float16 -inf
    with pytest.raises(BitstreamError, match="v.steps is malformed"):
        dec.decode(bs, ctx)
    dec = rebuild(enc)
    weights = bytearray(state["k.weights"])
    weights[0] = 0  # 8-bit code 0 is weight -128, outside [-127, 127]
    dec.load_state({**state, "k.weights": bytes(weights)})
    with pytest.raises(BitstreamError, match=r"k.weights .*malformed: a weight lies outside"):
        dec.decode(bs, ctx)
    with pytest.raises(BitstreamError, match=r"takes the state sections \[\]; missing \[\], unexpected \['k\.weights'\]"):
        rebuild(Delta()).load_state({"k.weights": b"\x01"})


def test_a_state_for_another_shape_is_refused():
    enc, state = _fitted_state(predictor="linear")
    dec = rebuild(enc)
    dec.load_state(state)
    kv = _walk()
    dec.decode(enc.encode(kv, Context.for_kv(kv)), Context.for_kv(kv))
    other = _walk(L=2, H=2, D=24)  # as many channels, another shape
    with pytest.raises(ValueError, match="another cache shape"):
        dec.encode(other, Context.for_kv(other))


def test_codec_state_reaches_the_summary(tiny_cfg, tiny_handle):
    from kvbench.core.codec import state_bits, state_bytes
    from kvbench.measure.run import measure

    cfg = tiny_cfg("+compressor=delta", "compressor.predictor=linear", "metrics.nll=false")
    comp = make_compressor(cfg.compressor)
    s = measure(cfg, comp, tiny_handle)[0]
    assert s["lossless"] is True
    assert s["codec_bits"] == state_bits(state_bytes(comp)) > _state_bits(comp) > 0
    assert s["bits_by_part"]["side_info"] == s["codec_bits"]
    assert s["total_bits"] == sum(s["bits_by_part"].values())
    assert s["compressor_stats"]["ideal_bits.k.residual"] > 0


@pytest.mark.parametrize("override,match", [
    ("predictor=nearest", r"delta\.predictor='nearest' is not allowed; choose one of \['previous', 'linear', 'cross_layer'\]"),
    ("predictor=model", r"delta\.predictor=model is now its own compressor: use \+compressor=speculative"),
    ("order=0", r"delta\.order=0 is out of range; allowed: 1 <= order <= 16"),
    ("order=1.5", r"delta\.order=1\.5 must be a whole number"),
    ("step=-0.1", r"delta\.step=-0\.1 is out of range; allowed: 0\.0 <= step"),
    ("weight_bits=3", r"delta\.weight_bits=3 is out of range; allowed: 4 <= weight_bits <= 16"),
    ("bits=40", r"delta\.bits=40.* allowed: 0\.25 <= bits <= 12"),
    ("exact_coder=zstd", r"delta\.exact_coder='zstd' is not allowed; choose one of \['planes', 'laplace'\]"),
])
def test_bad_fields_name_what_is_allowed(override, match):
    cfg = compose(["+compressor=delta", f"compressor.{override}"])
    with pytest.raises(ValueError, match=match):
        make_compressor(cfg.compressor)


@pytest.mark.parametrize("field", ["predictor_dtype=int8", "token_coding=plain"])
def test_the_model_predictor_fields_are_no_longer_delta_fields(field):
    cfg = compose(["+compressor=delta", f"+compressor.{field}"])
    with pytest.raises(ValueError, match=r"'delta' has no field.*its fields are \['bits', 'exact_coder', 'order', 'predictor', 'step', 'weight_bits'\]"):
        make_compressor(cfg.compressor)


def test_conflicting_fields_are_refused():
    with pytest.raises(ValueError, match="step=0.1 or bits=3.0, not both"):
        Delta(step=0.1, bits=3.0)


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


# ---- the exact residual planes -----------------------------------------------------------------------------------


def test_zigzag_maps_small_differences_to_small_codes_and_inverts():
    d = np.arange(65536, dtype=np.uint32).astype(np.uint16)  # every difference modulo 2**16
    z = zigzag(d)
    assert np.array_equal(np.sort(z), d)  # a bijection
    assert np.array_equal(unzigzag(z), d)
    signed = d.view(np.int16).astype(np.int64)
    assert np.array_equal(z.astype(np.int64), np.where(signed >= 0, 2 * signed, -2 * signed - 1))


def _modes(section: bytes, n_channels: int) -> torch.Tensor:
    """The per-channel mode bits at the head of a planes residual section (1: residual from the prediction)."""
    return unpack_codes(section[: -(-n_channels // 8)], 1, n_channels).bool()


def _sorted_patterns(dtype, shape):
    """All 65,536 patterns (NaNs, infinities, -0, subnormals) in value order along the tokens: consecutive tokens
    differ by one step of the code, except across zero and into the NaNs."""
    L, H, T, D = shape
    x = from_codes(np.arange(65536), dtype)
    return x.reshape(L, H, D, T).permute(0, 1, 3, 2).contiguous()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("predictor", ["previous", "model"])
def test_planes_code_every_16_bit_pattern_exactly(dtype, predictor):
    """K: every pattern in value order, so the prediction pays on every channel (the decoder's cumulative sum for
    ``previous``, its loop over units for a model's prediction); V: the same patterns shuffled, where neither mode
    beats 16 bits."""
    shape = (2, 2, 256, 64)
    g = torch.Generator().manual_seed(0)
    k = _sorted_patterns(dtype, shape)
    v = k.reshape(-1)[torch.randperm(k.numel(), generator=g)].reshape(shape)
    kv = KVSequence(k, v)
    if predictor == "previous":
        preds = {"k": Previous(), "v": Previous()}
    else:  # within about one float16 step of every finite value
        noisy = lambda x: torch.where(x.isfinite(), x.double() * (1 + 1e-3 * torch.randn(shape, generator=g, dtype=torch.float64)), 0.0)  # noqa: E731
        preds = {kind: FromModel(noisy(getattr(kv, kind))) for kind in "kv"}
    coder = ResidualCoder("test")
    coded = coder.encode(kv, preds, None)
    assert list(coded.sections) == ["k.residual", "v.residual"]
    out = coder.decode(coded.sections, preds, shape, dtype, None)
    assert _same_bits(out["k"], k) and _same_bits(out["v"], v)
    modes = _modes(coded.sections["k.residual"], shape[0] * shape[1] * shape[3]).reshape(2, 2, 64)
    # the model predicts every finite value (its NaN channels are cheaper coded as they are)
    assert modes.all() if predictor == "previous" else modes[k.isfinite().all(2)].all()


def test_each_channel_codes_its_residual_only_where_that_pays():
    """Slowly moving channels code their residual from the previous token, i.i.d. channels their values; together
    they beat the byte planes of the values alone."""
    L, H, T, D = 2, 2, 512, 32
    g = torch.Generator().manual_seed(0)
    smooth = torch.randn(L, H, T, D // 2, generator=g).cumsum(2) * 0.01 + 3  # a few float16 steps per token
    noisy = torch.randn(L, H, T, D // 2, generator=g) * torch.logspace(-2, 1, D // 2)  # channel outliers
    kv = KVSequence(torch.cat([smooth, noisy], dim=3).half(), torch.cat([noisy, noisy.flip(2)], dim=3).half())
    ctx = Context.for_kv(kv)
    comp = Delta()
    bs, out = _roundtrip(comp, kv, ctx)
    assert _same_bits(out.k, kv.k) and _same_bits(out.v, kv.v)
    sec = bs.sections()
    k_modes = _modes(sec["k.residual"], L * H * D).reshape(L, H, D)
    assert k_modes[..., : D // 2].all() and not k_modes[..., D // 2 :].any()
    assert not _modes(sec["v.residual"], L * H * D).any()
    assert bs.num_bits < Lossless().encode(kv, ctx).num_bits


def test_a_planes_section_that_does_not_add_up_is_refused():
    kv = _walk()
    ctx = Context.for_kv(kv)
    comp = Delta()
    bs = comp.encode(kv, ctx)
    sec = bs.sections()
    for bad in (b"", sec["k.residual"][:10], sec["k.residual"][:-1], sec["k.residual"] + b"\x00"):
        with pytest.raises(BitstreamError, match=r"delta: (residual section|plane header)"):
            comp.decode(Bitstream.pack("delta", {**sec, "k.residual": bad}), ctx)
    corrupted = bytearray(bs.data)
    corrupted[len(corrupted) // 2] ^= 0x10
    with pytest.raises(BitstreamError, match="checksum mismatch"):
        comp.decode(Bitstream.from_bytes(bytes(corrupted)), ctx)
