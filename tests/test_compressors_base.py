"""Contract tests that every configured compressor must pass, plus identity and KIVI specifics.

Every ``configs/compressor/*.yaml`` runs here, none skipped: compressors that need a model run on conftest's tiny
random Llama (its KV, token ids and weights), the others on random 16-bit KV (tests/stream_cases.py); the
integration test below runs the model-backed ones on the packaged model too. Every one also runs on the tiny
model's own cache, where its decoded K and V must stay under the relative MSE its class declares
(``max_rel_mse``): shapes and dtype alone would pass a lossy decoder that returns zeros.
"""

import dataclasses

import pytest
import torch
from stream_cases import (
    ALL,
    VARIANTS,
    build,
    check_distortion,
    check_roundtrip,
    device_under_test,
    instantiate,
    model_case,
    needs_model,
    tiny_model,
)

from compressors.eviction.evict import n_kept
from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.core.codec import decoder_for, state_bytes
from kvbench.core.compressor import rebuild
from kvbench.core.config import compose, make_compressor
from kvbench.core.kv import Context
from kvbench.store.paths import repo_root

_instantiate = instantiate
MODEL_BACKED = [n for n in ALL if needs_model(n)]


@pytest.mark.parametrize("name", ALL)
def test_every_config_instantiates(name):
    comp = _instantiate(name)
    assert comp.name, f"{name} has no registered name"
    assert dataclasses.is_dataclass(comp)


def test_the_contract_covers_every_compressor_config():
    assert ALL == sorted(p.stem for p in (repo_root() / "configs" / "compressor").glob("*.yaml")) and len(ALL) >= 20
    assert set(MODEL_BACKED) == {n for n in ALL if _instantiate(n).needs_model} >= {
        "snapkv", "tova", "h2o", "expected_attention", "recompute", "speculative"}


def test_the_tiny_model_runs_on_the_device_under_test():
    """scripts/device_check.sh runs this suite with KVBENCH_TEST_DEVICE=cuda: the model-backed cases then run there."""
    want, got = torch.device(device_under_test()), next(tiny_model().parameters()).device
    assert got.type == want.type and want.index in (None, got.index)


@pytest.mark.parametrize(("value", "device"), [(None, "cpu"), ("", "cpu"), (" cpu ", "cpu")])
def test_the_device_under_test_is_the_cpu_unless_set(value, device, monkeypatch):
    if value is None:
        monkeypatch.delenv("KVBENCH_TEST_DEVICE", raising=False)
    else:
        monkeypatch.setenv("KVBENCH_TEST_DEVICE", value)
    assert device_under_test() == device


@pytest.mark.parametrize("value", ["cuda:99", "gpu", "mps"])
def test_a_device_under_test_torch_cannot_see_is_refused(value, monkeypatch):
    monkeypatch.setenv("KVBENCH_TEST_DEVICE", value)
    with pytest.raises(ValueError, match=rf"KVBENCH_TEST_DEVICE: device='{value}' is not allowed"):
        device_under_test()


@pytest.mark.parametrize("name", ALL + list(VARIANTS))
def test_roundtrip_shapes_accounting_and_checksum(name):
    case = build(name)
    comp, bs = case.encoder, case.stream
    assert sum(bs.parts.values()) == bs.num_bits
    assert len(bs.data) * 8 >= bs.num_bits
    stored = Bitstream.from_bytes(bs.data)  # the accounting is rebuilt from the stored bytes alone
    assert stored.num_bits == bs.num_bits and dict(stored.parts) == dict(bs.parts) and stored.compressor == comp.name
    # the decoder is another instance: the config, the fitted state as bytes and the stored stream, nothing more
    dec = decoder_for(comp, state_bytes(comp))
    assert dec is not comp and type(dec) is type(comp)
    out = case.decode(bs.data, dec)
    check_roundtrip(case, out)
    again = case.decode(bs.data, comp)
    for a, b in zip(again, out):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    bad = bytearray(bs.data)
    bad[len(bad) // 2] ^= 0x01
    with pytest.raises(BitstreamError, match="checksum"):
        case.decode(bytes(bad), dec)


@pytest.mark.parametrize("name", ALL)
def test_default_configuration_stays_under_its_declared_distortion(name):
    """On the tiny model's cache (fitted on another window of it), as the harness runs a cell."""
    check_distortion(model_case(name))


@pytest.mark.parametrize("target", ["compressors.quantizers.turboquant.TurboQuant", "compressors.quantizers.kivi.KIVI"])
def test_a_lossy_decoder_returning_zeros_fails_the_contract(target, monkeypatch):
    """The distortion check is what catches a broken lossy decoder: the shape contract alone passes this one."""
    import hydra.utils

    cls = hydra.utils.get_class(target)
    real = cls.decode

    def zeros(self, bs, ctx):
        out = real(self, bs, ctx)
        return dataclasses.replace(out, k=torch.zeros_like(out.k), v=torch.zeros_like(out.v))

    monkeypatch.setattr(cls, "decode", zeros)
    case = model_case.__wrapped__(cls.name)  # built afresh, past the cache of honest cases
    check_roundtrip(case, case.decoded)  # the shape contract holds ...
    with pytest.raises(AssertionError, match=f"{cls.name}: relative MSE of K is 1 on the tiny model's cache"):
        check_distortion(case)  # ... the distortion contract does not


def test_an_eviction_method_keeping_other_than_it_declares_fails_the_contract(monkeypatch):
    """An encoder that keeps 8 more tokens per head than ``keep`` says: its stream, kept entries and zeros are all
    consistent, only the declared fraction catches it."""
    import compressors.eviction.evict as evict

    monkeypatch.setattr(evict, "n_kept", lambda owner, keep, n: n_kept(owner, keep, n) + 8)
    case = model_case.__wrapped__("knorm")
    check_roundtrip(case, case.decoded)
    want = n_kept("knorm", case.encoder.keep, case.kvs[0].n_tokens)
    with pytest.raises(AssertionError, match=rf"knorm kept \[\[{want + 8}, .* declares {want} of"):
        check_distortion(case)


@pytest.mark.integration
@pytest.mark.parametrize("name", MODEL_BACKED)
def test_model_backed_compressors_roundtrip_on_the_packaged_model(name, packaged):
    """The same contract on the packaged model's own cache of a short window (token ids and weights in the
    context), decoded by an instance rebuilt from the config."""
    from stream_cases import Case

    comp = _instantiate(name)
    kv, handle = packaged(_packaged_tokens(comp))
    ctx = Context.for_kv(kv, handle, config=handle.model.config)
    comp.fit([kv], config=handle.model.config)  # a fitted coder learns from the window it codes: a shape check only
    case = Case(name, comp, decoder_for(comp, state_bytes(comp)), [kv], [ctx], comp.encode(kv, ctx))
    assert sum(case.stream.parts.values()) == case.stream.num_bits
    check_roundtrip(case, case.decode(case.stream.data))


def _packaged_tokens(comp) -> int:
    """A short window, and one long enough that a coder's exact sinks fit its default budget where it keeps any
    (4 of them cost 16 x 4 / 96 = 0.67 bits per element): the model-running decoders step once per token."""
    return 96 if comp.exact_tokens(96).sinks else 24


@pytest.fixture(scope="module")
def packaged():
    """``T -> (KV, handle)``: T tokens of the packaged default model's 16-bit cache, with the ids, and the model
    handle."""
    from functools import cache

    from kvbench.core.kv import KVSequence
    from kvbench.inputs.capture import capture_window
    from kvbench.inputs.models import ModelHandle

    handle = ModelHandle(compose([]).model)
    text = "Four score and seven years ago our fathers brought forth on this continent a new nation, conceived in "

    @cache
    def window(T: int):
        ids = torch.tensor(handle.tokenizer(text * 6).input_ids[:T])
        got = capture_window(handle.model, ids, ids.numel(), torch.float16)
        return KVSequence(got["k"], got["v"], ids), handle

    return window


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
