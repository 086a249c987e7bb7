"""The Gaussian rate–distortion reference of a reconstruction: the fewest bits per element with which a coder could
reach the run's measured relative MSE on the coded windows, were each layer's K (and V) vectors Gaussian with the
covariance they have there.

Per kind and layer the vectors of all KV heads of a token are one sample of dimension ``H·D`` (as KVTC's per-layer
basis takes them); their covariance about the layer's mean (the mean is side information, free at any rate) has
eigenvalues ``λ``. Reverse water-filling (Cover & Thomas, *Elements of Information Theory*, 2nd ed., Thm. 10.3.3)
over every component of every layer at once finds the level ``θ`` with ``Σ min(λ, θ) = D`` and spends
``Σ max(0, ½ log2(λ/θ))`` bits per token; ``D`` is the run's relative MSE of that kind times the vectors' mean
energy (as ``rel_mse_k`` and ``rel_mse_v`` are defined: squared error over the uncentred energy).

What the figure is, and is not: among sources with a given covariance the Gaussian has the largest rate–distortion
function, so this is the rate at which a coder matched to the second-order statistics alone is sure to reach the
distortion, not a lower bound on what any coder needs; and it prices squared error, which the NLL does not weigh
evenly. Keys are taken as stored (after RoPE) and, where the model config is known, with RoPE undone: rotation does
not change a token's squared error, so both reach the same relative MSE, and the pre-RoPE keys are what a coder with
the config (KVTC, waterfill) codes. Layers are not coded jointly here (a covariance over all layers' elements has
more dimensions than a run has tokens).

The *weighted* rate prices the error as the coder's own allocation does (:meth:`kvbench.core.compressor.Compressor.kind_weights`:
KVTC and waterfill minimise ``w_K·relMSE_K + w_V·relMSE_V``): every component's variance is scaled by its kind's
weight over its kind's energy, and one water level over K and V together reaches the cell's weighted distortion.
K and V may then trade error, so it is never above the unweighted rate; the gap from a cell's stream bits down to it
is what the quantizer and entropy model lose against a Gaussian-matched coder minimising the same objective, and
the step from it up to the unweighted rate is what the cell's own split of error between K and V costs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

#: bisection steps on log θ: the level is found to a relative precision far below any figure reported
STEPS = 200


def layer_spectra(xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, float]:
    """Eigenvalues of each layer's covariance over the tokens of ``xs`` (each ``(L, H, T, D)``), ``(L, H·D)``
    float64 and descending, and the vectors' mean squared norm per token (all layers, uncentred)."""
    cols = [x.double().permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1) for x in xs]  # each (L, T, H·D)
    x = torch.cat(cols, dim=1)  # (L, N, d)
    n = x.shape[1]
    if n < 2:
        raise ValueError(f"a covariance needs at least 2 tokens; got {n}")
    energy = float(x.pow(2).sum()) / n
    xc = x - x.mean(dim=1, keepdim=True)
    cov = xc.transpose(1, 2) @ xc / n  # (L, d, d)
    eig = torch.linalg.eigvalsh(cov).clamp_min(0).flip(-1)  # (L, d)
    return eig, energy


def reverse_waterfill(eig: torch.Tensor, distortion: float) -> float:
    """Bits per vector of independent Gaussian components of variances ``eig`` (any shape) at total squared error
    ``distortion``: 0 when it is at least their summed variance, infinite when it is 0."""
    lam = eig.double().flatten()
    lam = lam[lam > 0]
    if distortion >= float(lam.sum()):
        return 0.0
    if distortion <= 0:
        return math.inf
    lo, hi = math.log(float(lam.min()) * 1e-12 + 1e-300), math.log(float(lam.max()))
    for _ in range(STEPS):  # Σ min(λ, θ) grows with θ
        mid = 0.5 * (lo + hi)
        if float(lam.clamp(max=math.exp(mid)).sum()) > distortion:
            hi = mid
        else:
            lo = mid
    theta = math.exp(0.5 * (lo + hi))
    return float((0.5 * torch.log2(lam / theta)).clamp_min(0).sum())


def weighted_reverse_waterfill(spectra: Sequence[tuple[torch.Tensor, float]], rel_mses: Sequence[float],
                                weights: Sequence[float]) -> float:
    """Bits per vector of the Gaussian components of several kinds (``spectra``: each kind's eigenvalues and its mean
    energy per vector, as :func:`layer_spectra` gives them) at the weighted relative distortion
    ``Σ weight·rel_mse``, each kind's error counted relative to its energy and weighted as the coder weighs it."""
    lam = torch.cat([eig.double().flatten() * (w / energy) for (eig, energy), w in zip(spectra, weights, strict=True)])
    return reverse_waterfill(lam, sum(w * r for w, r in zip(weights, rel_mses, strict=True)))


#: the rates :func:`gaussian_rd` returns (beside ``rd_key_weight``), NaN where a run has no finite reference
RD_RATES = ("rd_bits_per_element", "rd_bits_per_element_pre_rope", "rd_bits_per_element_weighted")


def gaussian_rd(ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], rel_mse_k: float, rel_mse_v: float,
                rotary: Any = None, weights: tuple[float, float] = (1.0, 1.0)) -> dict[str, float]:
    """``rd_bits_per_element`` (keys as stored) and ``rd_bits_per_element_pre_rope`` (keys with RoPE undone by
    ``rotary``, a :class:`kvbench.core.rope.Rotary` of the model; NaN without one): the Gaussian rate–distortion
    rates over every K and V element of the windows ``ks``/``vs`` (each ``(L, H, T, D)``, starting at position 0) at
    the given relative MSEs; ``rd_bits_per_element_weighted``: the rate at the same weighted distortion
    ``weights[0]·rel_mse_k + weights[1]·rel_mse_v`` with K and V free to trade error (keys with RoPE undone where
    ``rotary`` is given, as stored otherwise)."""
    L, H, _, D = ks[0].shape
    per_token = 2 * L * H * D  # K and V elements of one token

    def rate(spectrum: tuple[torch.Tensor, float], rel: float) -> float:
        eig, energy = spectrum
        return reverse_waterfill(eig, rel * energy)

    spec_k, spec_v = layer_spectra(ks), layer_spectra(vs)
    r_v = rate(spec_v, rel_mse_v)
    out = {"rd_bits_per_element": (rate(spec_k, rel_mse_k) + r_v) / per_token}
    pre = math.nan
    if rotary is not None:
        spec_k = layer_spectra([rotary.undo(k, 0) for k in ks])
        pre = (rate(spec_k, rel_mse_k) + r_v) / per_token
    out["rd_bits_per_element_pre_rope"] = pre
    out["rd_bits_per_element_weighted"] = weighted_reverse_waterfill([spec_k, spec_v], [rel_mse_k, rel_mse_v],
                                                                     weights) / per_token
    out["rd_key_weight"] = weights[0] / weights[1]
    return out
