"""KVTC's calibration (arXiv 2511.01815): the PCA bases, the entropy-calibrated quantizer steps, the bit
allocation by dynamic programming, and the codec state sections they make. The coder that reads that state back is
:class:`compressors.transform.kvtc.Kvtc`, whose docstring describes the method."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from compressors.predictive import fit_numerics
from kvbench.coding.bitstream import varints
from kvbench.coding.packing import pack_codes, tensor_to_bytes
from kvbench.core.compressor import Section

SCOPES = ("layer", "global", "concat")
ALLOCATIONS = ("dp", "uniform")
#: widths the allocation chooses from: 0 (dropped) .. MAX_WIDTH bits per coefficient
MAX_WIDTH = 8
#: coefficients are clipped at this many calibration standard deviations
Z_CLIP = 16.0
#: histogram frequencies are stored on this many bits (every symbol in range keeps a frequency of at least 1)
FREQ_BITS = 16
#: calibration coefficients used to find the entropy-calibrated steps (a subsample: enough for 8 bits of entropy)
_STEP_SAMPLES = 1 << 19


# ---- allocation -----------------------------------------------------------------------------------------------


def allocate_dp(distortion: np.ndarray, budget: int) -> np.ndarray:
    """Widths ``w_i`` in ``0..W`` minimising ``sum_i distortion[i, w_i]`` subject to ``sum_i w_i <= budget``.

    ``distortion`` is ``(n, W + 1)``: the error of item i at each width (``W <= 15``). Exact dynamic programming over
    the budget (the knapsack recursion ``f_i(β) = min_w f_{i-1}(β - w) + D_i(w)``), vectorised over β; ties go to
    the narrower width. Time ``n · W · budget``; the choices are kept at 4 bits each, ``n · budget / 2`` bytes.
    """
    dist = np.asarray(distortion, dtype=np.float64)
    if dist.ndim != 2 or not 1 <= dist.shape[1] <= 16:
        raise ValueError(f"distortion must be (items, widths + 1) with at most 16 widths; got shape {dist.shape}")
    n, n_w = dist.shape
    if budget < 0:
        raise ValueError(f"bit budget must be >= 0, got {budget}")
    budget = int(min(budget, (n_w - 1) * n))
    f = np.zeros(budget + 1)  # best total error of the items so far with at most β bits
    choice = np.zeros(((n + 1) // 2, budget + 1), dtype=np.uint8)  # two items per byte, low nibble first
    cand = np.empty((n_w, budget + 1))
    for i in range(n):
        cand.fill(np.inf)
        for w in range(min(n_w, budget + 1)):
            np.add(f[: budget + 1 - w], dist[i, w], out=cand[w, w:])
        best = cand.argmin(axis=0).astype(np.uint8)
        choice[i // 2] |= best << np.uint8(4 * (i % 2))
        f = np.take_along_axis(cand, best[None].astype(np.intp), axis=0)[0]
    widths = np.zeros(n, dtype=np.int64)
    left = budget
    for i in range(n - 1, -1, -1):
        widths[i] = (int(choice[i // 2, left]) >> (4 * (i % 2))) & 0xF
        left -= widths[i]
    return widths


def allocate_uniform(variance: np.ndarray, budget: int, max_width: int = MAX_WIDTH) -> np.ndarray:
    """The same width for every component (``budget // n``), the remainder one bit each to the largest ones."""
    var = np.asarray(variance, dtype=np.float64).reshape(-1)
    n = var.size
    base = min(max_width, budget // max(n, 1))
    widths = np.full(n, base, dtype=np.int64)
    extra = min(budget - base * n, n) if base < max_width else 0
    widths[np.argsort(-var, kind="stable")[:extra]] += 1
    return widths


# ---- calibration helpers --------------------------------------------------------------------------------------


def principal_axes(x: torch.Tensor, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Principal axes of centred samples ``x`` ``(N, d)``: ``(variances (r,), axes (d, r))``, largest first.

    Uses the covariance when ``N >= d`` and the Gram matrix otherwise (then at most N axes exist), in float64, each
    axis's sign fixed (:func:`compressors.predictive.fit_numerics.eigh`): the same basis, rounded to float16, on any
    machine.
    """
    x = x.double()
    n, d = x.shape
    if n >= d:
        var, axes = fit_numerics.eigh(fit_numerics.gemm(x.T, x) / n)  # (d,), (d, d), ascending
        var, axes = var.flip(0), axes.flip(1)
    else:
        var, u = fit_numerics.eigh(fit_numerics.gemm(x, x.T) / n)  # (N,), (N, N)
        var, u = var.flip(0), u.flip(1)
        keep = var > var[0].clamp_min(1e-300) * 1e-12
        var, u = var[keep], u[:, keep]
        axes = fit_numerics.canonical_signs(fit_numerics.gemm(x.T, u) / torch.sqrt(var * n))  # (d, r): right singular vectors
    var = var.clamp_min(0)
    r = axes.shape[1] if rank is None else min(rank, axes.shape[1])
    return var[:r], axes[:, :r]


def _entropy_bits(z: np.ndarray, step: float) -> float:
    q = np.rint(z / step).astype(np.int64)
    counts = np.bincount(q - q.min())
    p = counts[counts > 0] / z.size
    return float(-(p * np.log2(p)).sum())


def calibrated_steps(z: np.ndarray, max_width: int = MAX_WIDTH) -> np.ndarray:
    """``(max_width,)`` steps ``Δ_w`` (w = 1..max_width) at which ``round(z / Δ_w)`` has an entropy of w bits, for
    unit-variance calibration coefficients ``z``; found by bisection on ``log2 Δ`` (the entropy falls as Δ grows)."""
    z = np.asarray(z, dtype=np.float64).reshape(-1)
    if z.size < 2:
        raise ValueError("kvtc: too few calibration coefficients to calibrate the quantizer steps")
    steps = np.empty(max_width)
    for w in range(1, max_width + 1):
        lo, hi = -16.0, 8.0
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            if _entropy_bits(z, 2.0**mid) > w:
                lo = mid
            else:
                hi = mid
        steps[w - 1] = 2.0 ** (0.5 * (lo + hi))
    return steps


def half_range(step: float) -> int:
    """Largest symbol magnitude at a normalized step (coefficients are clipped at ``Z_CLIP`` standard deviations)."""
    return max(1, math.ceil(Z_CLIP / step))


# ---- inputs ------------------------------------------------------------------------------------------------------


def calibration_keys(owner: str, kv: Any, config: Any, undo: Callable[[Any], Any], otherwise: str = "") -> torch.Tensor:
    """A calibration window's keys with RoPE undone (it starts at position 0): by ``undo(config)`` (a
    :class:`kvbench.core.rope.Rotary`) when the model config is given, else as captured before RoPE."""
    if config is not None:
        return undo(config).undo(kv.k, 0)
    if kv.k_pre_rope is not None:
        return kv.k_pre_rope.float()
    raise ValueError(f"{owner}.fit needs the model config to undo RoPE on the calibration keys: call "
                     f"fit(calib, config=model_config) or capture the calibration windows with capture.pre_rope=true"
                     f"{otherwise}")


def raw_sections(sections: Mapping[str, Section]) -> dict[str, bytes]:
    """State sections as plain bytes (a ``(bytes, exact_bits)`` section's bytes)."""
    return {k: bytes(v) if isinstance(v, (bytes, bytearray)) else bytes(v[0]) for k, v in sections.items()}


# ---- layout -----------------------------------------------------------------------------------------------------


def columns(x: torch.Tensor, scope: str) -> torch.Tensor:
    """``(L, H, T, D)`` -> ``(U, d, T)``: one column of all heads per token, per layer (or all layers for concat)."""
    L, H, T, D = x.shape
    cols = x.permute(0, 1, 3, 2).reshape(L, H * D, T)  # (L, H*D, T)
    return cols.reshape(1, L * H * D, T) if scope == "concat" else cols


def uncolumns(cols: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """Inverse of :func:`columns`: ``(U, d, T)`` -> ``(L, H, T, D)``."""
    L, H, T, D = shape
    return cols.reshape(L, H, D, T).permute(0, 1, 3, 2)


# ---- fitting ---------------------------------------------------------------------------------------------------


@dataclass
class Fitted:
    """One kind's calibration analysis, before the allocation."""

    mean: torch.Tensor  # (U, d) float16
    basis: torch.Tensor  # (G, d, r) float16
    coef: np.ndarray  # (U, r, N) float32 calibration coefficients
    sigma: np.ndarray  # (U, r) float64 (float16 values), 0 for dead components
    steps: np.ndarray  # (MAX_WIDTH,) float64 (float32 values)
    dist: np.ndarray  # (U, r, MAX_WIDTH + 1) mean squared error per token at each width
    energy: float  # mean squared norm of a unit's vector (for relative errors)


def analyse(x: torch.Tensor, scope: str, rank: int | None) -> Fitted:
    """Mean, basis, scales, steps and the error of every component at every width, from ``x`` ``(U, d, N)``
    (``scope``: :data:`SCOPES`; ``rank``: the most axes a basis keeps, None for every one)."""
    U, d, N = x.shape
    mean = x.mean(dim=2).to(torch.float16)  # (U, d): the stored precision is the one the encoder uses
    xc = x - mean.double()[:, :, None]  # (U, d, N)
    if scope == "layer":
        axes = [principal_axes(xc[u].T, rank)[1] for u in range(U)]
    else:  # one basis: layers (global) are extra samples, or there is one unit (concat)
        axes = [principal_axes(xc.permute(0, 2, 1).reshape(U * N, d), rank)[1]]
    r = min(a.shape[1] for a in axes)
    basis = torch.stack([a[:, :r] for a in axes]).to(torch.float16)  # (G, d, r)
    # float64 sums rounded once (fit_numerics): the stored sigma (float16) and the histograms then come out the
    # same on any machine, where float32 sums would move a float16 rounding every few thousand components
    coef64 = fit_numerics.gemm(basis.transpose(1, 2), xc).numpy()  # (U, r, N)
    coef = coef64.astype(np.float32)  # (U, r, N)
    sigma = np.sqrt(np.mean(np.square(coef64), axis=2))  # (U, r)
    del coef64
    sigma = sigma.astype(np.float16).astype(np.float64)  # as stored
    live = sigma > 0
    z = (coef[live] / sigma[live][:, None]).reshape(-1)
    rng = np.random.default_rng(0)
    sample = z if z.size <= _STEP_SAMPLES else rng.choice(z, _STEP_SAMPLES, replace=False)
    steps = calibrated_steps(sample).astype(np.float32).astype(np.float64)  # stored as float32

    # squared error of every component at every width, measured on the calibration coefficients
    dist = np.empty((U, r, MAX_WIDTH + 1))
    dist[:, :, 0] = np.mean(np.square(coef, dtype=np.float64), axis=2)
    safe = np.where(live, sigma, 1.0).astype(np.float32)[:, :, None]  # (U, r, 1)
    err = np.empty_like(coef)
    for w in range(1, MAX_WIDTH + 1):
        step = safe * np.float32(steps[w - 1])
        half = half_range(steps[w - 1])
        np.divide(coef, step, out=err)
        np.rint(err, out=err)
        np.clip(err, -half, half, out=err)
        err *= step
        err -= coef
        np.square(err, out=err)
        dist[:, :, w] = np.where(live, err.mean(axis=2, dtype=np.float64), 0.0)
    del err
    energy = float(np.mean(np.square(x.numpy()), dtype=np.float64) * d)  # mean squared norm per unit and token
    return Fitted(mean, basis, coef, sigma, steps, dist, energy)


def allocate(fitted: dict[str, Fitted], n_elements: int, bits: float, allocation: str,
             key_weight: float) -> dict[str, np.ndarray]:
    """Widths ``(U, r)`` per kind under one budget of ``bits`` per element over K and V together (``allocation``:
    :data:`ALLOCATIONS`; ``key_weight``: the weight of the keys' relative error in the DP)."""
    budget = math.floor(bits * len(fitted) * n_elements + 1e-9)
    if allocation == "uniform":
        var = np.concatenate([f.dist[:, :, 0].reshape(-1) for f in fitted.values()])
        flat = allocate_uniform(var, budget)
    else:
        # the error each kind contributes relative to its energy (the keys' weighted by key_weight): raw
        # squared error would hand the bits to whichever kind has the larger values
        weight = {"k": key_weight, "v": 1.0}
        flat = allocate_dp(np.concatenate([f.dist.reshape(-1, MAX_WIDTH + 1) * (weight[kind] / f.energy)
                                           for kind, f in fitted.items()]), budget)
    out, at = {}, 0
    for kind, f in fitted.items():
        n = f.sigma.size
        out[kind] = np.where(f.sigma > 0, flat[at : at + n].reshape(f.sigma.shape), 0)
        at += n
    return out


def state_sections(kind: str, f: Fitted, widths: np.ndarray) -> dict[str, Section]:
    """One kind's state sections: what its decoder needs, for the allocated widths."""
    U, d = f.mean.shape
    # histograms of the calibration symbols, one per width
    freqs = {}
    for w in range(1, MAX_WIDTH + 1):
        sel = widths == w
        if not sel.any():
            continue
        half = half_range(f.steps[w - 1])
        q = np.clip(np.rint(f.coef[sel] / (f.sigma[sel][:, None] * f.steps[w - 1])), -half, half).astype(np.int64)
        counts = np.bincount((q + half).reshape(-1), minlength=2 * half + 1)
        spare = (1 << FREQ_BITS) - (2 * half + 1)  # every symbol keeps frequency >= 1: codable if unseen
        freqs[w] = np.floor(counts / counts.sum() * spare).astype(np.int64) + 1

    # keep each basis up to its last used component
    G = f.basis.shape[0]
    kept = widths > 0  # (U, r)
    used = kept.any(axis=0, keepdims=True) if G == 1 else kept  # (G, r)
    ranks = [int(np.flatnonzero(row)[-1]) + 1 if row.any() else 0 for row in used]
    R = max(ranks)
    basis_raw = b"".join(tensor_to_bytes(f.basis[g, :, : ranks[g]].contiguous()) for g in range(G))
    widths, sigma = widths[:, :R], f.sigma[:, :R]
    flat_freqs = np.concatenate([freqs[w] for w in sorted(freqs)]) if freqs else np.zeros(0, np.int64)
    return {
        f"{kind}.dims": varints([U, G, d, R, *ranks]),
        f"{kind}.mean": tensor_to_bytes(f.mean),
        f"{kind}.basis": basis_raw,
        f"{kind}.widths": pack_codes(torch.from_numpy(widths.astype(np.uint8)), 4),
        f"{kind}.sigma": tensor_to_bytes(torch.from_numpy(sigma[widths > 0]).to(torch.float16)),
        f"{kind}.steps": tensor_to_bytes(torch.from_numpy(f.steps).float()),
        f"{kind}.freqs": pack_codes(torch.from_numpy(flat_freqs), FREQ_BITS),
    }
