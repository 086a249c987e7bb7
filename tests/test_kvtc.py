"""KVTC (arXiv 2511.01815): allocation, exact sinks and window, rate, state as bytes, RoPE undo."""

import itertools

import numpy as np
import pytest
import torch
from conftest import tiny_llama

from compressors.transform.kvtc import Kvtc
from compressors.transform.kvtc_calibration import MAX_WIDTH, allocate_dp, allocate_uniform, principal_axes
from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.core.codec import decoder_for, state_bits, state_bytes
from kvbench.core.kv import Context, KVSequence
from kvbench.core.rope import Rotary
from kvbench.inputs.capture import capture_window

SMALL = {"sinks": 4, "window": 16}


@pytest.fixture(scope="module")
def llama_trace():
    """A tiny random Llama's config, two calibration windows and one evaluated window (float16 KV)."""
    model = tiny_llama()
    g = torch.Generator().manual_seed(3)

    def window(T):
        got = capture_window(model, torch.randint(0, 128, (T,), generator=g), T, torch.float16)
        return KVSequence(got["k"], got["v"])

    return model.config, [window(160), window(160)], window(96)


def _decaying_kv(L=2, H=2, T=200, D=16, seed=0):
    """KV whose per-layer vectors (all heads) have a geometrically decaying spectrum in a random basis."""
    g = torch.Generator().manual_seed(seed)
    d = H * D
    scale = 4.0 * 0.8 ** torch.arange(d, dtype=torch.float64)
    basis = torch.linalg.qr(torch.randn(L, d, d, generator=torch.Generator().manual_seed(100), dtype=torch.float64))[0]

    def one():
        z = torch.randn(L, T, d, generator=g, dtype=torch.float64) * scale  # (L, T, d)
        x = z @ basis.transpose(1, 2)  # (L, T, d)
        return x.reshape(L, T, H, D).permute(0, 2, 1, 3).to(torch.float16)  # (L, H, T, D)

    return KVSequence(one(), one())


def _mid_mse(a: KVSequence, b: KVSequence, sinks: int, window: int) -> float:
    T = a.n_tokens
    sl = slice(sinks, T - window)
    return float(sum((x[:, :, sl].float() - y[:, :, sl].float()).pow(2).mean() for x, y in ((a.k, b.k), (a.v, b.v))))


def _roundtrip(comp: Kvtc, kv: KVSequence, config=None, start=0):
    ctx = Context.for_kv(kv, config=config, start=start)
    bs = comp.encode(kv, ctx)
    dec = decoder_for(comp, state_bytes(comp))
    return bs, dec.decode(Bitstream.from_bytes(bs.data), Context.for_kv(kv, config=config, start=start))


# ---- allocation ----------------------------------------------------------------------------------------------------


def test_dp_allocation_is_optimal_and_within_budget():
    rng = np.random.default_rng(0)
    for trial in range(20):
        n, W = 4, 3
        dist = np.sort(rng.random((n, W + 1)) * rng.random((n, 1)) * 10, axis=1)[:, ::-1].copy()
        if trial % 2:
            dist = rng.random((n, W + 1))  # not monotone in the width: the DP must still be exact
        budget = int(rng.integers(0, n * W + 2))
        widths = allocate_dp(dist, budget)
        assert widths.sum() <= budget and widths.min() >= 0 and widths.max() <= W
        best = min(sum(dist[i, w] for i, w in enumerate(ws))
                   for ws in itertools.product(range(W + 1), repeat=n) if sum(ws) <= budget)
        assert dist[np.arange(n), widths].sum() == pytest.approx(best)


def test_uniform_allocation_spends_the_budget_evenly():
    widths = allocate_uniform(np.array([1.0, 5.0, 3.0, 2.0]), 9)
    assert widths.tolist() == [2, 3, 2, 2]
    assert allocate_uniform(np.ones(3), 100).tolist() == [MAX_WIDTH] * 3


def test_dp_meets_the_budget_and_beats_uniform_allocation_on_a_decaying_spectrum():
    calib, kv = [_decaying_kv(seed=1), _decaying_kv(seed=2)], _decaying_kv(seed=3)
    err, code_bits = {}, {}
    for allocation in ("dp", "uniform"):
        comp = Kvtc(bits=2, allocation=allocation, undo_rope=False, **SMALL)
        comp.fit(calib)
        widths = np.concatenate([c.widths.reshape(-1) for c in comp._codecs.values()])
        L, H, _, D = kv.shape
        assert widths.sum() <= 2 * 2 * L * H * D  # K and V: 2 bits per element each
        bs, out = _roundtrip(comp, kv)
        err[allocation] = _mid_mse(kv, out, 4, 16)
        code_bits[allocation] = bs.parts["k.codes"] + bs.parts["v.codes"]
    assert err["dp"] < 0.6 * err["uniform"], err
    assert code_bits["dp"] <= 1.1 * code_bits["uniform"], code_bits


def test_one_budget_for_keys_and_values_split_by_key_weight(llama_trace):
    config, calib, _ = llama_trace
    key_bits = []
    for weight in (4.0, 1.0, 0.25):
        comp = Kvtc(bits=2, key_weight=weight, **SMALL)
        comp.fit(calib, config=config)
        k, v = (comp._codecs[kind].widths.sum() for kind in ("k", "v"))
        assert k + v <= 2 * 2 * 2 * 2 * 16  # 2 bits for each of the K and V elements of a token
        key_bits.append(k)
    assert key_bits[0] > key_bits[1] > key_bits[2], key_bits


# ---- coding --------------------------------------------------------------------------------------------------------


def test_roundtrip_rate_and_accounting(llama_trace):
    config, calib, kv = llama_trace
    comp = Kvtc(bits=2, **SMALL)
    comp.fit(calib, config=config)
    bs, out = _roundtrip(comp, kv, config)
    assert out.shape == kv.shape and out.k.dtype == kv.k.dtype
    assert sum(bs.parts.values()) == bs.num_bits
    L, H, T, D = kv.shape
    n_exact = L * H * (4 + 16) * D
    assert bs.parts["k.exact"] == bs.parts["v.exact"] == 16 * n_exact
    # widths are calibrated so that a width-w coefficient costs about w coded bits
    coded = (bs.parts["k.codes"] + bs.parts["v.codes"]) / (2 * (kv.k.numel() - n_exact))
    assert 1.0 < coded < 2.6, coded
    rel = {name: float((a.float() - b.float()).pow(2).sum() / b.float().pow(2).sum())
           for name, a, b in (("k", out.k, kv.k), ("v", out.v, kv.v))}
    assert rel["k"] < 0.2 and rel["v"] < 0.05, rel


def test_sinks_and_window_are_exact_and_sinks_follow_the_absolute_position(llama_trace):
    config, calib, kv = llama_trace
    comp = Kvtc(bits=1, sinks=4, window=16)
    comp.fit(calib, config=config)
    _, out = _roundtrip(comp, kv, config)
    for a, b in ((out.k, kv.k), (out.v, kv.v)):
        assert torch.equal(a[:, :, :4], b[:, :, :4]) and torch.equal(a[:, :, -16:], b[:, :, -16:])
        assert not torch.equal(a[:, :, 4:-16], b[:, :, 4:-16])
    # a segment that starts at position 2 holds two of the four sinks; one starting at 10 holds none
    seg = kv.slice_tokens(2, 96)
    bs, out = _roundtrip(comp, seg, config, start=2)
    assert bs.parts["k.exact"] == 16 * 2 * 2 * (2 + 16) * 16
    assert torch.equal(out.k[:, :, :2], seg.k[:, :, :2]) and not torch.equal(out.k[:, :, 2:4], seg.k[:, :, 2:4])
    seg = kv.slice_tokens(10, 96)
    bs, _ = _roundtrip(comp, seg, config, start=10)
    assert bs.parts["k.exact"] == 16 * 2 * 2 * 16 * 16


def test_a_sequence_shorter_than_sinks_and_window_is_stored_exactly(llama_trace):
    config, calib, kv = llama_trace
    comp = Kvtc(bits=2, sinks=4, window=128)
    comp.fit(calib, config=config)
    bs, out = _roundtrip(comp, kv, config)
    assert "k.codes" not in bs.parts
    assert torch.equal(out.k, kv.k) and torch.equal(out.v, kv.v)


def test_more_bits_give_less_error_and_more_bits(llama_trace):
    config, calib, kv = llama_trace
    errs, sizes = [], []
    for bits in (0.5, 1, 2, 3, 4):
        comp = Kvtc(bits=bits, **SMALL)
        comp.fit(calib, config=config)
        bs, out = _roundtrip(comp, kv, config)
        errs.append(_mid_mse(kv, out, 4, 16))
        sizes.append(bs.num_bits)
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert all(a < b for a, b in zip(sizes, sizes[1:])), sizes


@pytest.mark.parametrize("scope", ["layer", "global", "concat"])
def test_state_crosses_as_bytes_and_decodes_identically(llama_trace, scope):
    config, calib, kv = llama_trace
    comp = Kvtc(bits=2, pca_scope=scope, **SMALL)
    comp.fit(calib, config=config)
    state = state_bytes(comp)
    assert state_bits(state) > 0
    ctx = Context.for_kv(kv, config=config)
    bs = comp.encode(kv, ctx)
    dec = decoder_for(comp, state)
    assert dec is not comp and state_bytes(dec) == state
    out, again = dec.decode(Bitstream.from_bytes(bs.data), ctx), comp.decode(Bitstream.from_bytes(bs.data), ctx)
    assert torch.equal(out.k, again.k) and torch.equal(out.v, again.v)
    bad = bytearray(bs.data)
    bad[len(bad) // 2] ^= 0x01
    with pytest.raises(BitstreamError):
        dec.decode(Bitstream(bytes(bad), bs.num_bits, bs.parts), ctx)


def test_one_shared_basis_costs_less_state_than_one_per_layer(llama_trace):
    config, calib, _ = llama_trace
    bits = {}
    for scope in ("layer", "global"):
        comp = Kvtc(bits=2, pca_scope=scope, **SMALL)
        comp.fit(calib, config=config)
        bits[scope] = state_bits(state_bytes(comp))
    assert bits["global"] < bits["layer"]


def test_state_of_another_scope_is_refused(llama_trace):
    config, calib, _ = llama_trace
    comp = Kvtc(bits=2, pca_scope="layer", **SMALL)
    comp.fit(calib, config=config)
    other = Kvtc(bits=2, pca_scope="global", **SMALL)
    with pytest.raises(BitstreamError, match="bases"):
        other.load_state(Bitstream.from_bytes(state_bytes(comp)).sections())


# ---- errors --------------------------------------------------------------------------------------------------------


def test_decode_and_encode_without_fit_or_state_say_so(llama_trace):
    config, _, kv = llama_trace
    ctx = Context.for_kv(kv, config=config)
    fresh = Kvtc(**SMALL)
    with pytest.raises(ValueError, match="no fitted state"):
        fresh.encode(kv, ctx)
    fitted = Kvtc(undo_rope=False, **SMALL)
    fitted.fit([kv])
    bs = fitted.encode(kv, ctx)
    with pytest.raises(ValueError, match="no fitted state"):
        Kvtc(undo_rope=False, **SMALL).decode(bs, ctx)


def test_rope_undo_needs_the_model_config(llama_trace):
    config, calib, kv = llama_trace
    with pytest.raises(ValueError, match="model config"):
        Kvtc(**SMALL).fit(calib)
    comp = Kvtc(**SMALL)
    comp.fit(calib, config=config)
    with pytest.raises(ValueError, match="ctx.config"):
        comp.encode(kv, Context.for_kv(kv))


def test_calibration_keys_captured_before_rope_need_no_config():
    model = tiny_llama()
    g = torch.Generator().manual_seed(5)
    got = [capture_window(model, torch.randint(0, 128, (160,), generator=g), 160, torch.float16, pre_rope=True)
           for _ in range(2)]
    calib = [KVSequence(c["k"], c["v"], k_pre_rope=c["k_pre_rope"]) for c in got]
    a, b = Kvtc(**SMALL), Kvtc(**SMALL)
    a.fit(calib)
    b.fit(calib, config=model.config)
    ca, cb = a._codecs["k"], b._codecs["k"]
    assert torch.allclose(ca.mean, cb.mean, atol=2e-3)
    assert np.array_equal(ca.widths, cb.widths)


def test_a_cache_of_another_shape_is_refused(llama_trace):
    config, calib, _ = llama_trace
    comp = Kvtc(**SMALL)
    comp.fit(calib, config=config)
    other = _decaying_kv(L=2, H=1, D=16)
    with pytest.raises(ValueError, match="fitted on KV"):
        comp.encode(other, Context.for_kv(other, config=config))


@pytest.mark.parametrize("field, value, match", [
    ("bits", -1, r"kvtc\.bits=-1 is out of range"),
    ("bits", 9, r"kvtc\.bits=9 is out of range"),
    ("bits", "two", r"kvtc\.bits='two' must be a number"),
    ("rank", 0, r"kvtc\.rank=0 is out of range"),
    ("rank", 2.5, r"kvtc\.rank=2\.5 must be a whole number"),
    ("sinks", -1, r"kvtc\.sinks=-1"),
    ("window", 1.5, r"kvtc\.window=1\.5 must be a whole number"),
    ("pca_scope", "heads", r"kvtc\.pca_scope='heads' is not allowed; choose one of \['layer', 'global', 'concat'\]"),
    ("allocation", "greedy", r"kvtc\.allocation='greedy' is not allowed"),
    ("key_weight", 0, r"kvtc\.key_weight=0 is out of range"),
    ("key_weight", None, r"kvtc\.key_weight=None must be a positive number"),
    ("undo_rope", "yes", r"kvtc\.undo_rope='yes' must be true or false"),
])
def test_bad_fields_say_what_is_allowed(field, value, match):
    with pytest.raises(ValueError, match=match):
        Kvtc(**{field: value})


# ---- RoPE ----------------------------------------------------------------------------------------------------------


def test_rope_undo_compacts_key_energy_on_a_llama_trace(llama_trace):
    config, calib, _ = llama_trace
    rope = Rotary(config)

    def top_share(k: torch.Tensor, top: int = 8) -> float:
        L, H, T, D = k.shape
        shares = []
        for layer in k.permute(0, 2, 1, 3).reshape(L, T, H * D).double():  # (T, H*D)
            var, _ = principal_axes(layer - layer.mean(0))
            shares.append(float(var[:top].sum() / var.sum()))
        return float(np.mean(shares))

    post = torch.cat([kv.k.float() for kv in calib], dim=2)
    pre = torch.cat([rope.undo(kv.k) for kv in calib], dim=2)
    assert top_share(pre) > top_share(post) + 0.05, (top_share(pre), top_share(post))


def test_rope_undo_lowers_key_error_at_the_same_budget(llama_trace):
    config, calib, kv = llama_trace
    err = {}
    for undo in (True, False):
        comp = Kvtc(bits=1, undo_rope=undo, **SMALL)
        comp.fit(calib, config=config)
        _, out = _roundtrip(comp, kv, config)
        err[undo] = float((out.k[:, :, 4:-16].float() - kv.k[:, :, 4:-16].float()).pow(2).mean())
    assert err[True] < err[False], err
