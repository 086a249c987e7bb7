"""Random eviction (kvpress's RandomPress baseline): the tokens kept drawn uniformly with a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compressors.eviction.evict import Eviction
from kvbench.core.checks import check_range
from kvbench.core.kv import Context, KVSequence


@dataclass
class RandomEviction(Eviction):
    """Uniformly random eviction with a seeded generator: the floor every scoring method must beat."""

    seed: int = 0

    name = "random_eviction"
    random_baseline = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range(self.name, "seed", self.seed, 0, (1 << 63) - 1, integer=True)

    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        return torch.rand(kv.shape[:3], generator=torch.Generator().manual_seed(int(self.seed)))  # (L, H, T)
