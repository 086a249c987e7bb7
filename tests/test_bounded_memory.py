"""Capture and scoring in bounded memory on tiny random models: the chunked forward and LM head give the model's own
log-probabilities and cache, a window that cannot fit or that runs past the model's positions is refused before the
model runs, and every run summary records the peak resident memory."""

from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_arch, tiny_llama
from transformers import DynamicCache

from kvbench.core.config import make_compressor
from kvbench.core.kv import KVSequence
from kvbench.core.rope import Rotary
from kvbench.inputs import capture as capture_mod
from kvbench.inputs import forward
from kvbench.inputs.capture import capture_command, capture_window, default_trace_dir, load_or_capture
from kvbench.inputs.footprint import WindowTooLarge, estimate, parameters
from kvbench.inputs.positions import BeyondPositions, position_limit
from kvbench.measure.metrics.task_loss import continuation_nlls
from kvbench.measure.run import measure
from kvbench.sweep.cells import run_cell


def tiny_gemma3(cap: float = 0.5):
    """A tiny random Gemma 3: one sliding-window layer (window 8) and one full, two KV heads with per-head key
    norms, final-logit soft-capping at ``cap`` (small, so that capping changes every log-probability)."""
    return tiny_arch("gemma3", num_key_value_heads=2, final_logit_softcapping=cap, query_pre_attn_scalar=256)


def _model_logprobs(model, ids):
    """log p(ids[t+1] | ids[:t+1]) from the model's own forward: full (T, V) logits, one pass."""
    with torch.no_grad():
        logits = model(ids[None]).logits[0].float()  # (T, V)
    return torch.log_softmax(logits, -1)[torch.arange(ids.numel() - 1), ids[1:]]  # (T-1,)


@pytest.fixture()
def small_blocks(monkeypatch):
    """Blocks of 5 rows of logits and chunks of 7 tokens: every window of these tests spans several of each."""
    monkeypatch.setattr(forward, "LOGIT_BYTES", 5 * 4 * 128)
    monkeypatch.setattr(forward, "PREFILL_CHUNK", 7)
    monkeypatch.setattr(forward, "SCORE_CHUNK", 3)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_chunked_logprobs_equal_the_models_own(make, small_blocks):
    model = make()
    assert forward.logit_rows(model) == 5
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1))
    got = forward.scored_forward(model, ids, DynamicCache(), ids[1:])  # (39,)
    torch.testing.assert_close(got, _model_logprobs(model, ids), rtol=0, atol=1e-5)


def test_soft_capping_is_applied_as_gemma_applies_it():
    model = tiny_gemma3(cap=0.5)
    ids = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = forward.decoder_of(model)(input_ids=ids[None]).last_hidden_state[0]  # (T, hidden)
        torch.testing.assert_close(forward.logits_of(model, hidden), model(ids[None]).logits[0], rtol=0, atol=1e-6)
    assert forward.logits_of(model, hidden).abs().max() <= 0.5  # capped: tanh bounds every logit by the cap


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_capture_in_chunks_matches_one_pass(make, small_blocks):
    model = make()
    ids = torch.randint(0, 128, (41,), generator=torch.Generator().manual_seed(3))
    got = capture_window(model, ids, 40, torch.float32, pre_rope=True)
    with torch.no_grad():
        out = model(ids[:40][None], cache=DynamicCache(), use_cache=True)  # one pass, the model's own forward
    k = torch.stack([layer.keys[0] for layer in out.cache.layers])  # (L, H, T, D)
    v = torch.stack([layer.values[0] for layer in out.cache.layers])  # (L, H, T, D)
    assert got["k"].shape == k.shape and k.shape[2] == 40  # sliding-window layers keep all 40 tokens
    torch.testing.assert_close(got["k"], k, rtol=0, atol=1e-5)
    torch.testing.assert_close(got["v"], v, rtol=0, atol=1e-5)
    torch.testing.assert_close(got["logprobs"], _model_logprobs(model, ids[:40]), rtol=0, atol=1e-5)
    # the keys before RoPE, rotated at their positions, are the cached ones
    torch.testing.assert_close(Rotary(model.config).apply(got["k_pre_rope"], 0), k, rtol=0, atol=1e-5)


def test_capture_frees_each_float32_layer_once_copied(tiny_model):
    cache = DynamicCache()
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(4))
    forward.scored_forward(tiny_model, ids, cache, ids[1:])
    keys = [layer.keys.clone() for layer in cache.layers]
    k, _ = capture_mod._cache_kv(cache, torch.float16, 20)
    assert all(layer.keys is None and layer.values is None for layer in cache.layers)
    assert torch.equal(k, torch.stack([x[0] for x in keys]).half())


@pytest.mark.parametrize("evicted", [False, True])
def test_continuation_scored_in_chunks_equals_one_pass(tiny_model, small_blocks, monkeypatch, evicted):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (50,), generator=g)
    got = capture_window(tiny_model, ids, 30, torch.float32)
    kept = torch.rand(2, 2, 30, generator=g) > 0.4 if evicted else None  # (L, H, T)
    kv = KVSequence(got["k"], got["v"], ids[:30], kept=kept)
    chunked = continuation_nlls(tiny_model, kv, ids[29:])
    monkeypatch.setattr(forward, "SCORE_CHUNK", 64)  # one pass
    monkeypatch.setattr(forward, "LOGIT_BYTES", 1 << 30)  # one block
    one = continuation_nlls(tiny_model, kv, ids[29:])
    assert chunked.shape == (20,)
    assert abs(chunked - one).max() < 1e-5


def test_parameters_from_the_config_count_the_model(tiny_model):
    for model in (tiny_model, tiny_gemma3()):
        actual = sum(p.numel() for p in model.parameters())
        assert parameters(model.config) == pytest.approx(actual, rel=0.01)  # norms are left out


def test_the_estimate_grows_with_the_window(tiny_model):
    small = estimate(tiny_model.config, 1000, 100, 3, 2, loaded=True)
    big = estimate(tiny_model.config, 4000, 100, 3, 2, loaded=True)
    per_token = 2 * 2 * 2 * 16  # K and V x layers x KV heads x head_dim
    assert small.kv_float32 == 4 * per_token * (1000 + 100)  # float32, the prefix and the scored tokens
    assert small.kv_held == 2 * per_token * 1000 * 3  # 16-bit, the prefix, 3 windows
    assert big.kv_float32 - small.kv_float32 == 4 * per_token * 3000
    assert big.working > small.working and big.total > small.total
    assert small.weights == 4 * parameters(tiny_model.config)


def test_a_window_over_the_memory_limit_is_refused_before_the_model_runs(tiny_cfg, tiny_handle):
    cfg = tiny_cfg("+compressor=identity", "memory.limit_gb=0.01")
    with pytest.raises(WindowTooLarge) as e:
        measure(cfg, make_compressor(cfg.compressor), tiny_handle)
    msg = str(e.value)
    assert "\n" not in msg
    assert "needs an estimated" in msg and "the limit is 0.01 GB (memory.limit_gb=0.01)" in msg
    assert not default_trace_dir(cfg).exists()  # nothing captured
    with pytest.raises(WindowTooLarge, match="memory.limit_gb=0.01"):
        capture_mod.capture(cfg, tiny_handle, default_trace_dir(cfg))
    measure(tiny_cfg("+compressor=identity", "memory.limit_gb=20"), make_compressor(cfg.compressor), tiny_handle)


def test_a_stored_trace_is_refused_before_scoring_on_it(tiny_cfg, tiny_handle):
    load_or_capture(tiny_cfg(), tiny_handle)
    cfg = tiny_cfg("+compressor=identity", "memory.limit_gb=0.01")
    with pytest.raises(WindowTooLarge):
        measure(cfg, make_compressor(cfg.compressor), tiny_handle)
    measure(tiny_cfg("+compressor=identity", "memory.limit_gb=0.01", "metrics.nll=false"),
            make_compressor(cfg.compressor), tiny_handle)  # no model runs: nothing to refuse


def test_a_window_beyond_the_models_positions_is_refused_unless_allowed(tiny_cfg, tiny_handle):
    # the tiny model has 512 positions; 500 + 16 continuation tokens run past them
    window = ("+compressor=identity", "dataset.seq_len=500", "dataset.eval_len=16", "dataset.n_sequences=1",
              "metrics.recall_tokens=0")
    cfg = tiny_cfg(*window)
    with pytest.raises(BeyondPositions) as e:
        run_cell("run", cfg, tiny_handle)
    msg = str(e.value)
    for part in ("dataset.seq_len=500", "516 positions", "512 (max_position_embeddings)",
                 "dataset.allow_beyond_positions=true"):
        assert part in msg
    assert not default_trace_dir(cfg).exists()  # refused before any work
    # 460 + 16 fit, but the long-range probe feeds 64 tokens after the prefix
    with pytest.raises(BeyondPositions, match=r"metrics.recall_tokens=64 feeds the model 524 positions"):
        run_cell("run", tiny_cfg("+compressor=identity", "dataset.seq_len=460", "dataset.eval_len=16"), tiny_handle)
    allowed = tiny_cfg(*window, "dataset.allow_beyond_positions=true")
    summary = run_cell("run", allowed, tiny_handle).summary
    assert summary["allow_beyond_positions"] is True and summary["n_tokens"] == 500
    assert "dataset.allow_beyond_positions=true" in capture_command(allowed)
    assert "allow_beyond_positions" not in capture_command(cfg)


def test_positions_come_from_the_config_or_its_declared_rope_scaling():
    assert position_limit(SimpleNamespace(max_position_embeddings=8192)) == (8192, "max_position_embeddings")
    yarn = SimpleNamespace(max_position_embeddings=32768, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6})
    assert position_limit(yarn)[0] == 131072 and "yarn" in position_limit(yarn)[1]
    per_layer_type = SimpleNamespace(max_position_embeddings=32768, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0}, "sliding_attention": {"rope_type": "default"}})
    assert position_limit(per_layer_type)[0] == 32768  # no original positions declared: the config's own


def test_every_run_summary_records_the_peak_resident_memory(tiny_cfg, tiny_handle):
    summary = run_cell("run", tiny_cfg("+compressor=identity"), tiny_handle).summary
    assert summary["peak_rss_gb"] > 0.05  # the interpreter with torch alone is more
    cell = summary["peak_rss_gb_cell"]
    assert cell is None or 0 < cell <= summary["peak_rss_gb"]
