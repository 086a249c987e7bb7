"""The real packaged SmolLM2-135M on real SOTU text: capture -> KIVI -> metrics. Needs `python -m kvbench assets`."""

import pytest

from kvbench.core.config import compose, make_compressor
from kvbench.inputs.models import ModelHandle
from kvbench.measure.run import measure

pytestmark = pytest.mark.integration

SMALL = ["dataset.n_sequences=2", "dataset.n_calib=1", "dataset.seq_len=256", "dataset.eval_len=64"]


@pytest.fixture(scope="module")
def handle():
    return ModelHandle(compose([]).model)


def _run(handle, *overrides):
    cfg = compose(["+compressor=kivi", *SMALL, *overrides])
    return measure(cfg, make_compressor(cfg.compressor), handle)[0]


def test_real_capture_kivi_metrics(handle):
    s4 = _run(handle, "compressor.bits=4", "compressor.residual=0")
    s2 = _run(handle, "compressor.bits=2", "compressor.residual=0")
    assert s4["n_tokens"] == 2 * 256 and s4["n_elements"] == 2 * 256 * 30 * 3 * 64 * 2
    # SmolLM2 on SOTU prose: a few bits per token, far below log2(vocab) = 15.6
    assert 2.0 < s4["bound_bits_per_token"] < 8.0
    assert 1.0 < s4["nll_base"] < 6.0
    assert s4["rel_mse_k"] < s2["rel_mse_k"] and s4["rel_mse_v"] < s2["rel_mse_v"]
    assert s2["delta_nll"] > s4["delta_nll"]
    assert s2["compression_ratio"] > s4["compression_ratio"] > 2.0


def test_real_identity_is_exact(handle):
    cfg = compose(["+compressor=identity", *SMALL])
    s = measure(cfg, make_compressor(cfg.compressor), handle)[0]
    assert s["lossless"] is True and s["delta_nll"] == 0.0


def test_real_kivi_on_the_standard_library_code(handle):
    # the second text domain needs nothing beyond make run's set-up: the interpreter ships it
    s = _run(handle, "dataset=stdlib_code")
    assert s["dataset"] == "stdlib_code" and s["n_tokens"] == 2 * 256
    assert 0.5 < s["bound_bits_per_token"] < 8.0 and s["delta_nll"] == s["delta_nll"]
