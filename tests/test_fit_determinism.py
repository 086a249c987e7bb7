"""Every fitted coder's state is the same bytes whatever the arithmetic's order: torch's thread count, the order of
the calibration windows (the order of every sum over samples), and the float64 products, solves and
eigendecompositions forced through another path
(:func:`compressors.predictive.fit_numerics.another_path`: sums in another order, another factorization), which is
what another machine's BLAS and LAPACK do. A fit that depended on any of them would give another machine another
codec, and another verdict."""

from __future__ import annotations

import hashlib

import pytest
import torch
from conftest import tiny_llama

from compressors.predictive import fit_numerics
from kvbench.core.codec import decoder_for, state_bytes
from kvbench.core.compressor import fits
from kvbench.core.config import compose, make_compressor
from kvbench.core.kv import Context, KVSequence
from kvbench.inputs.capture import capture_window

#: every fitted coder, at its default configuration and at the variants whose fit differs
CODERS = [
    ("aquakv", ["compressor.bits=2"]),
    ("aquakv", ["compressor.bits=3", "compressor.vector=head"]),
    ("kvtc", ["compressor.bits=2"]),
    ("kvtc", ["compressor.bits=1", "compressor.pca_scope=concat"]),
    ("kvtc", ["compressor.bits=2", "compressor.pca_scope=global"]),
    ("waterfill", []),
    ("kvquant", []),
    ("delta", ["compressor.predictor=linear", "compressor.bits=4"]),
    ("delta", ["compressor.predictor=cross_layer", "compressor.bits=4"]),
]


@pytest.fixture(scope="module")
def trace():
    """A tiny random Llama (3 layers, 2 KV heads of 16), three float16 calibration windows of 96 tokens and one to
    code, keys captured before RoPE as well."""
    model = tiny_llama(seed=3, layers=3, kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(11)
    windows = []
    for _ in range(4):
        ids = torch.randint(0, 128, (97,), generator=g)
        got = capture_window(model, ids, 96, torch.float16, pre_rope=True)
        windows.append(KVSequence(got["k"], got["v"], ids[:96], got["k_pre_rope"]))
    return model, windows[:3], windows[3]  # the last window is coded, never fitted on


def _coder(name: str, overrides: list[str]):
    return make_compressor(compose([f"+compressor={name}", *overrides]).compressor)


def _fitted_state(name: str, overrides: list[str], config, calib: list[KVSequence], threads: int) -> bytes:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        comp = _coder(name, overrides)
        comp.fit(calib, config=config)
        return state_bytes(comp)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("name", "overrides"), CODERS, ids=[" ".join([n, *o]) for n, o in CODERS])
def test_fitted_state_is_the_same_bytes_whatever_the_arithmetics_order(trace, name, overrides):
    model, calib, _ = trace
    config = model.config
    assert fits(_coder(name, overrides))
    reference = _fitted_state(name, overrides, config, calib, threads=1)
    assert reference, f"{name} {overrides} fitted no state"
    shuffled = [calib[i] for i in (2, 0, 1)]
    with fit_numerics.another_path():
        other = _fitted_state(name, overrides, config, shuffled, threads=2)
    assert hashlib.sha256(other).hexdigest() == hashlib.sha256(reference).hexdigest(), (
        f"{name} {overrides}: the fitted state depends on the order of the arithmetic")


def test_another_path_really_changes_float64_sums():
    """The perturbed path is a real perturbation: the same float64 product summed in another order differs in
    the last bits (else the test above would prove nothing)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 500, generator=g, dtype=torch.float64) * torch.logspace(-8, 8, 500, dtype=torch.float64)
    b = torch.randn(500, 32, generator=g, dtype=torch.float64)
    plain = fit_numerics.gemm(a, b)
    with fit_numerics.another_path():
        other = fit_numerics.gemm(a, b)
    assert not torch.equal(plain, other)
    assert torch.allclose(plain, other, rtol=1e-12, atol=1e-12 * float(plain.abs().max()))


@pytest.mark.parametrize(("name", "overrides"), CODERS, ids=[" ".join([n, *o]) for n, o in CODERS])
def test_the_fitted_encoder_codes_with_the_stored_state_alone(trace, name, overrides):
    """The encoder that fitted and an encoder rebuilt from the state bytes write the same stream: the encoder uses
    the stored (rounded) state, never the unrounded fit, so encoder and decoder agree bit for bit."""
    model, calib, kv = trace
    config = model.config
    comp = _coder(name, overrides)
    comp.fit(calib, config=config)
    rebuilt = decoder_for(comp, state_bytes(comp))
    ctx = Context.for_kv(kv, model if comp.needs_model else None, config)
    assert comp.encode(kv, ctx).data == rebuilt.encode(kv, ctx).data
