"""Hiding evicted cache entries from attention, per layer and KV head, without touching the model's code.

A token-eviction decoder keeps different positions in every (layer, KV head) (KNorm and SnapKV overlap by about half
between heads), so one attention mask for the whole model cannot express it. Each attention module gets a forward
pre-hook on the model instance (nothing global changes) that replaces its ``attention_mask`` argument by an additive
``(1, heads, queries, keys)`` mask: a cached entry is visible to a query head only where its KV head kept it, new
tokens see each other causally, and any mask the model built itself (sliding windows) still applies. Two sources of
kept masks: :func:`hide_evicted` (a fixed mask for the duration of a block: scoring on a decoded sequence) and
:func:`install` (permanent, idle unless the forward pass's cache has a ``kept_mask(layer_idx)`` that returns one:
a :class:`~kvbench.cache.compressed.CompressedCache` holding evicted segments, in the decode loop and the task evaluations).
Positions are untouched: evicted entries keep their slots, so every
kept key sits at its original position (scoring with renumbered positions raises SmolLM2's NLL from 3.4 to 5.1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


def _decoder_layers(model: Any) -> list[Any]:
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return list(inner.layers)


def _cached_lengths(cache: Any, layer_idx: int) -> tuple[int, int]:
    """``(tokens seen, tokens held)`` by one layer of a cache: a sliding layer holds only its window's tail."""
    if cache is None:
        return 0, 0
    layer = cache.layers[layer_idx]
    if not getattr(layer, "is_initialized", False):
        return 0, 0
    return int(layer.get_seq_length()), int(layer.keys.shape[-2])


def _cache_of(kwargs: dict) -> Any:
    return kwargs.get("cache", kwargs.get("past_key_values"))


#: ``source(layer_idx, cache)``: the ``(H_kv, tokens held)`` kept mask of that layer's cached entries, or None
KeptSource = Callable[[int, Any], "torch.Tensor | None"]


def _mask_hook(source: KeptSource):
    def hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        kept = source(module.layer_idx, _cache_of(kwargs))
        if kept is None:
            return None
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        q = hidden.shape[1]
        groups = getattr(module, "num_key_value_groups", 1)
        prev = kept.to(hidden.device).repeat_interleave(groups, dim=0)  # (Hq, n_prev)
        new = torch.ones(q, q, dtype=torch.bool, device=hidden.device).tril()  # (q, q)
        allowed = torch.cat([prev.unsqueeze(1).expand(-1, q, -1), new.expand(prev.shape[0], -1, -1)], dim=2)
        orig = kwargs.get("attention_mask")
        if orig is not None:
            # the model's own mask (causal, sliding windows) must still apply: one that cannot be lined up with the
            # kept entries would be dropped silently and change what attention sees
            if not isinstance(orig, torch.Tensor):
                raise ValueError(f"layer {module.layer_idx}: the model's attention mask is a {type(orig).__name__}; hiding "
                                 f"evicted entries combines only with a tensor mask (eager or sdpa attention)")
            if orig.shape[-1] != allowed.shape[-1] or orig.shape[-2] != q:
                raise ValueError(f"layer {module.layer_idx}: the model's attention mask covers {orig.shape[-1]} keys for "
                                 f"{orig.shape[-2]} queries, the kept mask {allowed.shape[-1]} keys ({prev.shape[1]} held + "
                                 f"{q} new) for {q}; the cache and the model disagree on how many tokens this layer holds")
            allowed = allowed & (orig[0] if orig.dtype == torch.bool else orig[0] == 0)  # (Hq, q, S)
        mask = torch.zeros(allowed.shape, dtype=hidden.dtype, device=hidden.device)
        mask.masked_fill_(~allowed, torch.finfo(hidden.dtype).min)
        kwargs["attention_mask"] = mask.unsqueeze(0)  # (1, Hq, q, S)
        return args, kwargs

    return hook


def _attention_modules(model: Any) -> list[Any]:
    return [layer.self_attn for layer in _decoder_layers(model)]


def install(model: Any) -> None:
    """Hide the entries a cache's decoder dropped, per KV head, in every forward pass of ``model`` on a cache that
    has ``kept_mask(layer_idx)``; idle for any other cache. Idempotent."""
    if getattr(model, "_kvbench_kept_hooks", False):
        return

    def from_cache(layer_idx: int, cache: Any) -> torch.Tensor | None:
        kept_mask = getattr(cache, "kept_mask", None)
        return kept_mask(layer_idx) if kept_mask is not None else None

    for attn in _attention_modules(model):
        attn.register_forward_pre_hook(_mask_hook(from_cache), with_kwargs=True)
    model._kvbench_kept_hooks = True


@contextmanager
def hide_evicted(model: Any, kept: torch.Tensor | None) -> Iterator[None]:
    """Within the block, forward passes of ``model`` on a cache that holds the prefix of ``kept`` (``(L, H_kv, T)``
    bool, or None: nothing evicted) attend only to kept entries."""
    if kept is None or bool(kept.all()):
        yield
        return
    modules = _attention_modules(model)
    if kept.shape[0] != len(modules):
        raise ValueError(f"kept mask for {kept.shape[0]} layers; the model has {len(modules)}")
    T = kept.shape[2]

    def fixed(layer_idx: int, cache: Any) -> torch.Tensor:
        seen, held = _cached_lengths(cache, layer_idx)
        row = kept[layer_idx]  # (H, T); tokens fed after the prefix are all visible
        if seen > T:
            row = torch.cat([row, torch.ones(row.shape[0], seen - T, dtype=torch.bool)], dim=1)
        return row[:, row.shape[1] - held :]

    hooks = [attn.register_forward_pre_hook(_mask_hook(fixed), with_kwargs=True) for attn in modules]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
