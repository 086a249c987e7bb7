"""KNorm (Devoto et al., arXiv 2406.11430): eviction of the keys with the highest L2 norm."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compressors.eviction.evict import Eviction
from kvbench.core.kv import Context, KVSequence


@dataclass
class KNorm(Eviction):
    """KNorm (Devoto, Zhao, Scardapane, Minervini, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
    Compression", arXiv 2406.11430): keep the keys with the lowest L2 norm, which draw the most attention."""

    name = "knorm"

    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        return -kv.k.float().norm(dim=-1)  # (L, H, T)
