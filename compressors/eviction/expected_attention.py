"""Expected attention (kvpress's ExpectedAttentionPress; Devoto et al. 2025, arXiv 2510.00636): eviction by the
attention that future queries, modelled as a Gaussian, are expected to pay each key."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from compressors.eviction.evict import Eviction
from compressors.eviction.query_attention import Queries, capture_queries, per_kv_head
from kvbench.core.checks import check_choice, check_range
from kvbench.core.kv import Context, KVSequence


@dataclass
class ExpectedAttention(Eviction):
    """Expected attention (kvpress's ExpectedAttentionPress, NVIDIA; Devoto et al. 2025, arXiv 2510.00636):
    score each key by the attention that future queries are expected to pay it, times its value's norm.

    Simplified as kvpress does: the queries before RoPE are modelled as one Gaussian whose mean ``mu`` and
    covariance ``S`` are those of the sequence's queries after the ``sinks`` (the last ``query_window`` ones
    when that is > 0), per layer and query head. RoPE of the next ``future`` positions is averaged into one
    matrix ``R`` (the mean of the rotations, not a mixture), so a future query is ``N(R mu, R S R^T)`` and, with
    logit scale ``s``, ``E[exp(s q.k)] = exp(s k.R mu + s^2 k^T R S R^T k / 2)``. Softmax over the keys after the
    sinks gives the expected attention, averaged over the query heads of a KV head, then (``value_norm``)
    ``(score + epsilon) * ||v||``. The sinks are always kept. Logit soft-capping is ignored in the expectation.

    In a sliding-window layer (gemma-3's local layers) the future query at position ``p`` sees only keys newer than
    ``p - W``: a key none of the next ``future`` queries can see has expected attention 0, and a visible key's is
    scaled by the share of those queries that see it, so such a layer spends its budget on the keys its queries
    can still read (``sliding=False``: windows ignored, as kvpress's press does).
    """

    sinks: int = 4
    future: int = 512
    query_window: int = 0
    covariance: bool = True
    value_norm: bool = True
    epsilon: float = 0.0
    sliding: bool = True

    name = "expected_attention"
    needs_model = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range(self.name, "future", self.future, 1, 1 << 30, integer=True)
        check_range(self.name, "query_window", self.query_window, 0, 1 << 30, integer=True)
        check_range(self.name, "epsilon", self.epsilon, 0.0, math.inf)
        check_choice(self.name, "covariance", self.covariance, (True, False))
        check_choice(self.name, "value_norm", self.value_norm, (True, False))
        check_choice(self.name, "sliding", self.sliding, (True, False))

    def _mean_rotation(self, qs: Queries, start: int, D: int) -> torch.Tensor:
        """``(L, D, D)`` M with ``x @ M`` = the averaged RoPE of the next ``future`` positions applied to ``x``."""
        from kvbench.core.rope import Rotary

        cos, sin = Rotary(qs.config).angles(self.future, start)  # (L, 1, F, R)
        c, s = cos.mean(2), sin.mean(2)  # (L, 1, R)
        R = c.shape[-1]
        eye = torch.eye(D).expand(c.shape[0], D, D)  # (L, D, D) row j = e_j
        half = eye[..., :R].chunk(2, dim=-1)
        rot = eye[..., :R] * c + torch.cat([-half[1], half[0]], dim=-1) * s  # RoPE's rotate-half pairing  # (L, D, R) row j = averaged rotation of e_j
        return torch.cat([rot, eye[..., R:]], dim=-1)  # (L, D, D)

    def _seen_share(self, qs: Queries, T: int) -> torch.Tensor:
        """``(L, 1, T)``: the share of the next ``future`` queries (positions ``T .. T + future - 1`` of this
        segment) whose layer's sliding window holds each key; 1 in full-attention layers."""
        share = torch.ones(len(qs.sliding), 1, T)
        if not self.sliding:
            return share
        t = torch.arange(T, dtype=torch.float32)
        for layer, W in enumerate(qs.sliding):
            if W:  # query p sees key t iff p - t < W: of p in [T, T + future), those below t + W
                share[layer, 0] = (t + W - T).clamp(0, self.future) / self.future
        return share

    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        L, H, T, D = kv.shape
        sinks = min(self.sinks, T - 1)
        first = sinks if self.query_window == 0 else max(sinks, T - self.query_window)
        qs = capture_queries(self.name, kv, ctx, first)
        Hq = qs.q_pre.shape[1]
        M = self._mean_rotation(qs, ctx.start + T, D)  # (L, D, D)
        mu = torch.einsum("lhd,lde->lhe", qs.q_pre.mean(2), M)  # (L, Hq, D)
        keys = kv.k.float().repeat_interleave(Hq // H, dim=1)  # (L, Hq, T, D)
        scale = torch.tensor(qs.scaling).view(L, 1, 1)
        logits = torch.einsum("lhd,lhtd->lht", mu, keys) * scale  # (L, Hq, T)
        if self.covariance:
            centred = qs.q_pre - qs.q_pre.mean(2, keepdim=True)  # (L, Hq, n, D)
            cov = centred.transpose(2, 3) @ centred / centred.shape[2]  # (L, Hq, D, D)
            cov = M.transpose(1, 2).unsqueeze(1) @ cov @ M.unsqueeze(1)  # (L, Hq, D, D) R S R^T
            logits = logits + 0.5 * scale**2 * ((keys @ cov) * keys).sum(-1)
        logits[..., :sinks] = -math.inf  # the sinks are kept; the expectation is over the other keys
        seen = self._seen_share(qs, T)  # (L, 1, T)
        logits = logits.masked_fill(seen == 0, -math.inf)
        probs = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)  # a layer with no visible key scores 0
        expected = per_kv_head(probs * seen, H, reduce="mean")  # (L, H, T)
        if self.value_norm:
            expected = (expected + self.epsilon) * kv.v.float().norm(dim=-1)
        return expected
