"""Hiding evicted cache entries from attention, per layer and KV head, without touching the model's code.

A token-eviction decoder keeps different positions in every (layer, KV head) (KNorm and SnapKV overlap by about half
between heads), so one attention mask for the whole model cannot express it. For the duration of a forward pass
each attention module gets a forward pre-hook on the model instance (removed afterwards; nothing global changes)
that replaces its ``attention_mask`` argument by an additive ``(1, heads, queries, keys)`` mask: a cached entry is
visible to a query head only where its KV head kept it, new tokens see each other causally, and any mask the model
built itself (sliding windows) still applies. Positions are untouched: evicted entries keep their slots, so every
kept key sits at its original position (scoring with renumbered positions raises SmolLM2's NLL from 3.4 to 5.1).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def _decoder_layers(model: Any) -> list[Any]:
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return list(inner.layers)


def _cached_length(kwargs: dict, layer_idx: int) -> int:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:
        return 0
    layer = cache.layers[layer_idx]
    return int(layer.keys.shape[-2]) if getattr(layer, "is_initialized", False) else 0


def _mask_hook(kept: torch.Tensor):
    """``kept``: ``(H_kv, T)`` for one layer, the entries of the cached prefix its decoder kept."""

    def hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        q = hidden.shape[1]
        n_prev = _cached_length(kwargs, module.layer_idx)  # a sliding layer holds only its window's tail
        groups = getattr(module, "num_key_value_groups", 1)
        prev = kept[:, kept.shape[1] - n_prev :].to(hidden.device).repeat_interleave(groups, dim=0)  # (Hq, n_prev)
        new = torch.ones(q, q, dtype=torch.bool, device=hidden.device).tril()  # (q, q)
        allowed = torch.cat([prev.unsqueeze(1).expand(-1, q, -1), new.expand(prev.shape[0], -1, -1)], dim=2)
        orig = kwargs.get("attention_mask")
        if isinstance(orig, torch.Tensor) and orig.shape[-1] == allowed.shape[-1]:
            allowed = allowed & (orig[0] if orig.dtype == torch.bool else orig[0] == 0)  # (Hq, q, S)
        mask = torch.zeros(allowed.shape, dtype=hidden.dtype, device=hidden.device)
        mask.masked_fill_(~allowed, torch.finfo(hidden.dtype).min)
        kwargs["attention_mask"] = mask.unsqueeze(0)  # (1, Hq, q, S)
        return args, kwargs

    return hook


@contextmanager
def hide_evicted(model: Any, kept: torch.Tensor | None) -> Iterator[None]:
    """Within the block, forward passes of ``model`` on a cache that holds the prefix of ``kept`` (``(L, H_kv, T)``
    bool, or None: nothing evicted) attend only to kept entries."""
    if kept is None or bool(kept.all()):
        yield
        return
    layers = _decoder_layers(model)
    if kept.shape[0] != len(layers):
        raise ValueError(f"kept mask for {kept.shape[0]} layers; the model has {len(layers)}")
    hooks = [layer.self_attn.register_forward_pre_hook(_mask_hook(kept[i]), with_kwargs=True)
             for i, layer in enumerate(layers)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
