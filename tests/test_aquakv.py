"""AQUA-KV (compressors/transform/aquakv.py): closed-loop cross-layer prediction, residual quantization, state as bytes."""

import pytest
import torch
from conftest import tiny_llama

from compressors.transform.aquakv import AquaKV
from compressors.transform.aquakv_code import ScalarCode
from compressors.transform.aquakv_predict import ridge_fit
from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.core.codec import decoder_for, state_bits, state_bytes
from kvbench.core.config import compose, make_compressor
from kvbench.core.kv import Context, KVSequence
from kvbench.inputs.capture import capture_window


def rel_mse(out: KVSequence, kv: KVSequence) -> tuple[float, float]:
    def rel(a, b):
        return float((a.float() - b.float()).pow(2).sum() / b.float().pow(2).sum())

    return rel(out.k, kv.k), rel(out.v, kv.v)


@pytest.fixture(scope="module")
def trace():
    """A real-ish trace: a tiny random Llama (4 layers, 2 KV heads of 16) prefilled on random token ids, keys
    captured before and after RoPE. Two calibration windows and one evaluated window of 128 tokens."""
    model = tiny_llama(seed=0, layers=4, kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(3):
        ids = torch.randint(0, 128, (129,), generator=g)
        got = capture_window(model, ids, 128, torch.float16, pre_rope=True)
        seqs.append(KVSequence(got["k"], got["v"], ids[:128], got["k_pre_rope"]))
    return model.config, seqs[:2], seqs[2]


def fitted(trace, **fields) -> tuple[AquaKV, KVSequence, Context]:
    config, calib, kv = trace
    comp = AquaKV(**fields)
    comp.fit(calib)
    return comp, kv, Context.for_kv(kv, config=config)


def test_roundtrip_through_a_fresh_decoder(trace):
    comp, kv, ctx = fitted(trace)
    bs = comp.encode(kv, ctx)
    dec = decoder_for(comp, state_bytes(comp))
    out = dec.decode(Bitstream.from_bytes(bs.data), ctx)
    assert out.shape == kv.shape and out.k.dtype == kv.k.dtype == out.v.dtype
    rk, rv = rel_mse(out, kv)
    assert rk < 0.1 and rv < 0.1, (rk, rv)


def test_decode_reproduces_the_encoders_closed_loop_bit_for_bit(trace):
    comp, kv, ctx = fitted(trace, bits=2.5)
    bs, recon = comp.encode_with_reconstruction(kv, ctx)
    assert bs.data == comp.encode(kv, ctx).data
    out = decoder_for(comp, state_bytes(comp)).decode(Bitstream.from_bytes(bs.data), ctx)
    assert torch.equal(out.k, recon.k) and torch.equal(out.v, recon.v)


def test_the_predictor_lowers_the_residual_energy_and_the_error(trace):
    errors = {}
    for scope in ("prev_layer_and_k", "prev_layer", "none"):
        comp, kv, ctx = fitted(trace, scope=scope)
        out = comp.decode(comp.encode(kv, ctx), ctx)
        errors[scope] = rel_mse(out, kv)
        stats = comp.stats()
        if scope != "none":
            # what is quantized is less than what there was (pre-RoPE keys, values), on the predicted layers
            assert stats["k.residual_energy"] < 0.7 * stats["k.target_energy"]
            assert stats["v.residual_energy"] < 0.7 * stats["v.target_energy"]
        else:
            assert stats == {}
    none_k, none_v = errors["none"]
    assert errors["prev_layer_and_k"][0] < 0.8 * none_k and errors["prev_layer_and_k"][1] < 0.6 * none_v
    # values gain from this layer's keys (the paper's scope) over the layer below alone
    assert errors["prev_layer_and_k"][1] < errors["prev_layer"][1] < none_v


def test_predictors_are_fitted_on_reconstructed_calibration_caches(trace):
    # fitted open loop (on the true layer below) the weights would not depend on how coarsely that layer is coded;
    # fitted on the codec's own reconstructions they do, and every layer's do
    config, calib, _ = trace
    fine, coarse = AquaKV(bits=4), AquaKV(bits=1)
    fine.fit(calib)
    coarse.fit(calib)
    for kind in ("k", "v"):
        a, b = fine._weights[kind], coarse._weights[kind]  # (L-1, n_in + 1, H·D)
        assert all(not torch.equal(a[layer], b[layer]) for layer in range(a.shape[0]))
    # the same windows, fitted twice, give the same bytes
    again = AquaKV(bits=4)
    again.fit(calib)
    assert state_bytes(again) == state_bytes(fine)


def test_more_bits_less_error(trace):
    errs = []
    for bits in (1, 2, 3, 4):
        comp, kv, ctx = fitted(trace, bits=bits)
        errs.append(sum(rel_mse(comp.decode(comp.encode(kv, ctx), ctx), kv)))
    assert all(a > b for a, b in zip(errs, errs[1:])), errs


def test_stream_holds_exact_sinks_codes_and_one_norm_per_vector(trace):
    comp, kv, ctx = fitted(trace, bits=2)
    L, H, T, D = kv.shape
    C = T - 4  # the coded tokens after the 4 sinks
    bs = comp.encode(kv, ctx)
    assert bs.parts["k.sinks"] == bs.parts["v.sinks"] == 16 * L * H * 4 * D
    assert bs.parts["k.codes2"] == bs.parts["v.codes2"] == 2 * L * H * C * D
    assert bs.parts["k.norm"] == bs.parts["v.norm"] == 16 * L * C  # vector=token: one float16 norm per token
    head = AquaKV(bits=2, vector="head")
    head.fit(trace[1])
    assert head.encode(kv, ctx).parts["k.norm"] == 16 * L * H * C
    first = AquaKV(bits=2, first_layer_bits=4)
    first.fit(trace[1])
    parts = first.encode(kv, ctx).parts
    assert parts["k.codes4"] == 4 * H * C * D and parts["k.codes2"] == 2 * (L - 1) * H * C * D


def test_sinks_are_exact_and_only_at_the_start_of_a_sequence(trace):
    config, calib, kv = trace
    comp = AquaKV(sinks=4)
    comp.fit(calib)
    ctx = Context.for_kv(kv, config=config)
    out = comp.decode(comp.encode(kv, ctx), ctx)
    assert torch.equal(out.k[:, :, :4], kv.k[:, :, :4]) and torch.equal(out.v[:, :, :4], kv.v[:, :, :4])
    assert not torch.equal(out.k[:, :, 4:8], kv.k[:, :, 4:8])
    # a segment starting at position 2 holds the sequence's last two sinks; one starting at 7 holds none
    for start, n_sink in ((2, 2), (7, 0)):
        seg = Context.for_kv(kv, config=config, start=start)
        bs = comp.encode(kv, seg)
        assert bs.parts["k.sinks"] == 16 * kv.shape[0] * kv.shape[1] * n_sink * kv.shape[3]
        assert torch.equal(comp.decode(bs, seg).k[:, :, :n_sink], kv.k[:, :, :n_sink])
    # a sequence no longer than the sinks is stored exactly, nothing coded
    short = kv.slice_tokens(0, 3)
    sctx = Context.for_kv(short, config=config)
    back = comp.decode(comp.encode(short, sctx), sctx)
    assert torch.equal(back.k, short.k) and torch.equal(back.v, short.v)
    # sinks=0 codes every token
    none = AquaKV(sinks=0)
    none.fit(calib)
    assert none.encode(kv, ctx).parts["k.sinks"] == 0


def test_state_is_the_predictor_weights_and_roundtrips(trace):
    comp, kv, ctx = fitted(trace, weight_bits=8)
    L, H, _, D = kv.shape
    W = H * D
    state = comp.state()
    assert set(state) == {"k.weights", "v.weights"}
    # 8-bit weights and an int8 shift per output channel, for layers 1..L-1; values read K̂_l and V̂_{l-1}
    assert state["k.weights"][1] == (L - 1) * ((W + 1) * W * 8 + W * 8)
    assert state["v.weights"][1] == (L - 1) * ((2 * W + 1) * W * 8 + W * 8)
    raw = state_bytes(comp)
    assert state_bits(raw) >= state["k.weights"][1] + state["v.weights"][1]
    dec = decoder_for(comp, raw)
    bs = comp.encode(kv, ctx)
    a, b = comp.decode(bs, ctx), dec.decode(bs, ctx)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    # more weight bits, more codec bits; the stream is unchanged in size
    wide, _, _ = fitted(trace, weight_bits=16)
    assert state_bits(state_bytes(wide)) > state_bits(raw)
    assert wide.encode(kv, ctx).num_bits == bs.num_bits


def test_decode_without_state_says_what_is_missing(trace):
    comp, kv, ctx = fitted(trace)
    bs = comp.encode(kv, ctx)
    with pytest.raises(ValueError, match="no predictor weights.*fit"):
        AquaKV().decode(bs, ctx)
    with pytest.raises(ValueError, match="no predictor weights"):
        AquaKV().encode(kv, ctx)


def test_state_for_another_shape_or_scope_is_refused(trace):
    comp, kv, ctx = fitted(trace)
    other = AquaKV(scope="prev_layer")  # values read fewer inputs: the bytes do not fit
    other.load_state({name: sec[0] for name, sec in comp.state().items()})
    with pytest.raises(BitstreamError, match="v.weights.*scope=prev_layer"):
        other.decode(comp.encode(kv, ctx), ctx)
    with pytest.raises(BitstreamError, match="expected"):
        AquaKV().load_state({"weights": b"\x00"})
    with pytest.raises(ValueError, match="scope=none has no fitted state"):
        AquaKV(scope="none").load_state({"k.weights": b"\x00", "v.weights": b"\x00"})


def test_scope_none_needs_no_fit_and_no_state(trace):
    config, _, kv = trace
    comp = AquaKV(scope="none")
    ctx = Context.for_kv(kv, config=config)
    out = comp.decode(comp.encode(kv, ctx), ctx)
    assert out.shape == kv.shape and comp.state() == {}


def test_pre_rope_needs_the_model_config_and_pre_rope_calibration_keys(trace):
    config, calib, kv = trace
    comp = AquaKV()
    comp.fit(calib)
    with pytest.raises(ValueError, match="ctx.config is None.*pre_rope=false"):
        comp.encode(kv, Context.for_kv(kv))
    bare = [KVSequence(c.k, c.v) for c in calib]  # no captured pre-RoPE keys
    with pytest.raises(ValueError, match="capture.pre_rope=true"):
        AquaKV().fit(bare)
    # with the config, fit undoes RoPE itself; pre_rope=false needs neither
    AquaKV().fit(bare, config=config)
    post = AquaKV(pre_rope=False)
    post.fit(bare)
    out = post.decode(post.encode(kv, Context.for_kv(kv)), Context.for_kv(kv))
    assert out.shape == kv.shape


def test_segment_start_position_is_honoured(trace):
    # a segment that starts later in its sequence: RoPE is undone and redone at its own positions
    comp, kv, _ = fitted(trace)
    config = trace[0]
    ctx = Context.for_kv(kv, config=config, start=7)
    out = decoder_for(comp, state_bytes(comp)).decode(comp.encode(kv, ctx), ctx)
    assert sum(rel_mse(out, kv)) < 1.0


def test_corrupted_stream_is_caught(trace):
    comp, kv, ctx = fitted(trace)
    bs = comp.encode(kv, ctx)
    bad = bytearray(bs.data)
    bad[len(bad) // 3] ^= 0x10
    with pytest.raises(BitstreamError):
        comp.decode(Bitstream(bytes(bad), bs.num_bits, bs.parts), ctx)
    short = Context.for_kv(kv.slice_tokens(0, 64), config=trace[0])
    with pytest.raises(BitstreamError, match="longer than"):
        comp.decode(bs, short)


@pytest.mark.parametrize("field, value, message", [
    ("bits", 0, r"aquakv\.bits=0 is out of range"),
    ("bits", 9, r"aquakv\.bits=9 is out of range"),
    ("bits", "2", r"aquakv\.bits='2' must be a number"),
    ("scope", "all", r"aquakv\.scope='all' is not allowed; choose one of \['prev_layer_and_k'"),
    ("ridge", -1.0, r"aquakv\.ridge=-1.0 is out of range"),
    ("vector", "layer", r"aquakv\.vector='layer' is not allowed"),
    ("first_layer_bits", 0.5, r"aquakv\.first_layer_bits=0.5 is out of range"),
    ("weight_bits", 3, r"aquakv\.weight_bits=3 is out of range"),
    ("weight_bits", 8.5, r"aquakv\.weight_bits=8.5 must be a whole number"),
    ("pre_rope", "yes", r"aquakv\.pre_rope='yes' must be true or false"),
    ("sinks", -1, r"aquakv\.sinks=-1 is out of range"),
    ("sinks", 2.5, r"aquakv\.sinks=2.5 must be a whole number"),
    ("seed", -1, r"aquakv\.seed=-1 is out of range"),
])
def test_bad_fields_say_what_is_allowed(field, value, message):
    with pytest.raises(ValueError, match=message):
        AquaKV(**{field: value})


def test_config_defaults_are_the_papers_operating_point():
    comp = make_compressor(compose(["+compressor=aquakv"]).compressor)
    assert isinstance(comp, AquaKV) and comp.bits == 2 and comp.scope == "prev_layer_and_k" and comp.pre_rope
    assert comp.needs_config


def test_ridge_fit_recovers_a_linear_map_and_its_bias():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(500, 6, generator=g, dtype=torch.float64)
    W = torch.randn(6, 3, generator=g, dtype=torch.float64)
    Y = X @ W + torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    got = torch.from_numpy(ridge_fit(X.numpy(), Y.numpy(), 0.0))
    assert torch.allclose(got[:-1], W, atol=1e-8) and torch.allclose(got[-1], torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64), atol=1e-8)
    # a rank-deficient input with no ridge still solves (least squares)
    Xd = torch.cat([X, X[:, :1]], dim=1)
    assert ridge_fit(Xd.numpy(), Y.numpy(), 0.0).shape == (8, 3)


def test_scalar_code_matches_its_own_decoder_and_the_sphere_codebook():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(300, 32, generator=g).numpy()
    code = ScalarCode(32, 2.5)  # 16 coordinates at 3 bits, 16 at 2
    norms, codes, rec = code.quantize(z, "k")
    assert [b for b, _ in codes] == [3, 2] and [len(raw) for _, raw in codes] == [n for _, n in code.code_bytes(300)]
    back = code.dequantize(norms, [raw for _, raw in codes], 300)
    assert (back == rec).all()
    err = ((rec - z) ** 2).sum() / (z**2).sum()
    assert 0.01 < err < 0.1  # about 2**-5 per coordinate at 2.5 bits


def test_one_thread_restores_the_thread_count():
    from compressors.transform.aquakv_predict import one_thread

    before = torch.get_num_threads()
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
