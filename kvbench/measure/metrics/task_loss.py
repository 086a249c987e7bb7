"""Task loss with a given cache: the held-out continuation scored on top of a (reconstructed) prefix KV.

The continuation is fed :data:`~kvbench.inputs.forward.SCORE_CHUNK` tokens at a time and its log-probs are taken
through the LM head in blocks of rows (:func:`kvbench.inputs.forward.scored_forward`), so scoring holds the float32
cache of the window and a working set that grows neither with the continuation's length nor with the vocabulary."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvbench.cache.eviction_mask import hide_evicted
from kvbench.core.kv import KVSequence
from kvbench.inputs import forward


def build_cache(model: Any, kv: KVSequence) -> Any:
    """A transformers ``DynamicCache`` filled with ``kv``, with the model's own layer types (sliding windows), in the
    model's dtype: the new tokens' keys are concatenated onto these, and attention takes one dtype."""
    from transformers import DynamicCache

    weight = next(model.parameters())
    cache = DynamicCache(config=model.config)
    for layer in range(kv.shape[0]):
        k = kv.k[layer].unsqueeze(0).to(device=weight.device, dtype=weight.dtype)  # (1, H, T, D)
        v = kv.v[layer].unsqueeze(0).to(device=weight.device, dtype=weight.dtype)  # (1, H, T, D)
        cache.update(k, v, layer)
    return cache


@torch.no_grad()
def continuation_nlls(model: Any, kv: KVSequence, continuation: torch.Tensor) -> np.ndarray:
    """Per-token NLL (nats), ``(E,)``, of ``continuation[1:]`` given the prefix cache ``kv`` and
    ``continuation[:-1]``: the unit that paired intervals resample."""
    with hide_evicted(model, kv.kept):  # a token-eviction decoder's dropped entries stay out of attention
        logprobs = forward.scored_forward(model, continuation[:-1], build_cache(model, kv), continuation[1:],
                                          forward.SCORE_CHUNK)  # (E,)
    return (-logprobs).double().cpu().numpy()


def continuation_nll(model: Any, kv: KVSequence, continuation: torch.Tensor) -> float:
    """Mean NLL (nats) of ``continuation[1:]`` given the prefix cache ``kv`` and ``continuation[:-1]``."""
    return float(continuation_nlls(model, kv, continuation).mean())
