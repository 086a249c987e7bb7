"""SnapKV (Li et al., arXiv 2404.14469): eviction by the pooled attention of an observation window's queries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compressors.eviction.evict import Eviction
from compressors.eviction.query_attention import attention_sums, capture_queries, per_kv_head
from kvbench.core.checks import check_choice, check_range
from kvbench.core.kv import Context, KVSequence


@dataclass
class SnapKV(Eviction):
    """SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469).

    The last ``window`` tokens are the observation window and are kept; every earlier key is scored by the
    attention the window's queries pay it, summed over the window, pooled along the tokens over ``kernel``
    neighbours (so that a kept token brings its neighbourhood) and summed over the query heads that share the KV
    head. The encoder recomputes the window's queries with the model (:func:`capture_queries`).

    ``pooling="avg"`` (the default) is the reference: SnapKV's own code and kvpress's ``SnapKVPress`` average over
    the kernel with the padded edges counted as zeros (``avg_pool1d``'s default), so the first and last scored
    tokens' averages are taken over fewer real neighbours. ``pooling="max"`` is a variant (max over the kernel).
    Summing rather than averaging over the window and the query heads scales every score alike and keeps the same
    tokens.
    """

    window: int = 64
    kernel: int = 5
    pooling: str = "avg"

    name = "snapkv"
    needs_model = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range(self.name, "window", self.window, 1, 1 << 30, integer=True)
        check_range(self.name, "kernel", self.kernel, 1, 1 << 10, integer=True)
        if self.kernel % 2 == 0:
            raise ValueError(f"snapkv.kernel={self.kernel} must be odd, so that pooling is centred on each token")
        check_choice(self.name, "pooling", self.pooling, ("max", "avg"))

    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        L, H, T, _ = kv.shape
        w = min(self.window, T - 1)  # at least one token outside the window
        qs = capture_queries(self.name, kv, ctx, T - w)
        attn = attention_sums(qs, kv.k)[..., : T - w]  # (L, Hq, T - w) the window's own keys are kept anyway
        pool = torch.nn.functional.max_pool1d if self.pooling == "max" else torch.nn.functional.avg_pool1d
        pooled = pool(attn.reshape(-1, 1, T - w), self.kernel, stride=1, padding=self.kernel // 2)
        scores = per_kv_head(pooled.reshape(attn.shape), H)  # (L, H, T - w)
        return torch.nn.functional.pad(scores, (0, w))  # (L, H, T) the window is protected
