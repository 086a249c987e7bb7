"""Waterfill's allocation (:mod:`compressors.transform.waterfill`): importance tiers of halving size and the widths
that reverse water-filling gives every (layer, tier, component) at one multiplier, the same function on both sides."""
from __future__ import annotations

import numpy as np
import torch

from compressors.transform.kvtc_calibration import MAX_WIDTH

WIDTHS = np.arange(MAX_WIDTH + 1, dtype=np.float64)  # (W + 1,)


def tier_sizes(n: int, tiers: int) -> list[int]:
    """Tokens per tier for ``n`` coded tokens, lowest tier first: halving shares (1/2, 1/4, ..., the top two
    alike), rounded so that they sum to ``n``."""
    shares = [2.0 ** -(g + 1) for g in range(tiers - 1)] + [2.0 ** -(tiers - 1)]
    edges = np.rint(np.cumsum([0.0, *shares]) * n).astype(np.int64)
    return np.diff(edges).tolist()


def assign_tiers(importance: torch.Tensor, tiers: int) -> np.ndarray:
    """``(U, n)`` importance -> ``(U, n)`` tier of every token: by rank within its layer (ties to the earlier token
    in the lower tier), in :func:`tier_sizes` shares."""
    U, n = importance.shape
    order = torch.sort(importance.double(), dim=1, stable=True).indices.numpy()  # (U, n) ascending
    by_rank = np.repeat(np.arange(tiers), tier_sizes(n, tiers))  # (n,)
    out = np.empty((U, n), dtype=np.int64)
    np.put_along_axis(out, order, np.broadcast_to(by_rank, (U, n)), axis=1)
    return out


def widths_at(dist: np.ndarray, weights: np.ndarray, lam: float) -> np.ndarray:
    """``(U, G, C)`` widths minimising ``weights[u, g] · dist[u, c, w] + lam · w`` (ties to the narrower width)
    for ``dist`` ``(U, C, W + 1)`` and ``weights`` ``(U, G)``."""
    cost = weights[:, :, None, None] * dist[:, None] + lam * WIDTHS  # (U, G, C, W + 1)
    return cost.argmin(axis=-1)


def water_level(dist: np.ndarray, weights: np.ndarray, counts: np.ndarray, budget: float) -> np.float32:
    """The least multiplier ``λ`` (float32, as sent) whose widths spend at most ``budget`` bits, where
    ``counts[u, g]`` tokens take the widths of tier ``g`` in layer ``u``; found by bisection on ``log2 λ``."""

    def spent(lam: float) -> float:
        return float((widths_at(dist, weights, lam).sum(axis=2) * counts).sum())

    lo, hi = -80.0, 40.0  # log2 λ: from every component at full width to none at all
    for _ in range(64):
        mid = 0.5 * (lo + hi)
        if spent(2.0**mid) > budget:
            lo = mid
        else:
            hi = mid
    lam = np.float32(2.0**hi)
    while spent(float(lam)) > budget:  # the float32 rounding must not overspend
        lam = np.nextafter(lam, np.float32(np.inf))
    return lam


def tier_probs(n: int, tiers: int) -> np.ndarray:
    """The tiers' shares of ``n`` tokens, the model their indices are coded under (an empty tier keeps a little mass)."""
    sizes = np.maximum(np.asarray(tier_sizes(n, tiers), dtype=np.float64), 0.5)
    return sizes / sizes.sum()
