"""AdaKV (Feng et al., arXiv 2407.11550): a layer's budget shared by its KV heads, each taking what its scores earn."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compressors.eviction.budget_rule import BudgetRule
from compressors.eviction.evict import protected_kept, select
from compressors.eviction.pooled import select_pooled
from kvbench.core.checks import check_range


def safeguard(n_keep: int, alpha: float) -> int:
    """Entries every head keeps whatever the others score: ``int(n_keep * alpha)``, at least one where ``alpha >
    0`` (kvpress 0.5.5's ``AdaKVPress``)."""
    n_safe = int(n_keep * alpha)
    return max(1, n_safe) if alpha > 0 and n_keep > 0 else n_safe


@dataclass
class AdaKV(BudgetRule):
    """AdaKV (Feng, Lv, Cao, Xie, Zhou, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for
    Efficient LLM Inference", arXiv 2407.11550) over any eviction method's scores, as kvpress's ``AdaKVPress``
    (0.5.5) selects: every layer keeps ``H * floor(keep * T)`` entries, its ``H`` KV heads competing for them by
    score (the top entries over the layer's heads jointly), so a head whose attention is concentrated gives up
    entries to one whose attention is spread. ``alpha_safeguard``: each head first keeps its own top
    ``int(alpha_safeguard * floor(keep * T))`` entries (at least one), so that no head is emptied.

    The scorer's protected tokens (its sinks and observation window) are kept in every head before the safeguard
    and the shared top-k, where kvpress's scorer gives them the highest score (the same selection wherever the
    budget holds them). Scores are compared across heads as the scorer gives them (AdaKV's own scorers are
    attention probabilities, comparable between heads; KNorm's negated norms are too, in their own units).
    """

    alpha_safeguard: float = 0.2

    name = "adakv"
    budget_pool = "layer"
    deviations = (
        "ties between equal scores go to the lower (head, token) index, where kvpress's torch.topk leaves them "
        "unspecified",
        "the scorer's protected tokens are forced into every head (kvpress's scorers give them the highest score "
        "instead, which selects the same tokens wherever the budget holds them)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range(self.name, "alpha_safeguard", self.alpha_safeguard, 0.0, 1.0)

    def choose(self, scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        T = scores.shape[-1]
        k = int(budgets[0, 0])  # every head's share before the heads compete for it
        sinks, window = self.protected(T, k)
        kept = protected_kept(sinks, window, T, k)
        forced = select(scores, max(kept.sinks + kept.recent, safeguard(k, self.alpha_safeguard)), sinks, window)
        return select_pooled(scores, forced, budgets.sum(1), "layer")  # (L, H, T)
