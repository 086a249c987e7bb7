"""H2O (Zhang et al., arXiv 2306.14048): heavy hitters by attention accumulated over the prefill, as kvpress's
ObservedAttentionPress scores them (optionally with the paper's recent window)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from compressors.eviction.evict import Eviction
from compressors.eviction.query_attention import attention_sums, capture_queries, per_kv_head
from kvbench.core.checks import check_range
from kvbench.core.kv import Context, KVSequence


def accumulated_scores(sums: torch.Tensor, n_kv_heads: int, normalize: bool) -> torch.Tensor:
    """``(L, Hq, T)`` attention summed over every prefill query -> ``(L, H, T)`` scores, each KV head's query
    heads summed.

    ``normalize``: key ``i`` is divided by ``T - i``, the number of causal queries that see it (kvpress's rule),
    so the score is the mean attention a key receives rather than a sum that grows with how early it is.
    """
    if normalize:
        T = sums.shape[-1]
        sums = sums / torch.arange(T, 0, -1, dtype=sums.dtype)  # (L, Hq, T) / (T,)
    return per_kv_head(sums, n_kv_heads)


@dataclass
class H2O(Eviction):
    """H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
    arXiv 2306.14048): heavy hitters by attention accumulated over every query of the prefill, summed over each
    KV head's query heads. The defaults are the reference kvbench checks against token by token, kvpress's
    ``ObservedAttentionPress``: every kept token is a heavy hitter (``recent=0``). ``recent`` is the share of the
    budget given to the most recent tokens instead; the paper splits it evenly (``recent=0.5``).

    ``normalize=True`` (the reference): each key's accumulated attention
    is divided by the number of queries that can see it, ``T - i`` for key ``i`` under the causal mask, so early
    keys are not favoured merely for being seen by more queries. As in kvpress the count ignores a layer's sliding
    window (the two agree while ``T`` is within it). ``normalize=False`` keeps the raw causal sum.
    """

    recent: float = 0.0
    normalize: bool = True

    name = "h2o"
    needs_model = True
    window_word = "recent"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range(self.name, "recent", self.recent, 0.0, 1.0)
        if not isinstance(self.normalize, bool):
            raise ValueError(f"{self.name}.normalize={self.normalize!r} is not allowed; choose one of [True, False] "
                             "(True: mean attention per key, False: the raw sum over queries)")

    def protected(self, n_tokens: int, n_keep: int) -> tuple[int, int]:
        return 0, math.floor(self.recent * n_keep + 0.5)

    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        sums = attention_sums(capture_queries(self.name, kv, ctx, 0), kv.k)  # (L, Hq, T)
        return accumulated_scores(sums, kv.shape[1], self.normalize)
