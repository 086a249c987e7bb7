"""speculative: KV coded as token ids plus the residual against a cheaper copy of the model, on the tiny random
model. Exactness, the step/2 bound, the token coders, a decoder that predicts otherwise, fields, the old spelling
``delta.predictor=model``."""

import math
from types import SimpleNamespace

import pytest
import torch

from compressors.predictive.delta import Delta
from compressors.predictive.speculative import Speculative
from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.core.codec import decoder_for, state_bytes
from kvbench.core.config import compose, make_compressor
from kvbench.core.kv import Context, KVSequence


def _same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _ulp(x):
    return (torch.nextafter(x, torch.full_like(x, math.inf)) - x).abs().double()


@pytest.fixture(scope="module")
def tiny_trace():
    from conftest import tiny_llama

    from kvbench.inputs.capture import capture_window

    model = tiny_llama()
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0))
    got = capture_window(model, ids, 40, torch.float16)
    kv = KVSequence(got["k"], got["v"], ids)
    return kv, Context.for_kv(kv, SimpleNamespace(model=model))


def _roundtrip(comp, kv, ctx):
    bs = comp.encode(kv, ctx)
    assert sum(bs.parts.values()) == bs.num_bits
    # the harness's decoder: a fresh instance of the config with the (empty) state
    dec = decoder_for(comp, state_bytes(comp))
    return bs, dec.decode(Bitstream.from_bytes(bs.data), ctx)


@pytest.mark.parametrize("dtype", ["bf16", "int8", "bf16_compute"])
def test_lossless_is_bit_exact_and_charges_the_tokens(tiny_trace, dtype):
    kv, ctx = tiny_trace
    comp = Speculative(predictor_dtype=dtype)
    assert comp.needs_model and comp.lossless and comp.state() == {}
    bs, out = _roundtrip(comp, kv, ctx)
    assert _same_bits(out.k, kv.k) and _same_bits(out.v, kv.v)
    assert torch.equal(out.tokens, kv.tokens)
    assert list(bs.sections()) == ["tokens", "scales", "k.residual", "v.residual", "crc"]
    # the ids cost about the cheap copy's cross-entropy plus the token coder's small header
    assert bs.parts["tokens"] >= comp.stats()["tokens.ideal_token_bits"]
    # a good prediction leaves far less than the 16-bit baseline to code
    assert (bs.parts["k.residual"] + bs.parts["v.residual"]) / kv.n_elements < 10


@pytest.mark.parametrize("token_coding", ["model", "plain"])
def test_lossy_is_within_half_a_step_and_nearly_free(tiny_trace, token_coding):
    kv, ctx = tiny_trace
    step = 0.01
    comp = Speculative(step=step, token_coding=token_coding)
    assert not comp.lossless
    bs, out = _roundtrip(comp, kv, ctx)
    assert list(bs.sections()) == ["tokens", "scales", "bounds", "k.residual", "v.residual", "crc"]
    for x, y in ((kv.k, out.k), (kv.v, out.v)):
        err = (x.double() - y.double()).abs()
        assert (err <= step / 2 + _ulp(y) / 2 + 1e-12).all()
    # the bf16-weight copy already predicts within the step almost everywhere
    assert (bs.parts["k.residual"] + bs.parts["v.residual"]) / kv.n_elements < 0.2


def test_plain_token_coding_stores_fixed_width_ids(tiny_trace):
    kv, ctx = tiny_trace
    comp = Speculative(token_coding="plain")
    bs, out = _roundtrip(comp, kv, ctx)
    assert _same_bits(out.k, kv.k) and torch.equal(out.tokens, kv.tokens)
    assert bs.parts["tokens"] == 7 * kv.n_tokens  # vocabulary of 128: 7 bits per id


def test_model_token_coding_embeds_a_recompute_stream(tiny_trace):
    kv, ctx = tiny_trace
    bs = Speculative().encode(kv, ctx)
    inner = Bitstream.from_bytes(bs.sections()["tokens"])
    assert inner.compressor == "recompute" and 8 * len(inner.data) == bs.parts["tokens"]


def test_a_decoder_with_another_predictor_fails_loudly(tiny_trace):
    kv, ctx = tiny_trace
    bs = Speculative(token_coding="plain", predictor_dtype="bf16").encode(kv, ctx)
    other = Speculative(token_coding="plain", predictor_dtype="int8")
    with pytest.raises(BitstreamError, match="fails its checksum"):
        other.decode(Bitstream.from_bytes(bs.data), ctx)


def test_needs_tokens_and_model(tiny_trace):
    kv, ctx = tiny_trace
    comp = Speculative()
    with pytest.raises(ValueError, match="needs the model"):
        comp.encode(kv, Context.for_kv(kv))
    with pytest.raises(ValueError, match="token ids"):
        comp.encode(KVSequence(kv.k, kv.v), ctx)


def test_a_delta_stream_is_not_read_as_speculative(tiny_trace):
    kv, ctx = tiny_trace
    bs = Delta().encode(kv, ctx)
    with pytest.raises(BitstreamError, match="written by compressor 'delta', not 'speculative'"):
        Speculative().decode(bs, ctx)


@pytest.mark.parametrize("override,match", [
    ("predictor_dtype=fp8", r"speculative\.predictor_dtype='fp8' is not allowed; choose one of \['bf16', 'int8', 'bf16_compute'\]"),
    ("token_coding=zip", r"speculative\.token_coding='zip' is not allowed; choose one of \['model', 'plain'\]"),
    ("step=-0.1", r"speculative\.step=-0\.1 is out of range; allowed: 0\.0 <= step"),
])
def test_bad_fields_name_what_is_allowed(override, match):
    cfg = compose(["+compressor=speculative", f"compressor.{override}"])
    with pytest.raises(ValueError, match=match):
        make_compressor(cfg.compressor)


def test_the_config_builds_the_default():
    comp = make_compressor(compose(["+compressor=speculative"]).compressor)
    assert comp == Speculative() and comp.name == "speculative"


@pytest.mark.parametrize("overrides", [
    ["compressor.predictor=model"],
    ["compressor.predictor=model", "compressor.step=0.1"],
])
def test_the_old_spelling_names_the_new_compressor(overrides):
    cfg = compose(["+compressor=delta", *overrides])
    with pytest.raises(ValueError, match=r"delta\.predictor=model is now its own compressor: use "
                                         r"\+compressor=speculative \(fields predictor_dtype, token_coding, step\)"):
        make_compressor(cfg.compressor)
    with pytest.raises(ValueError, match=r"\+compressor=speculative"):
        Delta(predictor="model")
