"""StreamingLLM (Xiao et al., arXiv 2309.17453) as an eviction method: the attention sinks and the most recent
tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compressors.eviction.evict import Eviction, protected_kept
from kvbench.core.compressor import Kept
from kvbench.core.kv import Context, KVSequence


@dataclass
class StreamingLLM(Eviction):
    """StreamingLLM (Xiao, Tian, Chen, Han, Lewis, "Efficient Streaming Language Models with Attention Sinks",
    arXiv 2309.17453): the first ``sinks`` tokens (attention sinks) and the most recent ones; ``keep`` sets the
    recent window to ``floor(keep * T) - sinks`` tokens (``keep_tokens``: ``keep_tokens - sinks``). The positions
    cost a few bits per head."""

    sinks: int = 4

    name = "streaming_llm"

    def always_kept(self, n_tokens: int) -> Kept:
        k = self.n_keep(n_tokens)
        return protected_kept(self.sinks, k, n_tokens, k)

    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        L, H, T, _ = kv.shape
        return torch.arange(T, dtype=torch.float32).expand(L, H, T)  # (L, H, T) the most recent first
