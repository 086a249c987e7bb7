"""TOVA (Oren et al., arXiv 2401.06104): eviction by the attention of the last token's query."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compressors.eviction.evict import Eviction
from compressors.eviction.query_attention import attention_sums, capture_queries, per_kv_head
from kvbench.core.kv import Context, KVSequence


def last_query_scores(attn: torch.Tensor, n_kv_heads: int, per_head: bool) -> torch.Tensor:
    """``(L, Hq, T)`` attention of the last query -> ``(L, H, T)`` scores.

    ``per_head=False``: the mean over all ``Hq`` query heads of the layer, the same row for every KV head (one
    selection per layer, as in the paper and kvpress). ``per_head=True``: each KV head's query heads summed.
    """
    if per_head:
        return per_kv_head(attn, n_kv_heads)
    L, _, T = attn.shape
    return attn.mean(1, keepdim=True).expand(L, n_kv_heads, T).clone()  # (L, H, T)


@dataclass
class TOVA(Eviction):
    """TOVA (Oren, Hassid, Yarden, Adi, Schwartz, "Transformers are Multi-State RNNs", arXiv 2401.06104): keep
    the tokens the last token's query attends to most. The last ``window`` tokens (the current token) are
    always kept.

    ``per_head=False`` (the reference): the last query's attention averaged over every query head of the layer,
    so each layer makes one selection and all its KV heads keep the same positions. This is the paper's rule
    and what kvpress's ``TOVAPress`` does (the mean over the query heads, repeated for every KV head under GQA).
    ``per_head=True`` keeps the per-KV-head selection (each KV head's query heads summed), which lets heads keep
    different tokens.
    """

    window: int = 1
    per_head: bool = False

    name = "tova"
    needs_model = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.per_head, bool):
            raise ValueError(f"{self.name}.per_head={self.per_head!r} is not allowed; choose one of [True, False] "
                             "(False: one selection per layer, True: one per KV head)")

    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        T = kv.n_tokens
        attn = attention_sums(capture_queries(self.name, kv, ctx, T - 1), kv.k)  # (L, Hq, T) one query
        return last_query_scores(attn, kv.shape[1], self.per_head)
