"""Distortion of a reconstructed cache, per layer and K/V, accumulated over sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DistortionAccumulator:
    """Sums squared error and energy per (layer, kind) so that pooled ratios are exact over sequences."""

    err: dict[str, torch.Tensor] = field(default_factory=dict)  # kind -> (L,) float64
    energy: dict[str, torch.Tensor] = field(default_factory=dict)
    cos_sum: dict[str, torch.Tensor] = field(default_factory=dict)
    max_abs: dict[str, torch.Tensor] = field(default_factory=dict)
    vectors: dict[str, torch.Tensor] = field(default_factory=dict)  # kind -> (L,) vectors kept per layer
    total: dict[str, torch.Tensor] = field(default_factory=dict)  # kind -> (L,) vectors per layer

    def add(self, kind: str, x: torch.Tensor, x_hat: torch.Tensor, kept: torch.Tensor | None = None) -> None:
        """``x``, ``x_hat``: ``(L, H, T, D)``; ``kept`` ``(L, H, T)``: only kept vectors are measured (an evicted
        one is counted in :meth:`dropped_fraction`, not as error)."""
        L, H, T, _ = x.shape
        w = torch.ones(L, H, T, dtype=torch.float64) if kept is None else kept.double()  # (L, H, T)
        x, x_hat = x.double(), x_hat.double()
        diff = (x - x_hat) * w.unsqueeze(-1)
        err = diff.pow(2).reshape(L, -1).sum(1)  # (L,)
        energy = (x.pow(2) * w.unsqueeze(-1)).reshape(L, -1).sum(1)  # (L,)
        cos = (torch.nn.functional.cosine_similarity(x, x_hat, dim=-1, eps=1e-12) * w).reshape(L, -1).sum(1)  # (L,)
        mx = diff.abs().reshape(L, -1).amax(1) if diff.numel() else torch.zeros(L, dtype=torch.float64)
        n_kept, n_all = w.reshape(L, -1).sum(1), torch.full((L,), float(H * T), dtype=torch.float64)
        if kind in self.err:
            self.err[kind] += err
            self.energy[kind] += energy
            self.cos_sum[kind] += cos
            self.max_abs[kind] = torch.maximum(self.max_abs[kind], mx)
            self.vectors[kind] += n_kept
            self.total[kind] += n_all
        else:
            self.err[kind], self.energy[kind], self.cos_sum[kind], self.max_abs[kind] = err, energy, cos, mx
            self.vectors[kind], self.total[kind] = n_kept, n_all

    def dropped_fraction(self, kind: str) -> float:
        """Share of the vectors a decoder evicted (0 for a coder that keeps every entry)."""
        return float(1 - self.vectors[kind].sum() / self.total[kind].sum())

    def rel_mse(self, kind: str) -> float:
        return float(self.err[kind].sum() / self.energy[kind].sum())

    def max_abs_err(self, kind: str) -> float:
        """Largest absolute difference of any component, over all layers and sequences."""
        return float(self.max_abs[kind].max())

    def cosine(self, kind: str) -> float:
        return float(self.cos_sum[kind].sum() / self.vectors[kind].sum().clamp_min(1))

    def rows(self) -> list[dict]:
        out = []
        for kind in self.err:
            for layer in range(len(self.err[kind])):
                out.append({
                    "layer": layer,
                    "kind": kind,
                    "sq_err": float(self.err[kind][layer]),
                    "energy": float(self.energy[kind][layer]),
                    "rel_mse": float(self.err[kind][layer] / self.energy[kind][layer]),
                    "cosine": float(self.cos_sum[kind][layer] / self.vectors[kind][layer].clamp_min(1)),
                    "dropped": float(1 - self.vectors[kind][layer] / self.total[kind][layer]),
                    "max_abs_err": float(self.max_abs[kind][layer]),
                })
        return out
