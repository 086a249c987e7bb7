"""Model arithmetic a decoder pays to restore KV by running the model: forward FLOPs per token from the config.

Counted as two FLOPs per multiply-accumulate: every weight matrix of every layer (attention projections, the gated
MLP) and the output head, which a decoder of entropy-coded token ids needs for each token's probabilities, plus
attention over the context so far (``QKᵀ`` and ``AV``). Embedding lookups and norms are left out (no matmul).
Kaplan et al., "Scaling Laws for Neural Language Models" (arXiv 2001.08361), Table 1, count the same way.
"""

from __future__ import annotations

from typing import Any


def forward_flops_per_token(config: Any, context: int, head: bool = True) -> float:
    """FLOPs of one token's forward pass with ``context`` tokens before it (a decoder-only transformer config);
    ``head=False``: the decoder stack alone, for a pass that reads no logits (an encoder recomputing queries)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    d = int(text.hidden_size)
    heads, kv_heads = int(text.num_attention_heads), int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or d // heads)
    ffn, layers, vocab = int(text.intermediate_size), int(text.num_hidden_layers), int(text.vocab_size)
    attn_weights = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2  # q and o, k and v
    mlp_weights = 3 * d * ffn  # gate, up, down
    attention = 2 * heads * head_dim * context  # QKᵀ and AV over the context
    return float(2 * layers * (attn_weights + mlp_weights + attention) + 2 * d * vocab * head)


def prefill_flops_per_token(config: Any, n_tokens: int, head: bool = True) -> float:
    """FLOPs per token of a prefill over ``n_tokens`` tokens (each sees, on average, half of them before it)."""
    return forward_flops_per_token(config, n_tokens // 2, head)
