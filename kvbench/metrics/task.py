"""Task loss with a given cache: the held-out continuation scored on top of a (reconstructed) prefix KV."""

from __future__ import annotations

from typing import Any

import torch

from kvbench.kv import KVSequence


def build_cache(model: Any, kv: KVSequence) -> Any:
    """A transformers ``DynamicCache`` filled with ``kv``, with the model's own layer types (sliding windows)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    for layer in range(kv.shape[0]):
        k = kv.k[layer].unsqueeze(0).to(device=device, dtype=torch.float32)  # (1, H, T, D)
        v = kv.v[layer].unsqueeze(0).to(device=device, dtype=torch.float32)  # (1, H, T, D)
        cache.update(k, v, layer)
    return cache


@torch.no_grad()
def continuation_nll(model: Any, kv: KVSequence, continuation: torch.Tensor) -> float:
    """Mean NLL (nats) of ``continuation[1:]`` given the prefix cache ``kv`` and ``continuation[:-1]``."""
    device = next(model.parameters()).device
    ids = continuation.to(device)
    out = model(ids[:-1].unsqueeze(0), cache=build_cache(model, kv), use_cache=True)
    logp = torch.log_softmax(out.logits[0].float(), dim=-1)  # (E, V)
    return float(-logp.gather(1, ids[1:, None]).mean())
