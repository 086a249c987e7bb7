"""RoPE undone and redone from the model config alone, against keys captured from the model itself."""

import pytest
import torch
from conftest import tiny_arch, tiny_llama

from kvbench.core.rope import Rotary
from kvbench.inputs.capture import capture_window


def _tiny_gemma3():
    return tiny_arch("gemma3", num_hidden_layers=3, num_attention_heads=2, head_dim=32, sliding_window=16,
                     layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                     query_pre_attn_scalar=256,
                     rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                      "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0,
                                                         "factor": 8.0}})


def _llama3_scaled():
    model = tiny_llama()
    model.config.rope_parameters = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(model.config).eval()


@pytest.mark.parametrize("make", [tiny_llama, _llama3_scaled, _tiny_gemma3],
                         ids=["llama", "llama3-scaling", "gemma3-per-layer-type"])
def test_apply_and_undo_match_the_models_own_keys(make):
    model = make()
    ids = torch.randint(0, 128, (80,), generator=torch.Generator().manual_seed(1))
    got = capture_window(model, ids, 80, torch.float32, pre_rope=True)
    k, k_pre = got["k"], got["k_pre_rope"]  # (L, H, T, D) float32
    rope = Rotary(model.config)
    assert torch.allclose(rope.apply(k_pre), k, atol=1e-5, rtol=1e-5)
    assert torch.allclose(rope.undo(k), k_pre, atol=1e-5, rtol=1e-5)
    # a segment that starts later in the sequence rotates by its own positions
    assert torch.allclose(rope.apply(k_pre[:, :, 40:], start=40), k[:, :, 40:], atol=1e-5, rtol=1e-5)
    # and tokens picked here and there by their own positions
    picks = torch.tensor([3, 17, 18, 61, 79])
    assert torch.allclose(rope.apply(k_pre[:, :, picks], positions=picks), k[:, :, picks], atol=1e-5, rtol=1e-5)


def test_redo_of_undo_returns_the_captured_16_bit_keys():
    model = tiny_llama()
    ids = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(2))
    k = capture_window(model, ids, 64, torch.float16)["k"]  # (L, H, T, D) as the cache holds them
    rope = Rotary(model.config)
    assert torch.equal(rope.apply(rope.undo(k)).to(torch.float16), k)


def test_wrong_layer_count_is_refused():
    with pytest.raises(ValueError, match="layers"):
        Rotary(tiny_llama().config).undo(torch.zeros(5, 2, 4, 16))
