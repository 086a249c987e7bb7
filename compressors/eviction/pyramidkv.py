"""PyramidKV (Cai et al., arXiv 2406.02069): per-layer budgets that shrink linearly with depth, over any scorer."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from compressors.eviction.budget_rule import BudgetRule
from kvbench.core.checks import check_range


def pyramid_budgets(n_layers: int, n_tokens: int, n_keep: int, window: int, beta: int) -> list[int]:
    """Entries each layer keeps per KV head, kvpress 0.5.5's ``PyramidKVPress.get_layer_budget`` (after
    KVCache-Factory's ``pyramidkv_utils``) with ``q_len * (1 - compression_ratio)`` the per-head budget ``n =
    n_keep``: from ``max = 2n - n / beta`` at the first layer down to ``min = n / beta`` at the last in equal steps,
    ``max`` capped at ``T - window`` (``min`` raised to keep the mean ``n``), each rounded half to even; uniform ``n``
    where the pyramid does not fit (``T >= max >= min >= window`` fails, one layer only, or the last layer would keep
    nothing).

    Computed in exact fractions: layers ``l`` and ``L - 1 - l`` keep ``2n`` together, so the budgets sum to ``L * n``,
    the total a uniform method keeps, to the entry.
    """
    n = Fraction(n_keep)
    low = n / beta
    high = 2 * n - low
    if high >= n_tokens - window:
        high = Fraction(n_tokens - window)
        low = 2 * n - high
    if n_layers < 2 or not n_tokens >= high >= low >= window or round(low) < 1:
        return [n_keep] * n_layers
    step = (high - low) / (n_layers - 1)
    return [round(high - layer * step) for layer in range(n_layers)]


@dataclass
class PyramidKV(BudgetRule):
    """PyramidKV (Cai, Zhang, Gao, Liu, Liu, Lu, Hu, Dong, Xiao et al., "PyramidKV: Dynamic KV Cache Compression
    based on Pyramidal Information Funneling", arXiv 2406.02069) over any eviction method's scores: lower layers,
    whose attention is spread wide, keep more entries and higher ones, where it funnels onto few tokens, fewer; the
    budgets fall linearly with depth as kvpress's ``PyramidKVPress`` computes them (:func:`pyramid_budgets`) and
    sum to what a uniform ``keep`` keeps. Every KV head of a layer keeps the layer's budget of its own top scores.

    ``beta``: the pyramid's steepness (the last layer keeps ``1 / beta`` of the mean). ``window_size``: the
    observation window of the budget formula, kept in every layer; None takes the scorer's protected last tokens
    (SnapKV's ``window``, 64 by default, as kvpress's ``window_size``; 0 for a scorer without one). With kvpress's
    defaults the pyramid only applies where every layer can hold the window, ``floor(keep * T) / beta >=
    window_size``: at ``window_size=64``, ``beta=20`` from 1,280 kept tokens per head; below, kvpress and this rule
    keep a uniform budget (SnapKV's).
    """

    beta: int = 20
    window_size: int | None = None

    name = "pyramidkv"
    deviations = (
        "kvpress's PyramidKVPress is SnapKV with pyramid budgets; here any eviction method's scores take them "
        "(scorer=snapkv is kvpress's)",
        "budgets computed in exact fractions and rounded half to even, so they sum to L * floor(keep * T) exactly "
        "(kvpress rounds floats, which can differ by one entry at an exact half)",
        "uniform budgets also where the last layer would round to 0 entries (possible only with window_size=0 and "
        "floor(keep * T) < beta / 2), which kvpress would keep",
        "the uniform fallback keeps floor(keep * T) per head, where kvpress 0.5.5 keeps round(T * (1 - "
        "compression_ratio)) (equal wherever keep * T is whole)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range(self.name, "beta", self.beta, 1, 1 << 20, integer=True)
        if self.window_size is not None:
            check_range(self.name, "window_size", self.window_size, 0, 1 << 30, integer=True)

    def pyramid_window(self, n_tokens: int) -> int:
        """The budget formula's observation window: ``window_size``, or the scorer's protected last tokens."""
        if self.window_size is not None:
            return int(self.window_size)
        return min(self.scorer.protected(n_tokens, self.n_keep(n_tokens))[1], n_tokens)

    def budgets(self, n_layers: int, n_heads: int, n_tokens: int) -> torch.Tensor:
        per_layer = pyramid_budgets(n_layers, n_tokens, self.n_keep(n_tokens), self.pyramid_window(n_tokens),
                                    int(self.beta))
        return torch.tensor(per_layer, dtype=torch.int64).unsqueeze(1).expand(n_layers, n_heads).clone()  # (L, H)

    def facts(self, n_tokens: int) -> dict:
        return {**super().facts(n_tokens), "pyramid_window": self.pyramid_window(n_tokens)}
