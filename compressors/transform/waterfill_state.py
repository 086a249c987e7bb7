"""Waterfill's fitted state (:mod:`compressors.transform.waterfill`): what both sides hold, written as state
sections by the encoder's fit and parsed from those bytes by a decoder."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from compressors.transform.kvtc_calibration import FREQ_BITS, MAX_WIDTH, half_range
from kvbench.coding.bitstream import BitstreamError, read_varints, varints
from kvbench.coding.packing import pack_codes, tensor_from_bytes, tensor_to_bytes, unpack_codes
from kvbench.core.compressor import Section

KINDS = ("k", "v")


@dataclass
class State:
    """What both sides hold, parsed from the state bytes: per kind the mean, basis, scales and distortion table."""

    mean: dict[str, torch.Tensor]  # kind -> (U, d) float32
    basis: dict[str, torch.Tensor]  # kind -> (U, d, r) float32
    sigma: dict[str, np.ndarray]  # kind -> (U, r) float64, 0 for dead components
    dist: np.ndarray  # (U, C, W + 1) float64 weighted relative distortion, K's components then V's
    steps: dict[str, np.ndarray]  # kind -> (W,) normalized steps Δ_w
    probs: dict[str, dict[int, np.ndarray]]  # kind -> width -> normalized histogram of the offset symbols

    def split(self, widths: np.ndarray) -> dict[str, np.ndarray]:
        """``(..., C)`` -> per kind ``(..., r_kind)``."""
        r_k = self.sigma["k"].shape[1]
        return {"k": widths[..., :r_k], "v": widths[..., r_k:]}


def kind_sections(kind: str, f: Any) -> dict[str, Section]:
    """One kind's state: dims, mean, the full basis, the scales, the steps and a histogram per width over every live
    component's calibration symbols."""
    U, d = f.mean.shape
    r = f.basis.shape[2]
    live = f.sigma > 0
    freqs = []
    for w in range(1, MAX_WIDTH + 1):
        half = half_range(f.steps[w - 1])
        q = np.clip(np.rint(f.coef[live] / (f.sigma[live][:, None] * f.steps[w - 1])), -half, half).astype(np.int64)
        counts = np.bincount((q + half).reshape(-1), minlength=2 * half + 1)
        spare = (1 << FREQ_BITS) - (2 * half + 1)  # every symbol keeps frequency >= 1: codable if unseen
        freqs.append(np.floor(counts / counts.sum() * spare).astype(np.int64) + 1)
    return {
        f"{kind}.dims": varints([U, d, r]),
        f"{kind}.mean": tensor_to_bytes(f.mean),
        f"{kind}.basis": tensor_to_bytes(f.basis.contiguous()),
        f"{kind}.sigma": tensor_to_bytes(torch.from_numpy(f.sigma).to(torch.float16)),
        f"{kind}.steps": tensor_to_bytes(torch.from_numpy(f.steps).float()),
        f"{kind}.freqs": pack_codes(torch.from_numpy(np.concatenate(freqs)), FREQ_BITS),
    }


def parse_state(raw: Mapping[str, bytes]) -> State:
    def sec(name: str) -> bytes:
        if name not in raw:
            raise BitstreamError(f"waterfill state has no section {name!r} (written by another version?)")
        return bytes(raw[name])

    mean, basis, sigma, steps, probs = {}, {}, {}, {}, {}
    for kind in KINDS:
        (U, d, r), _ = read_varints(sec(f"{kind}.dims"), 3)
        mean[kind] = tensor_from_bytes(sec(f"{kind}.mean"), torch.float16, (U, d)).float()
        basis[kind] = tensor_from_bytes(sec(f"{kind}.basis"), torch.float16, (U, d, r)).float()
        sigma[kind] = tensor_from_bytes(sec(f"{kind}.sigma"), torch.float16, (U, r)).double().numpy()
        steps[kind] = tensor_from_bytes(sec(f"{kind}.steps"), torch.float32, (MAX_WIDTH,)).double().numpy()
        sizes = [2 * half_range(s) + 1 for s in steps[kind]]
        flat = unpack_codes(sec(f"{kind}.freqs"), FREQ_BITS, sum(sizes)).numpy().astype(np.float64)
        if (flat == 0).any():
            raise BitstreamError(f"waterfill state: a {kind} histogram has a zero frequency")
        probs[kind] = {w + 1: p / p.sum() for w, p in enumerate(np.split(flat, np.cumsum(sizes)[:-1]))}
    r_k, r_v = sigma["k"].shape[1], sigma["v"].shape[1]
    if mean["k"].shape != mean["v"].shape:
        raise BitstreamError("waterfill state: K and V were fitted on different shapes")
    U = mean["k"].shape[0]
    dist = tensor_from_bytes(sec("dist"), torch.float16, (U, r_k + r_v, MAX_WIDTH + 1)).double().numpy()
    if not np.isfinite(dist).all():
        raise BitstreamError("waterfill state: the distortion table is not finite")
    return State(mean, basis, sigma, dist, steps, probs)
