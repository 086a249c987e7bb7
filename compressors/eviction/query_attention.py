"""Queries recomputed from the model, for eviction methods that score keys by attention (SnapKV, TOVA, H2O,
expected attention): the queries of chosen tokens captured in one pass of the decoder stack, and the attention
they pay every key, causal and within each layer's sliding window as in the model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.core.kv import Context, KVSequence
from kvbench.core.rope import Rotary
from kvbench.inputs.model_queries import decoder_stack, masked_logits, model_module, tap_queries

#: queries per attention block when scoring: bounds the ``(heads, queries, T)`` probabilities held at once
QUERY_CHUNK = 256


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

    The queries are read off each attention module by :func:`kvbench.inputs.model_queries.tap_queries` (its own
    query projection, and ``q_norm`` where the model has one) in one pass of the decoder stack (no LM head). RoPE is
    applied with :class:`kvbench.core.rope.Rotary` at the queries' own positions (``ctx.start + t``). As a guard,
    the same pass recomputes every layer's keys; they must match the cached ones, else the model is not the one that
    made the cache (or the segment does not start the sequence: its queries would depend on tokens before it, which
    the encoder does not have).
    """
    model = model_module(ctx.model, owner)
    if kv.tokens is None:
        raise ValueError(f"{owner} recomputes queries from the token ids, but this sequence has none")
    decoder = decoder_stack(model, owner)
    device = next(model.parameters()).device
    T = kv.n_tokens
    with tap_queries(decoder, slice(first, None), keys=True, owner=owner) as tap:
        positions = torch.arange(ctx.start, ctx.start + T, device=device).unsqueeze(0)  # (1, T)
        decoder(input_ids=kv.tokens.to(device).unsqueeze(0), position_ids=positions, use_cache=False)
    if len(tap.q) != kv.shape[0]:
        raise ValueError(f"{owner}: the model has {len(tap.q)} attention layers; the cache has {kv.shape[0]}")
    rope = Rotary(model.config)
    keys = rope.apply(torch.stack(tap.k), ctx.start)  # (L, H, T, D)
    cached = kv.k.float()
    err = float((keys - cached).norm() / cached.norm().clamp_min(1e-12)) if keys.shape == cached.shape else math.inf
    if err > 0.05:
        raise ValueError(f"{owner}: the model in the context does not reproduce this sequence's keys (relative "
                         f"error {err:.3g}); queries are recomputed from kv.tokens with the model that made the "
                         "cache, from the sequence's first token")
    q_pre_all = torch.stack(tap.q)  # (L, Hq, n, D)
    return Queries(rope.apply(q_pre_all, ctx.start + first), q_pre_all, first, tap.scaling, tap.sliding, tap.softcap,
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
            q_pos = torch.arange(qs.first + c, qs.first + c + q.shape[1])  # (c,)
            lo, hi = 0, int(q_pos[-1]) + 1  # keys a query of this block can see: causal, and within the window
            if qs.sliding[layer]:
                lo = max(0, int(q_pos[0]) - qs.sliding[layer] + 1)
            logits = masked_logits(q @ keys[:, lo:hi].transpose(1, 2), q_pos, torch.arange(lo, hi), qs.scaling[layer],
                                   qs.sliding[layer], qs.softcap[layer])  # (Hq, c, S)
            out[layer, :, lo:hi] += torch.softmax(logits, dim=-1).sum(1)
    return out


def per_kv_head(x: torch.Tensor, n_kv_heads: int, reduce: str = "sum") -> torch.Tensor:
    """``(L, Hq, T)`` -> ``(L, H, T)``: the query heads of each KV head's group, summed or averaged."""
    L, Hq, T = x.shape
    grouped = x.reshape(L, n_kv_heads, Hq // n_kv_heads, T)
    return grouped.sum(2) if reduce == "sum" else grouped.mean(2)
