"""Sliding-window layers (Gemma 3): capture keeps the whole K/V, and the continuation scored on the rebuilt cache
has exactly the NLL of one forward pass over prefix + continuation, although the prefix is longer than the window."""

import torch
from conftest import tiny_arch

from kvbench.core.kv import KVSequence
from kvbench.inputs.capture import capture_window
from kvbench.measure.metrics.task_loss import continuation_nll


def tiny_gemma3(window: int = 8):
    """Six layers of Gemma 3's own pattern (five local, one global), two query heads on one KV head."""
    return tiny_arch("gemma3", num_hidden_layers=6, num_attention_heads=2, head_dim=32, sliding_window=window,
                     layer_types=None, query_pre_attn_scalar=256, max_position_embeddings=256)


def test_gemma3_sliding_layers_capture_full_kv_and_score_exactly():
    model = tiny_gemma3(window=8)
    types = model.config.layer_types
    assert types.count("sliding_attention") == 5 and types.count("full_attention") == 1
    ids = torch.randint(0, 128, (61,), generator=torch.Generator().manual_seed(3))
    T = 40  # five windows long
    got = capture_window(model, ids, T, torch.float32)
    assert got["k"].shape == (6, 1, T, 32) and got["v"].shape == (6, 1, T, 32)
    with torch.no_grad():
        logits = model(ids[None]).logits[0].float()  # (61, V)
    logp = torch.log_softmax(logits, -1)
    assert torch.allclose(got["logprobs"], logp[: T - 1].gather(1, ids[1:T, None])[:, 0], atol=1e-5)
    ref = float(-logp[T:-1].gather(1, ids[T + 1 :, None]).mean())
    nll = continuation_nll(model, KVSequence(got["k"], got["v"], ids[:T]), ids[T:])
    assert abs(nll - ref) < 1e-5
    # the sliding layers' early tokens matter to the full layer only through the residual stream, not the cache:
    # dropping them from a sliding layer's cache must not change the score, dropping them from the full layer must
    k, v = got["k"].clone(), got["v"].clone()
    k[0, :, :16], v[0, :, :16] = 0, 0
    assert abs(continuation_nll(model, KVSequence(k, v, ids[:T]), ids[T:]) - ref) < 1e-5
    k, v = got["k"].clone(), got["v"].clone()
    k[5, :, :16], v[5, :, :16] = 0, 0
    assert abs(continuation_nll(model, KVSequence(k, v, ids[:T]), ids[T:]) - ref) > 1e-4
