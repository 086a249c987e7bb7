"""TOVA (Oren et al., arXiv 2401.06104): eviction by the attention of the last token's query."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compressors.eviction.evict import Eviction
from compressors.eviction.query_attention import attention_sums, capture_queries, per_kv_head
from kvbench.core.kv import Context, KVSequence


@dataclass
class TOVA(Eviction):
    """TOVA (Oren, Hassid, Yarden, Adi, Schwartz, "Transformers are Multi-State RNNs", arXiv 2401.06104): keep
    the tokens the last token's query attends to most, per KV head (summed over its query heads). The last
    ``window`` tokens (the current token) are always kept."""

    window: int = 1

    name = "tova"
    needs_model = True

    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        T = kv.n_tokens
        return per_kv_head(attention_sums(capture_queries(self.name, kv, ctx, T - 1), kv.k), kv.shape[1])
