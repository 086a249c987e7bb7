"""KVQuant (arXiv 2401.18079): codebooks against Lloyd's theory, pre-RoPE keys, exact outliers, every bit counted."""

import math

import numpy as np
import pytest
import torch
from conftest import tiny_arch, tiny_llama

from compressors.quantizers.kvquant import HIST_BINS, KVQuant, index_bits, lloyd_1d, outlier_count
from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.coding.packing import tensor_from_bytes, unpack_codes
from kvbench.core.codec import decoder_for, state_bits, state_bytes
from kvbench.core.config import compose, make_compressor
from kvbench.core.kv import Context, KVSequence
from kvbench.inputs.capture import capture_window


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).pow(2).sum() / b.float().pow(2).sum())


def roundtrip(comp: KVQuant, kv: KVSequence, ctx: Context) -> tuple[KVSequence, Bitstream]:
    """Encode, then decode the stored bytes on a fresh instance that holds only the config and the state bytes."""
    bs = comp.encode(kv, ctx)
    return decoder_for(comp, state_bytes(comp)).decode(Bitstream.from_bytes(bs.data), ctx), bs


def uniform_kv(L=2, H=2, T=256, D=32, seed=0) -> KVSequence:
    """Every key channel and every value row uniform on its own interval (offsets and widths vary)."""
    g = torch.Generator().manual_seed(seed)
    u = lambda: torch.rand(L, H, T, D, generator=g) * 2 - 1  # (L, H, T, D) on [-1, 1]
    k = u() * (0.5 + torch.rand(L, H, 1, D, generator=g)) + 3 * torch.randn(L, H, 1, D, generator=g)
    v = u()
    return KVSequence(k.half(), v.half())


# ---- codebooks -------------------------------------------------------------------------------------------------


def test_lloyd_on_a_uniform_histogram_is_the_uniform_quantizer():
    for levels in (4, 8, 16):
        c = lloyd_1d(np.ones((3, HIST_BINS)), levels, iters=2000)
        np.testing.assert_allclose(c, np.broadcast_to(-1 + (2 * np.arange(levels) + 1) / levels, c.shape), atol=2e-3)


def test_lloyd_finds_two_clusters_and_keeps_an_empty_layer_on_a_grid():
    hist = np.zeros((2, HIST_BINS))
    hist[0, [100, 3000]] = [5, 7]  # two point masses
    c = lloyd_1d(hist, 4)
    centres = -1 + (np.array([100, 3000]) + 0.5) * 2 / HIST_BINS
    assert set(np.round(c[0], 6)) <= set(np.round(centres, 6)) and len(set(np.round(c[0], 6))) == 2
    np.testing.assert_allclose(c[1], np.linspace(-1, 1, 4))
    assert np.all(np.diff(c, axis=1) >= 0)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_uniform_vectors_get_the_uniform_quantizers_error(bits):
    # Lloyd's optimum for a uniform law is the uniform grid, whose error is step^2 / 12 per element; with the
    # range of each vector at [-r, r] that is (2r / 2**bits)^2 / 12 = r^2 / (3 * 4**bits), relative to E[x^2] = r^2/3
    comp = KVQuant(bits=bits, outlier_fraction=0.0, pre_rope=False)
    comp.fit([uniform_kv(seed=s) for s in (1, 2)])
    kv = uniform_kv(seed=3)
    out, _ = roundtrip(comp, kv, Context.for_kv(kv))
    assert rel_err(out.v, kv.v) == pytest.approx(4.0**-bits, rel=0.1)
    # keys: per-channel offsets are removed by the centre, so the error is the same fraction of each channel's spread
    centred = kv.k.float() - kv.k.float().mean(2, keepdim=True)
    err = float((out.k.float() - kv.k.float()).pow(2).sum() / centred.pow(2).sum())
    assert err == pytest.approx(4.0**-bits, rel=0.1)


def test_error_shrinks_as_bits_grow(random_kv):
    kv, calib = random_kv(T=128, D=32), random_kv(T=128, D=32, seed=5)
    errs = []
    for b in (2, 3, 4):
        comp = KVQuant(bits=b, pre_rope=False)
        comp.fit([calib])
        out, _ = roundtrip(comp, kv, Context.for_kv(kv))
        errs.append(rel_err(out.k, kv.k) + rel_err(out.v, kv.v))
    assert errs[0] > 2.5 * errs[1] > 6 * errs[2], errs


# ---- pre-RoPE keys -----------------------------------------------------------------------------------------------


def biased_llama(seed: int = 0):
    """A tiny Llama whose key projection has large per-channel offsets: before RoPE those channels are nearly
    constant, after RoPE they swing with the position (the structure KVQuant's pre-RoPE keys exploit)."""
    model = tiny_arch("llama", seed, attention_bias=True)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.copy_(4 * torch.randn(layer.self_attn.k_proj.bias.shape))
    return model


def window(model, seed: int, T: int = 192) -> KVSequence:
    ids = torch.randint(0, 128, (T,), generator=torch.Generator().manual_seed(seed))
    got = capture_window(model, ids, T, torch.float16, pre_rope=True)
    return KVSequence(got["k"], got["v"], ids, got["k_pre_rope"])


@pytest.fixture(scope="module")
def biased():
    model = biased_llama()
    return model, [window(model, s) for s in (1, 2)], window(model, 3)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pre_rope_keys_lose_less_than_post_rope_keys(biased, bits):
    model, calib, kv = biased
    ctx = Context.for_kv(kv, config=model.config)
    errs = {}
    for pre in (True, False):
        comp = KVQuant(bits=bits, pre_rope=pre)
        comp.fit(calib)
        out, _ = roundtrip(comp, kv, ctx)
        errs[pre] = rel_err(out.k, kv.k)
        assert rel_err(out.v, kv.v) < 0.15  # values are coded the same way either way
    assert errs[True] < 0.5 * errs[False], errs


def test_pre_rope_keys_on_an_unbiased_tiny_llama_roundtrip():
    model = tiny_llama()
    calib, kv = [window(model, 1, 128)], window(model, 2, 128)
    comp = KVQuant(bits=4)
    comp.fit(calib)
    out, _ = roundtrip(comp, kv, Context.for_kv(kv, config=model.config))
    assert rel_err(out.k, kv.k) < 0.01 and rel_err(out.v, kv.v) < 0.01


def test_a_later_segment_is_quantized_at_its_own_positions(biased):
    # the outliers are stored as the encoder saw them: before RoPE, so they are the model's own pre-RoPE keys at
    # the segment's positions (a wrong start would rotate every token by the same angle and store those instead)
    model, calib, kv = biased
    comp = KVQuant(bits=3)
    comp.fit(calib)
    seg = kv.slice_tokens(64, 192)
    L, H, T, D = seg.shape
    n_out = outlier_count(0.01, T)
    rows = seg.k_pre_rope.float().permute(0, 1, 3, 2).reshape(L, H * D, T)  # (L, H*D, T) captured pre-RoPE
    stored = {}
    for start in (64, 0):
        sec = comp.encode(seg, Context.for_kv(seg, config=model.config, start=start)).sections()
        pos = unpack_codes(sec["k.outlier_pos"], index_bits(T), L * H * D * n_out).long().view(L, H * D, n_out)
        vals = tensor_from_bytes(sec["k.outliers"], torch.float16, (L, H * D, n_out)).float()
        stored[start] = (vals - rows.gather(-1, pos)).abs().max()
    assert stored[64] < 0.02 < stored[0], stored


def test_fit_undoes_rope_itself_when_given_the_config(biased):
    model, calib, _ = biased
    post = [KVSequence(c.k, c.v, c.tokens) for c in calib]  # as captured without capture.pre_rope
    a, b = KVQuant(), KVQuant()
    a.fit(calib)
    b.fit(post, config=model.config)
    assert a.stats()["k_codebook_fit_on"] == "pre_rope (captured)"
    assert b.stats()["k_codebook_fit_on"] == "pre_rope (config)"
    np.testing.assert_allclose(a._codebooks["k"], b._codebooks["k"], atol=0.02)
    with pytest.warns(UserWarning, match="capture.pre_rope=true"):
        KVQuant().fit(post)


def test_runs_in_the_compressed_cache(biased):
    from kvbench.cache.compressed import CompressedCache

    model, calib, _ = biased
    comp = KVQuant(bits=4)
    comp.fit(calib)
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        base = model(ids).logits[0, -1]
        cache = CompressedCache(comp, residual=0, chunk=32, model=model)  # segments start at 0, 32, 64
        got = model(ids, cache=cache, use_cache=True).logits[0, -1]
        nxt = model(ids[:, :1], cache=cache, use_cache=True).logits[0, -1]
        plain = CompressedCache(None, model=model)
        model(ids, cache=plain, use_cache=True)
        ref = model(ids[:, :1], cache=plain, use_cache=True).logits[0, -1]
    assert cache.compressed_tokens >= 64
    assert torch.allclose(got, base, atol=1e-4)  # the prefill attends to its own fresh KV
    # the next token reads every earlier key back from 4-bit pre-RoPE codes, redone at their positions
    assert 0 < (nxt - ref).abs().max() < 0.1 * ref.abs().max()


# ---- outliers ---------------------------------------------------------------------------------------------------


def test_outliers_are_kept_exactly(random_kv):
    kv, calib = random_kv(L=2, H=2, T=200, D=32), random_kv(L=2, H=2, T=200, D=32, seed=4)
    # one spike per key channel (at a token that depends on the channel) and one per value row
    L, H, T, D = kv.shape
    ch = torch.arange(H * D).view(H, D)
    tok = (7 * ch + 3) % T  # (H, D)
    spikes_k = (50 + torch.arange(L * H * D).float().view(L, H, D)).half()
    at = (torch.arange(L)[:, None, None], torch.arange(H)[None, :, None], tok[None], torch.arange(D)[None, None, :])
    kv.k[at] = spikes_k
    pos_v = (5 * torch.arange(T)) % (H * D)  # (T,) position in the row of all heads
    rows = kv.v.permute(0, 2, 1, 3).reshape(L, T, H * D).clone()
    rows[:, torch.arange(T), pos_v] = -60.0
    kv.v.copy_(rows.view(L, T, H, D).permute(0, 2, 1, 3))
    comp = KVQuant(bits=2, outlier_fraction=0.01, pre_rope=False)  # 2 per key channel, 1 per value row
    assert outlier_count(0.01, T) == 2 and outlier_count(0.01, H * D) == 1
    comp.fit([calib])
    out, _ = roundtrip(comp, kv, Context.for_kv(kv))
    assert torch.equal(out.k[at], spikes_k)
    got_v = out.v.permute(0, 2, 1, 3).reshape(L, T, H * D)[:, torch.arange(T), pos_v]
    assert torch.all(got_v == -60.0)
    # and the spikes did not stretch the range the rest is quantized in
    rest = torch.ones_like(rows, dtype=torch.bool)
    rest[:, torch.arange(T), pos_v] = False
    dense = out.v.permute(0, 2, 1, 3).reshape(L, T, H * D)[rest].float() - rows[rest].float()
    assert float(dense.pow(2).mean()) < 0.15


def test_outlier_counts_and_index_widths():
    assert [outlier_count(0.01, n) for n in (1, 2, 49, 50, 150, 192, 1024)] == [0, 0, 0, 1, 2, 2, 10]
    assert outlier_count(0.2, 5) == 1  # two dense values stay on each side of a short vector
    assert [index_bits(n) for n in (1, 2, 3, 64, 65, 192, 1024)] == [0, 1, 2, 6, 7, 8, 10]


# ---- accounting and state ----------------------------------------------------------------------------------------


def test_every_section_has_its_hand_counted_size(random_kv):
    L, H, T, D = 2, 3, 100, 16
    kv = random_kv(L=L, H=H, T=T, D=D)
    comp = KVQuant(bits=3, outlier_fraction=0.05, pre_rope=False)
    comp.fit([random_kv(L=L, H=H, T=T, D=D, seed=2)])
    bs = comp.encode(kv, Context.for_kv(kv))
    kk, kv_ = 5, 2  # round(0.05 * 100) per key channel, round(0.05 * 48) per value row
    assert outlier_count(0.05, T) == kk and outlier_count(0.05, H * D) == kv_
    channels, tokens = L * H * D, L * T
    expected = {
        "k.codes": L * H * T * D * 3, "k.center": channels * 16, "k.range": channels * 16,
        "k.outliers": channels * kk * 16, "k.outlier_pos": channels * kk * 7,  # ceil(log2 100) = 7
        "v.codes": L * H * T * D * 3, "v.center": tokens * 16, "v.range": tokens * 16,
        "v.outliers": tokens * kv_ * 16, "v.outlier_pos": tokens * kv_ * 6,  # ceil(log2 48) = 6
    }
    assert {k: v for k, v in bs.parts.items() if k != "frame"} == expected
    assert bs.num_bits == bs.parts["frame"] + sum(expected.values())


def test_state_is_the_codebooks_and_a_fresh_decoder_reads_them(random_kv):
    kv = random_kv(T=128, D=32)
    comp = KVQuant(bits=3, pre_rope=False)
    assert comp.state() == {}
    comp.fit([random_kv(T=128, D=32, seed=8)])
    state = state_bytes(comp)
    sections = Bitstream.from_bytes(state).sections()
    assert set(sections) == {"k.codebook", "v.codebook"}
    assert all(len(raw) == 2 * 8 * 4 for raw in sections.values())  # 2 layers x 8 float32 levels
    assert state_bits(state) == 8 * len(state)
    dec = decoder_for(comp, state)
    np.testing.assert_array_equal(dec._codebooks["k"], comp._codebooks["k"])
    for kind in ("k", "v"):
        assert np.all(np.diff(comp._codebooks[kind], axis=1) > 0)
    ctx = Context.for_kv(kv)
    bs = comp.encode(kv, ctx)
    a, b = comp.decode(bs, ctx), dec.decode(Bitstream.from_bytes(bs.data), ctx)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_bfloat16_roundtrip(random_kv):
    kv = random_kv(T=96, D=32, dtype=torch.bfloat16)
    comp = KVQuant(pre_rope=False)
    comp.fit([random_kv(T=96, D=32, dtype=torch.bfloat16, seed=3)])
    out, bs = roundtrip(comp, kv, Context.for_kv(kv))
    assert out.k.dtype == torch.bfloat16 and rel_err(out.v, kv.v) < 0.05
    assert bs.parts["k.center"] == 2 * 2 * 32 * 16


# ---- errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, match", [
    ("compressor.bits=1", r"kvquant\.bits=1 .*2 <= bits <= 4"),
    ("compressor.bits=5", r"kvquant\.bits=5 .*2 <= bits <= 4"),
    ("compressor.bits=2.5", r"kvquant\.bits=2\.5 must be a whole number in \[2, 4\]"),
    ("compressor.outlier_fraction=0.5", r"kvquant\.outlier_fraction=0\.5 .*0\.0 <= outlier_fraction <= 0\.2"),
    ("compressor.outlier_fraction=-0.01", r"kvquant\.outlier_fraction=-0\.01"),
    ("compressor.outlier_fraction=lots", r"kvquant\.outlier_fraction='lots' must be a number"),
    ("compressor.pre_rope=maybe", r"kvquant\.pre_rope='maybe' must be true or false"),
])
def test_bad_fields_say_what_is_allowed(override, match):
    with pytest.raises(ValueError, match=match):
        make_compressor(compose(["+compressor=kvquant", override]).compressor)


def test_defaults_are_the_papers():
    comp = make_compressor(compose(["+compressor=kvquant"]).compressor)
    assert (comp.bits, comp.outlier_fraction, comp.pre_rope) == (3, 0.01, True)
    assert comp.needs_config


def test_pre_rope_without_a_config_is_a_clear_error(random_kv):
    kv = random_kv(T=64, D=16)
    comp = KVQuant()
    with pytest.warns(UserWarning):
        comp.fit([kv])
    with pytest.raises(ValueError, match=r"undoes RoPE with the model config.*ctx\.config is None.*pre_rope=false"):
        comp.encode(kv, Context.for_kv(kv))


def test_unfitted_or_mismatched_codebooks_are_refused(random_kv):
    kv = random_kv(L=2, T=64, D=16)
    with pytest.raises(ValueError, match=r"no codebooks: call fit"):
        KVQuant(pre_rope=False).encode(kv, Context.for_kv(kv))
    comp = KVQuant(pre_rope=False)
    comp.fit([random_kv(L=3, T=64, D=16)])
    with pytest.raises(ValueError, match="fitted for 3 layers; this KV has 2"):
        comp.encode(kv, Context.for_kv(kv))
    with pytest.raises(BitstreamError, match="state sections"):
        KVQuant().load_state({"k.codebook": b"\x00" * 32})
    with pytest.raises(BitstreamError, match="not whole 8-level float32 codebooks"):
        KVQuant().load_state({"k.codebook": b"\x00" * 33, "v.codebook": b"\x00" * 32})
    with pytest.raises(ValueError, match="none were given"):
        KVQuant().fit([])


# ---- real trace -------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_kvquant_on_smollm2_pre_rope_beats_post_rope():
    from kvbench.measure.run import measure

    rates, errs = {}, {}
    for pre in ("true", "false"):
        cfg = compose(["+compressor=kvquant", f"compressor.pre_rope={pre}", "metrics.nll=false"])
        summary, _ = measure(cfg, make_compressor(cfg.compressor))
        rates[pre], errs[pre] = summary["stream_bits_per_element"], summary["rel_mse_k"]
        # 3 code bits; per 1024-token channel 2 scales and 10 outliers at 16 + 10 bits; per 192-value token row
        # 2 scales and 2 outliers at 16 + 8 bits
        k_side = (32 + 10 * 26) / 1024
        v_side = (32 + 2 * 24) / 192
        assert summary["stream_bits_per_element"] == pytest.approx(3 + (k_side + v_side) / 2, abs=1e-3)
        assert summary["compressor_stats"]["k_codebook_fit_on"] == ("pre_rope (config)" if pre == "true" else "post_rope")
    assert errs["true"] < errs["false"], errs
    assert math.isclose(rates["true"], rates["false"])


# ---- RoPE on channel-major keys ------------------------------------------------------------------------------------


def _rope_configs():
    from test_rope import _tiny_gemma3
    from transformers import PhiConfig

    partial = PhiConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5)
    return {"llama": tiny_llama().config, "gemma3": _tiny_gemma3().config, "partial": partial}


@pytest.mark.parametrize("name", ["llama", "gemma3", "partial"])
def test_channel_major_rope_is_rotarys(name):
    from compressors.quantizers.kvquant import _ChannelRoPE
    from kvbench.core.rope import Rotary

    config = _rope_configs()[name]
    rotary, ours = Rotary(config), _ChannelRoPE(config)
    L = config.num_hidden_layers
    D = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    k = torch.randn(L, 2, 40, D, generator=torch.Generator().manual_seed(0))  # (L, H, T, D)
    if name == "partial":
        assert rotary.angles(40)[0].shape[-1] == D // 2  # only the leading half rotates
    cm = np.ascontiguousarray(k.numpy().transpose(0, 1, 3, 2))  # (L, H, D, T)
    for start in (0, 23):
        for ref, got in ((rotary.undo(k, start), ours.undo(cm, start)), (rotary.apply(k, start), ours.apply(cm, start))):
            np.testing.assert_allclose(got.transpose(0, 1, 3, 2), ref.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours.apply(ours.undo(cm, 5), 5), cm, rtol=1e-5, atol=1e-5)


def test_what_the_fit_reported_survives_the_state_cache(biased, tmp_path):
    from kvbench.core.codec import prepare

    _, calib, _ = biased
    cache = tmp_path / "kvquant.state"
    first = prepare(KVQuant(bits=3), lambda: calib, cache=cache)
    again = prepare(KVQuant(bits=3), lambda: calib, cache=cache)
    assert again.cached and not first.cached
    assert again.stats()["k_codebook_fit_on"] == first.stats()["k_codebook_fit_on"] == "pre_rope (captured)"
