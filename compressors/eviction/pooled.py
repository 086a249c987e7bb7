"""Selections that pool the budget of several (layer, KV head) rows: the heads of a layer share theirs (AdaKV,
KVzip layer by layer) or the whole cache shares one (KVzip), so each row keeps what its scores earn against the
others'."""

from __future__ import annotations

import math

import torch

#: how many rows share one budget: every head of a layer, or the whole cache
POOLS = ("layer", "cache")


def select_pooled(scores: torch.Tensor, forced: torch.Tensor, totals: torch.Tensor, pool: str) -> torch.Tensor:
    """The ``(L, H, T)`` bool mask keeping, in every pool, its ``totals`` entries ranked first: the ``forced`` ones
    (protected tokens, a safeguard), then by score across the pool's rows jointly. Ties go to the earlier entry in
    (layer, head, token) order; NaN scores rank lowest.

    ``pool``: ``layer`` (``totals`` is ``(L,)``, one budget per layer shared by its heads) or ``cache`` (one
    total). A pool's forced entries must fit its total.
    """
    L, H, T = scores.shape
    n_pools = L if pool == "layer" else 1
    totals = torch.as_tensor(totals, dtype=torch.int64).reshape(n_pools, 1)  # (P, 1)
    force = forced.reshape(n_pools, -1)  # (P, M)
    if bool((force.sum(-1, keepdim=True) > totals).any()):
        raise RuntimeError(f"more entries must be kept than the {pool} budget holds: {force.sum(-1).tolist()} "
                           f"forced for {totals.flatten().tolist()}")
    key = torch.nan_to_num(scores.double(), nan=-math.inf).reshape(n_pools, -1)  # (P, M)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # (P, M)
    # the forced entries first: a stable sort on the flag keeps the score order within each class
    by_force = torch.sort(force.gather(-1, order).to(torch.int8), dim=-1, descending=True, stable=True).indices
    ranked = order.gather(-1, by_force)  # (P, M)
    take = torch.arange(ranked.shape[-1]) < totals  # (P, M)
    return torch.zeros_like(force).scatter_(-1, ranked, take).reshape(L, H, T)
