"""H2O (Zhang et al., arXiv 2306.14048): heavy hitters by attention accumulated over the prefill, plus the most
recent tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from compressors.eviction.evict import Eviction
from compressors.eviction.query_attention import attention_sums, capture_queries, per_kv_head
from kvbench.core.checks import check_range
from kvbench.core.kv import Context, KVSequence


@dataclass
class H2O(Eviction):
    """H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
    arXiv 2306.14048): heavy hitters by attention accumulated over every query of the prefill (causal, so an early
    key collects from more queries), summed over each KV head's query heads, plus the most recent tokens.
    ``recent`` is the share of the budget given to the recent window (the paper splits it evenly)."""

    recent: float = 0.5

    name = "h2o"
    needs_model = True
    window_word = "recent"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range(self.name, "recent", self.recent, 0.0, 1.0)

    def protected(self, n_tokens: int, n_keep: int) -> tuple[int, int]:
        return 0, math.floor(self.recent * n_keep + 0.5)

    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        return per_kv_head(attention_sums(capture_queries(self.name, kv, ctx, 0), kv.k), kv.shape[1])
