"""Model FLOPs per token from a config, and the three named rates."""

import pytest
from transformers import LlamaConfig

from kvbench.core.flops import forward_flops_per_token, prefill_flops_per_token
from kvbench.measure.metrics.rate import rate_summary


def test_forward_flops_count_every_matmul_by_hand():
    c = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=100, head_dim=16)
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128  # q, o; k, v; gate, up, down
    assert forward_flops_per_token(c, 0) == 2 * 2 * per_layer + 2 * 64 * 100
    assert forward_flops_per_token(c, 10) - forward_flops_per_token(c, 0) == 2 * 2 * 2 * 64 * 10  # QKᵀ and AV
    assert prefill_flops_per_token(c, 20) == forward_flops_per_token(c, 10)


def test_smollm2_costs_about_twice_its_parameters_per_token():
    c = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, head_dim=64)
    assert forward_flops_per_token(c, 0) == pytest.approx(2 * 134.5e6, rel=0.02)  # 135M parameters, head tied


def test_three_rates():
    r = rate_summary([900, 1100], [{"codes": 900}, {"codes": 1100}], n_tokens=100, n_elements=1000, codec_bits=5000,
                     amortize_tokens=1000)
    assert r["stream_bits_per_element"] == 2.0 and r["bits_per_element"] == 7.0
    assert r["bits_per_element_amortized"] == pytest.approx((2000 + 5000 * 0.1) / 1000)
    whole = rate_summary([2000], [{}], n_tokens=100, n_elements=1000, codec_bits=5000, amortize_tokens=50)
    assert whole["bits_per_element_amortized"] == whole["bits_per_element"]  # the run has more tokens than that
    with pytest.raises(ValueError, match="amortize_tokens"):
        rate_summary([1], [{}], 1, 1, 0, amortize_tokens=0)
