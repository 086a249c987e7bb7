"""Contract tests that every configured compressor must pass, plus identity and KIVI specifics."""

import dataclasses

import pytest
import torch

from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.core.codec import decoder_for, state_bytes
from kvbench.core.compressor import rebuild
from kvbench.core.config import available, compose, make_compressor
from kvbench.core.kv import Context
from kvbench.store.paths import repo_root

ALL = available("compressor")


def _instantiate(name):
    return make_compressor(compose([f"+compressor={name}"]).compressor)


@pytest.mark.parametrize("name", ALL)
def test_every_config_instantiates(name):
    comp = _instantiate(name)
    assert comp.name, f"{name} has no registered name"
    assert dataclasses.is_dataclass(comp)


def _roundtrip_capable(comp):
    return not comp.needs_model


def _config_for(kv):
    """A tiny Llama config matching ``kv``'s shapes: the free model config a ``needs_config`` compressor reads."""
    from transformers import LlamaConfig

    L, H, _, D = kv.shape
    return LlamaConfig(vocab_size=128, hidden_size=H * D, intermediate_size=128, num_hidden_layers=L,
                       num_attention_heads=H, num_key_value_heads=H, head_dim=D, max_position_embeddings=512)


@pytest.mark.parametrize("name", ALL)
def test_roundtrip_shapes_accounting_and_checksum(name, random_kv):
    comp = _instantiate(name)
    if not _roundtrip_capable(comp):
        pytest.skip(f"{name} needs a model; covered by its own tests")
    kv = random_kv(T=160, D=64)
    calib = random_kv(T=160, D=64, seed=9)
    config = None
    if comp.needs_config:
        from kvbench.core.rope import Rotary

        config = _config_for(kv)
        # as a capture with capture.pre_rope=true would give them
        calib.k_pre_rope = Rotary(config).undo(calib.k).to(calib.k.dtype)
    comp.fit([calib])
    ctx = Context.for_kv(kv, config=config)
    bs = comp.encode(kv, ctx)
    assert sum(bs.parts.values()) == bs.num_bits
    assert len(bs.data) * 8 >= bs.num_bits
    # the decoder is another instance: the config, the fitted state as bytes and the stored stream, nothing more
    dec = decoder_for(comp, state_bytes(comp))
    assert dec is not comp
    out = dec.decode(Bitstream.from_bytes(bs.data), ctx)
    assert out.shape == kv.shape and out.k.dtype == kv.k.dtype
    if comp.lossless:
        assert torch.equal(out.k, kv.k) and torch.equal(out.v, kv.v)
    again = comp.decode(Bitstream.from_bytes(bs.data), ctx)
    assert torch.equal(again.k, out.k) and torch.equal(again.v, out.v)
    bad = bytearray(bs.data)
    bad[len(bad) // 2] ^= 0x01
    with pytest.raises(BitstreamError):
        dec.decode(Bitstream(bytes(bad), bs.num_bits, bs.parts), ctx)


@pytest.mark.parametrize("name", ALL)
def test_rebuild_gives_an_unfitted_instance_of_the_same_config(name):
    comp = _instantiate(name)
    fresh = rebuild(comp)
    assert type(fresh) is type(comp) and fresh.describe() == comp.describe() and fresh is not comp
    assert fresh.state() == {} and state_bytes(fresh) == b""


def test_state_sections_are_refused_by_a_compressor_without_state():
    with pytest.raises(ValueError, match="no fitted state"):
        _instantiate("identity").load_state({"weights": b"\x00"})


def test_readme_example_is_the_shipped_fp8_module():
    # the README's "adding a compressor" example is compressors/quantizers/fp8.py verbatim, so the contract suite above
    # (which covers every configs/compressor/*.yaml) runs the code a reader copies
    readme = (repo_root() / "README.md").read_text()
    module = (repo_root() / "compressors" / "quantizers" / "fp8.py").read_text()
    yaml = (repo_root() / "configs" / "compressor" / "fp8.yaml").read_text()
    assert f"```python\n{module}```" in readme and f"```yaml\n{yaml}```" in readme


def test_fp8_stores_eight_bits_per_element(random_kv):
    kv = random_kv(T=64, D=64)
    bs = _instantiate("fp8").encode(kv, Context.for_kv(kv))
    assert bs.parts["k"] == bs.parts["v"] == 8 * kv.k.numel()


def test_missing_compressor_lists_the_available_names():
    with pytest.raises(ValueError, match="identity.*kivi|kivi.*identity"):
        make_compressor(None)


def test_unknown_field_names_the_fields():
    cfg = compose(["+compressor=kivi", "+compressor.bogus=3"])
    with pytest.raises(ValueError, match="bogus.*fields are.*bits"):
        make_compressor(cfg.compressor)


@pytest.mark.parametrize("bits", [0, 9, 2.5, -1])
def test_kivi_bad_bits_say_what_is_allowed(bits):
    cfg = compose(["+compressor=kivi", f"compressor.bits={bits}"])
    with pytest.raises(ValueError, match=r"kivi\.bits=.*(1 <= bits <= 8|whole number in \[1, 8\])"):
        make_compressor(cfg.compressor)


def test_kivi_error_shrinks_as_bits_grow(random_kv):
    from compressors.quantizers.kivi import KIVI

    kv = random_kv(T=256, D=64)
    ctx = Context.for_kv(kv)
    errs = []
    for b in (1, 2, 3, 4, 6, 8):
        comp = KIVI(bits=b, group_size=32, residual=0)
        out = comp.decode(comp.encode(kv, ctx), ctx)
        errs.append(float((out.k.float() - kv.k.float()).pow(2).mean() + (out.v.float() - kv.v.float()).pow(2).mean()))
    assert all(a > b for a, b in zip(errs, errs[1:])), errs


def test_kivi_charges_codes_scales_and_window(random_kv):
    from compressors.quantizers.kivi import KIVI

    kv = random_kv(L=1, H=1, T=100, D=64)
    bs = KIVI(bits=2, group_size=32, residual=20).encode(kv, Context.for_kv(kv))
    # keys: 64 quantized tokens (2 whole groups of 32), 36 in 16 bit; values: 80 quantized, 20 in 16 bit
    assert bs.parts["k.codes"] == 64 * 64 * 2
    assert bs.parts["k.scale"] == bs.parts["k.zero"] == 2 * 64 * 16
    assert bs.parts["k.fp16_window"] == 36 * 64 * 16
    assert bs.parts["v.codes"] == 80 * 64 * 2
    assert bs.parts["v.scale"] == 80 * 2 * 16
    assert bs.parts["v.fp16_window"] == 20 * 64 * 16


def test_kivi_window_is_exact(random_kv):
    from compressors.quantizers.kivi import KIVI

    kv = random_kv(T=100, D=64)
    ctx = Context.for_kv(kv)
    out = KIVI(bits=2, residual=30).decode(KIVI(bits=2, residual=30).encode(kv, ctx), ctx)
    assert torch.equal(out.v[:, :, -30:], kv.v[:, :, -30:])
    assert not torch.equal(out.v[:, :, :70], kv.v[:, :, :70])
