"""The distortion a later query sees, for waterfill's allocation (:mod:`compressors.transform.waterfill`).

Waterfill's calibrated table prices a PCA component's error by its share of the kind's energy: every direction of a
key or a value counts alike per unit of squared error. Attention does not read them alike. An error ``e`` in a
pre-RoPE key moves the logit of a pre-RoPE query ``q`` that sits ``Δ`` positions later by ``(R_Δ q)ᵀ e`` (RoPE, Su et
al., arXiv 2104.09864: ``(R_m q)ᵀ R_n k = (R_{m-n} q)ᵀ k``), so the logit's mean squared error is ``eᵀ M e`` with
``M = E[R_Δ q (R_Δ q)ᵀ]`` over queries and distances; an error ``e`` in a value reaches the layer's output through
``o_proj`` as ``‖W_o e‖²``. Pricing key error by attention-logit distortion under query statistics is the objective
of RDKV (arXiv 2605.08317) and of attention-aware transform coding, in place of the key's own MSE.

Here ``M`` is measured per sequence from the queries the encoder recomputes for it (every query head of a KV head's
group, each rotated by a distance drawn uniformly from the sequence's length, as a later question may sit anywhere
after the passage it reads), and ``W_oᵀ W_o`` per KV head from the model's weights (its query heads' blocks of
``o_proj``, summed: each head reads the value through its own block). A component ``u``'s scale is its quadratic
form ``uᵀ M u`` over the ``σ²``-weighted mean of the layer's scales for that kind, so an isotropic metric leaves the
calibrated table as it is and the keys' weight against the values' stays ``key_weight``'s: the metric moves bits
between the directions of a layer's keys (or values), not between layers or kinds. The encoder sends the scales
(float16, one per layer and component), and the decoder applies the same ones.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvbench.core.rope import Rotary
from kvbench.inputs.model_queries import decoder_stack

#: seed of the distances the queries are rotated by: the encoder alone draws them, so any fixed draw is reproducible
DISTANCE_SEED = 0


def relative(g: torch.Tensor, sigma: np.ndarray) -> torch.Tensor:
    """``(U, r)`` quadratic forms -> scales over their ``σ²``-weighted mean per layer (1 where that mean is 0)."""
    s2 = torch.from_numpy(np.asarray(sigma, dtype=np.float64)) ** 2  # (U, r)
    mean = (g * s2).sum(dim=1, keepdim=True) / s2.sum(dim=1, keepdim=True).clamp_min(1e-300)  # (U, 1)
    return torch.where(mean > 0, g / mean.clamp_min(1e-300), torch.ones_like(g))


def quadratic_forms(metric: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``uᵀ M u`` for every basis column: ``metric`` ``(U, H, D, D)`` per KV head, ``basis`` ``(U, H*D, r)`` with a
    column of all heads -> ``(U, r)`` float64."""
    U, H, D, _ = metric.shape
    u = basis.double().reshape(U, H, D, -1)  # (U, H, D, r)
    return torch.einsum("uhdr,uhde,uher->ur", u, metric.double(), u)


def query_metric(q_pre: torch.Tensor, rotary: Rotary, n_kv_heads: int) -> torch.Tensor:
    """``(L, H, D, D)``: ``E[R_Δ q (R_Δ q)ᵀ]`` summed over each KV head's query heads, from the pre-RoPE queries
    ``q_pre`` ``(L, Hq, T, D)``, each rotated by its own distance ``Δ`` in ``[0, T)``."""
    L, Hq, T, D = q_pre.shape
    gen = torch.Generator().manual_seed(DISTANCE_SEED)
    order = torch.randperm(T, generator=gen)  # every distance in [0, T) once, in a fixed shuffled order
    rotated = rotary.apply(q_pre[:, :, order].float(), 0)  # (L, Hq, T, D): query order[j] rotated by R_j
    grouped = rotated.double().reshape(L, n_kv_heads, (Hq // n_kv_heads) * T, D)  # (L, H, G*T, D)
    return grouped.transpose(2, 3) @ grouped / T  # (L, H, D, D)


def output_metric(model: Any, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """``(L, H, D, D)``: ``Σ_j W_jᵀ W_j`` over each KV head's query heads ``j``, ``W_j`` the head's
    ``(hidden, D)`` block of the layer's ``o_proj``."""
    out = []
    for layer in decoder_stack(model, "waterfill").layers:
        w = layer.self_attn.o_proj.weight.detach().double()  # (hidden, Hq*D)
        blocks = w.reshape(w.shape[0], -1, head_dim).permute(1, 2, 0)  # (Hq, D, hidden)
        per_head = blocks @ blocks.transpose(1, 2)  # (Hq, D, D)
        out.append(per_head.reshape(n_kv_heads, -1, head_dim, head_dim).sum(1))  # (H, D, D)
    return torch.stack(out)
