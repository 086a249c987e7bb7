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


def test_recompute_rate_is_the_bound_and_tokens_are_exact(handle, tmp_path):
    from kvbench.inputs.capture import capture

    # recompute's decoder reproduces a prefill bit for bit only on the torch threads that ran it: the trace is
    # captured here, by this process, not taken from a cache another process may have filled on other threads
    args = ["+compressor=recompute", "dataset.seq_len=128", *SHORT]
    capture(compose(args), handle, tmp_path / "trace")
    cfg = compose([*args, f"trace={tmp_path / 'trace'}"])
    s = measure(cfg, make_compressor(cfg.compressor), handle)[0]
    T, bound = s["n_tokens"], s["bound_bits_per_token"]
    # exact token ids, then the same prefill that captured the trace: the regenerated KV is bit-identical here
    assert s["lossless"] is True and s["max_abs_err_k"] == 0.0
    # the token stream is within 3% of the model's cross-entropy on the same tokens, plus one 32-bit coder
    # flush; the rest (frame, first token, checksum) is a small fixed header
    assert abs(s["bits_by_part"]["tokens"] - bound * (T - 1)) <= 0.03 * bound * (T - 1) + 32
    assert s["bits_by_part"]["first"] == 16 and s["bits_by_part"]["crc"] == 32
    # decode time is split into its two stages (how long each takes is the machine's business)
    assert {"decode_tokens_s", "decode_prefill_s"} <= set(s["compressor_stats"])


def test_recompute_decodes_one_token_per_step_then_prefills_once(handle):
    """What ``decode_s`` holds, counted instead of timed: the decoder runs the model once per token after the
    first, on one new token at a time (it knows only the tokens it has decoded), then once on the whole window."""
    import torch

    from compressors.exact.recompute import Recompute
    from kvbench.coding.bitstream import Bitstream
    from kvbench.core.kv import Context, KVSequence
    from kvbench.inputs.capture import capture_window
    from kvbench.inputs.forward import decoder_of

    ids = torch.tensor(handle.tokenizer("Four score and seven years ago our fathers brought forth").input_ids)
    T = ids.numel()
    got = capture_window(handle.model, ids, T, torch.float16)
    kv = KVSequence(got["k"], got["v"], ids)
    ctx = Context.for_kv(kv, handle)
    bs = Recompute().encode(kv, ctx)
    calls = []
    # on the decoder stack: the prefill runs it without the LM head (kvbench.inputs.forward), a decoding step with it
    hook = decoder_of(handle.model).register_forward_pre_hook(lambda _m, args, kwargs: calls.append(
        (args[0] if args else kwargs["input_ids"]).shape[-1]), with_kwargs=True)
    try:
        out = Recompute().decode(Bitstream.from_bytes(bs.data), ctx)
    finally:
        hook.remove()
    assert calls == [1] * (T - 1) + [T]
    assert torch.equal(out.tokens, ids) and torch.equal(out.k, kv.k) and torch.equal(out.v, kv.v)


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
