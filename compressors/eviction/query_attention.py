"""Queries recomputed from the model, for eviction methods that score keys by attention (SnapKV, TOVA, H2O,
expected attention): the queries of chosen tokens captured in one pass of the decoder stack, and the attention
they pay every key, causal and within each layer's sliding window as in the model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.core.kv import Context, KVSequence

#: queries per attention block when scoring: bounds the ``(heads, queries, T)`` probabilities held at once
QUERY_CHUNK = 256


def _module(ref: Any, owner: str) -> torch.nn.Module:
    if ref is None:
        raise ValueError(f"{owner} scores with the model's queries: the encoder needs the model in the context "
                         "(needs_model=True; the harness passes it)")
    return ref if isinstance(ref, torch.nn.Module) else ref.model


def decoder_stack(ref: Any, owner: str) -> torch.nn.Module:
    """The decoder stack (its ``layers``, no LM head) of the model in ``ref``: a module, or a handle holding one."""
    model = _module(ref, owner)
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


@dataclass
class Queries:
    """Queries of the tokens ``first .. T - 1`` with RoPE at their own positions, and what attention needs."""

    q: torch.Tensor  # (L, Hq, T - first, D) float32, post-RoPE
    q_pre: torch.Tensor  # (L, Hq, T - first, D) float32, before RoPE
    first: int
    scaling: list[float]  # per layer: the logit scale (head_dim**-0.5, or Gemma's query_pre_attn_scalar**-0.5)
    sliding: list[int | None]  # per layer: the sliding window, None for full attention
    softcap: list[float | None]  # per layer: logit soft-capping, None when the model has none
    config: Any


@torch.no_grad()
def capture_queries(owner: str, kv: KVSequence, ctx: Context, first: int) -> Queries:
    """Run the model on ``kv.tokens`` and recompute the queries of tokens ``first ..`` from each attention's input.

    Keys alone do not give queries, so the encoder runs the decoder stack once (no LM head) with a forward
    pre-hook on every attention module that applies its own ``q_proj`` (and ``q_norm`` where the model has one)
    to the hidden states it receives. RoPE is applied with :class:`kvbench.core.rope.Rotary` at the queries' own
    positions (``ctx.start + t``). As a guard, the same pass recomputes every layer's keys; they must match the
    cached ones, else the model is not the one that made the cache (or the segment does not start the sequence:
    its queries would depend on tokens before it, which the encoder does not have).
    """
    from kvbench.core.rope import Rotary

    model = _module(ctx.model, owner)
    if kv.tokens is None:
        raise ValueError(f"{owner} recomputes queries from the token ids, but this sequence has none")
    decoder = decoder_stack(model, owner)
    device = next(model.parameters()).device
    T = kv.n_tokens
    q_pre, k_pre, scaling, sliding, softcap = [], [], [], [], []

    def hook(attn: Any, args: tuple, kwargs: dict) -> None:
        # in the model's dtype, as its projections take it; the queries are kept in float32 below
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # (1, T, hidden)
        D = attn.head_dim
        q = attn.q_proj(hidden[:, first:]).view(1, T - first, -1, D).transpose(1, 2)  # (1, Hq, n, D)
        k = attn.k_proj(hidden).view(1, T, -1, D).transpose(1, 2)  # (1, H, T, D)
        if getattr(attn, "q_norm", None) is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q_pre.append(q[0].float().cpu())
        k_pre.append(k[0].float().cpu())
        scaling.append(float(attn.scaling))
        sliding.append(getattr(attn, "sliding_window", None))
        softcap.append(getattr(attn, "attn_logit_softcapping", None))

    hooks = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in decoder.layers]
    try:
        positions = torch.arange(ctx.start, ctx.start + T, device=device).unsqueeze(0)  # (1, T)
        decoder(input_ids=kv.tokens.to(device).unsqueeze(0), position_ids=positions, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    if len(q_pre) != kv.shape[0]:
        raise ValueError(f"{owner}: the model has {len(q_pre)} attention layers; the cache has {kv.shape[0]}")
    rope = Rotary(model.config)
    keys = rope.apply(torch.stack(k_pre), ctx.start)  # (L, H, T, D)
    cached = kv.k.float()
    err = float((keys - cached).norm() / cached.norm().clamp_min(1e-12)) if keys.shape == cached.shape else math.inf
    if err > 0.05:
        raise ValueError(f"{owner}: the model in the context does not reproduce this sequence's keys (relative "
                         f"error {err:.3g}); queries are recomputed from kv.tokens with the model that made the "
                         "cache, from the sequence's first token")
    q_pre_all = torch.stack(q_pre)  # (L, Hq, n, D)
    return Queries(rope.apply(q_pre_all, ctx.start + first), q_pre_all, first, scaling, sliding, softcap,
                   model.config)


def attention_sums(qs: Queries, k: torch.Tensor) -> torch.Tensor:
    """``(L, Hq, T)``: attention probabilities of every captured query on every key, summed over the queries.

    Causal (query ``first + i`` sees keys ``<= first + i``), within the layer's sliding window, soft-capped as in
    the model; computed per layer in blocks of ``QUERY_CHUNK`` queries.
    """
    L, H, T, _ = k.shape
    Hq, n = qs.q.shape[1], qs.q.shape[2]
    out = torch.zeros(L, Hq, T)
    for layer in range(L):
        keys = k[layer].float().repeat_interleave(Hq // H, dim=0)  # (Hq, T, D)
        for c in range(0, n, QUERY_CHUNK):
            q = qs.q[layer, :, c : c + QUERY_CHUNK]  # (Hq, c, D)
            q_pos = torch.arange(qs.first + c, qs.first + c + q.shape[1]).unsqueeze(1)  # (c, 1)
            lo, hi = 0, int(q_pos[-1]) + 1  # keys a query of this block can see: causal, and within the window
            if qs.sliding[layer]:
                lo = max(0, int(q_pos[0]) - qs.sliding[layer] + 1)
            key_pos = torch.arange(lo, hi)  # (S,)
            logits = q @ keys[:, lo:hi].transpose(1, 2) * qs.scaling[layer]  # (Hq, c, S)
            if qs.softcap[layer]:
                logits = torch.tanh(logits / qs.softcap[layer]) * qs.softcap[layer]
            visible = key_pos <= q_pos  # (c, S)
            if qs.sliding[layer]:
                visible &= q_pos - key_pos < qs.sliding[layer]
            logits = logits.masked_fill(~visible, -math.inf)
            out[layer, :, lo:hi] += torch.softmax(logits, dim=-1).sum(1)
    return out


def per_kv_head(x: torch.Tensor, n_kv_heads: int, reduce: str = "sum") -> torch.Tensor:
    """``(L, Hq, T)`` -> ``(L, H, T)``: the query heads of each KV head's group, summed or averaged."""
    L, Hq, T = x.shape
    grouped = x.reshape(L, n_kv_heads, Hq // n_kv_heads, T)
    return grouped.sum(2) if reduce == "sum" else grouped.mean(2)
