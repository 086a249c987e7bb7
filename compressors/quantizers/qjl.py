"""1-bit quantized Johnson–Lindenstrauss sketch (QJL: Zandieh, Daliri, Han, arXiv 2406.03482).

A vector r in R^d is stored as the signs z = sign(S r) of m Gaussian projections (S has i.i.d. N(0, 1) entries),
plus its norm. The reconstruction r̂ = ||r||·√(π/2)/m · Sᵀ z is an unbiased estimate of r in every inner product:
E_S <q, r̂> = <q, r>, because E[S_j sign(<S_j, r>)] = √(2/π) r/||r|| for a Gaussian row S_j. S is regenerated
from the seed by the decoder, so it costs 0 bits.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from compressors.quantizers.rotation import generator


class QJLSketch:
    def __init__(self, d: int, m: int, seed: int, stream: int = 1) -> None:
        self.d, self.m = d, m
        self.s_t = torch.randn(m, d, generator=generator(seed, stream)).T.contiguous()  # (d, m), Sᵀ

    def signs(self, r: torch.Tensor) -> torch.Tensor:
        """``r`` (N, d) -> bits (N, m) as uint8, 1 where <S_j, r> >= 0."""
        proj = r @ self.s_t.to(r)  # (N, m)
        if proj.device.type != "cpu":
            return (proj >= 0).to(torch.uint8)
        return torch.from_numpy((proj.numpy() >= 0).view(np.uint8))  # numpy's compare is the cheaper one on CPU

    def reconstruct(self, signs: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """``signs`` (N, m) as ±1 floats (or 0/1 bits) and ``norms`` (N,) -> r̂ (N, d)."""
        z = signs.float() if signs.is_floating_point() else signs.float() * 2 - 1  # (N, m) in {-1, +1}
        r_hat = z @ self.s_t.T.to(z)  # (N, d)
        c = math.sqrt(math.pi / 2) / self.m
        if r_hat.device.type != "cpu":
            return r_hat * (norms.float() * c)[:, None]
        scale = norms.numpy().astype(np.float32) * np.float32(c)  # (N,); numpy: no thread hand-off on CPU
        np.multiply(r_hat.numpy(), scale[:, None], out=r_hat.numpy())
        return r_hat
