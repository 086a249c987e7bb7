"""The error the model's own queries see in a reconstructed cache: attention-logit and attention-output distortion.

A key's relative MSE weighs every direction alike, but attention reads a key only through its dot products with the
queries, so an error along a direction no query looks at costs nothing and one along the queries' direction costs
everything (TurboQuant-4 ranked among the safest coders on Qwen2.5 by relative MSE and lost 0.84 nats). These two
figures measure the error where the model reads it, at the positions the run scores.

**Queries.** A window's prefix holds ``T`` tokens (positions ``0 .. T - 1``) and its held-out continuation
``c_0 .. c_E``; the model reads ``c_0 .. c_{E-1}`` at positions ``T .. T + E - 1`` to score ``c_1 .. c_E``. Those
``E`` inputs are the scored positions. :func:`continuation_queries` runs the decoder stack on them over a cache built
from the *exact* prefix KV (as the baseline scores them) and reads each layer's queries off its attention modules
(:func:`kvbench.inputs.model_queries.tap_queries`: the module's query projection, ``q_norm`` where it has one),
RoPE at their own positions. ``metrics.attn_queries`` evenly spaced ones of the ``E`` are kept (all of them where
``E`` is smaller), in float16: they are the same for every cell on a trace, and the harness keeps them per
process. Since the queries come from the exact pass, each layer's figure is that layer's own error on the same
inputs, not the error an earlier layer's distortion propagates into later hidden states.

**Keys.** Only the prefix's keys ``k_t`` (``t < T``) are measured: the continuation's own keys are computed exactly
in both passes and are left out. Every prefix key precedes every query, so causality holds by itself; a
sliding-window layer's query at ``i`` sees only ``i - t < window``. Under GQA each query head is measured against its
own KV head (head ``j`` reads KV head ``j // G``).

For layer ``l``, with ``q`` a kept query (each query head, each scored position), ``t`` a prefix key it sees, and
sums pooled over KV heads and over the run's windows:

- ``attn_logit_rel_mse[l] = Σ (q·(k̂_t − k_t))² / Σ (q·k_t)²``, over the entries the decoder kept (an evicted key has
  no logit; its loss is in the output error). Raw dot products: the ratio does not depend on the logit scale.
- ``attn_output_rel_err[l] = sqrt(Σ ‖ô − o‖² / Σ ‖o‖²)`` with ``o = softmax_t(a(s q·k_t)) v_t`` over the prefix keys
  the query sees and ``ô`` the same with ``k̂, v̂`` over those the decoder kept (evicted entries leave the softmax, as
  :mod:`kvbench.cache.eviction_mask` hides them from the model); ``s`` the layer's own logit scale
  (``attn.scaling``: ``head_dim**-0.5``, Gemma's ``query_pre_attn_scalar**-0.5``) and ``a`` its logit soft-capping
  where it has one. ``o`` is one head's output before ``o_proj``, over the prefix alone (the model's softmax also
  spans the continuation's keys, which are exact; leaving them out keeps the figure the prefix cache's).

- ``attn_logit_mse[l] = mean (ℓ̂_t − ℓ_t)²`` over the same kept entries, with ``ℓ = a(s q·k_t)`` the logit the
  softmax reads: the error in the softmax's own units (nats of odds between two keys), not relative to the logits'
  energy. A key with outliers has large logits, so a relative error that looks small can still move the softmax by
  whole nats; this figure does not divide that away.
- ``attn_kl[l]``: the mean over (query head, scored position) of ``KL(p ‖ p̂)``, in nats, ``p = softmax_t(ℓ_t)`` over
  the prefix keys the query sees and ``p̂`` the decoded one's; NaN for a layer where the decoder evicted a key some
  query sees (``p̂`` is then zero where ``p`` is not and the divergence is infinite; the output error still measures
  it). Queries that see no prefix key are left out.

A run's figure is the mean over layers of the per-layer ratios (layers where no query sees a prefix key left out);
``rows.parquet`` holds the per-layer ones. NaN where nothing was measured (no model loaded, nothing scored).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.core.kv import KVSequence
from kvbench.core.rope import Rotary
from kvbench.inputs.model_queries import decoder_stack, masked_logits, tap_queries, visible
from kvbench.measure.metrics.task_loss import build_cache

#: (KV head, query, key) entries of one layer's blocks held at once: bounds the memory at long contexts
BLOCK_ENTRIES = 1 << 21
#: largest magnitude stored as float16; queries beyond it stay float32
FLOAT16_MAX = 6.0e4


@dataclass(frozen=True)
class ScoredQueries:
    """The model's queries at some scored positions of one window, and how each layer turns them into logits."""

    q: torch.Tensor  # (L, Hq, n, D) float16, post-RoPE
    positions: torch.Tensor  # (n,) int64: the queries' positions (T + offset into the continuation)
    scaling: list[float]  # per layer: the logit scale
    sliding: list[int | None]  # per layer: the sliding window, None for full attention
    softcap: list[float | None]  # per layer: logit soft-capping, None where the model has none

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size()


def scored_picks(n_scored: int, n: int) -> torch.Tensor:
    """``(m,)``: ``n`` evenly spaced offsets in ``0 .. n_scored - 1`` (first and last included), every offset
    where ``n >= n_scored``, none where ``n <= 0``."""
    if n <= 0 or n_scored <= 0:
        return torch.zeros(0, dtype=torch.long)
    if n >= n_scored:
        return torch.arange(n_scored)
    return torch.linspace(0, n_scored - 1, n).round().long()  # spacing >= 1 when n < n_scored: no repeats


@torch.no_grad()
def continuation_queries(model: Any, kv: KVSequence, continuation: torch.Tensor, n: int) -> ScoredQueries:
    """The queries of ``n`` evenly spaced scored positions of ``continuation[:-1]`` (``(E + 1,)`` ids), read off
    the model's pass over the exact prefix cache ``kv`` at positions ``T .. T + E - 1``."""
    T, E = kv.n_tokens, int(continuation.numel()) - 1
    picks = scored_picks(E, n)  # (m,)
    decoder = decoder_stack(model, "the attention-error metric")
    device = next(model.parameters()).device
    positions = torch.arange(T, T + E, device=device).unsqueeze(0)  # (1, E)
    owner = "the attention-error metric (metrics.attn_queries=0 measures a run without it)"
    with tap_queries(decoder, picks.to(device), owner=owner) as tap:
        decoder(input_ids=continuation[:-1].to(device).unsqueeze(0), position_ids=positions,
                cache=build_cache(model, kv), use_cache=True)
    if len(tap.q) != kv.shape[0]:
        raise ValueError(f"the model has {len(tap.q)} attention layers; the cache has {kv.shape[0]}")
    q = Rotary(model.config).apply(torch.stack(tap.q), positions=T + picks)  # (L, Hq, m, D)
    stored = q.half() if q.numel() == 0 or float(q.abs().max()) < FLOAT16_MAX else q
    return ScoredQueries(stored, T + picks, tap.scaling, tap.sliding, tap.softcap)


def layer_sums(q: torch.Tensor, positions: torch.Tensor, kv: KVSequence, kv_hat: KVSequence, layer: int,
               scaling: float, sliding: int | None, softcap: float | None) -> torch.Tensor:
    """``(8, H)`` float64 for one layer, per KV head over its query heads' queries ``q`` ``(Hq, n, D)`` at
    ``positions`` and the prefix keys they see (module docstring): ``Σ (q·(k̂−k))²``, ``Σ (q·k)²``, ``Σ ‖ô−o‖²``,
    ``Σ ‖o‖²``, ``Σ (ℓ̂−ℓ)²`` and the entries it sums over, ``Σ KL(p ‖ p̂)`` (NaN where a seen key was evicted) and
    the queries it sums over."""
    Hq, n, D = q.shape
    k, v = kv.k[layer].float(), kv.v[layer].float()  # (H, T, D)
    k_hat, v_hat = kv_hat.k[layer].float(), kv_hat.v[layer].float()  # (H, T, D)
    H, T, _ = k.shape
    G = Hq // H
    hidden = None if kv_hat.kept is None else ~kv_hat.kept[layer].unsqueeze(1)  # (H, 1, T) evicted
    key_pos = torch.arange(T)  # (T,)
    grouped = q.float().reshape(H, G, n, D)  # query head j reads KV head j // G
    sums = torch.zeros(SUMS, H, dtype=torch.float64)
    step = max(1, BLOCK_ENTRIES // max(Hq * T, 1))
    for c in range(0, n, step):
        qc = grouped[:, :, c : c + step].reshape(H, -1, D)  # (H, G*m, D)
        pos = positions[c : c + step].repeat(G)  # (G*m,) the block's positions, once per query head of the group
        dot = qc @ k.transpose(1, 2)  # (H, G*m, T)
        dot_hat = qc @ k_hat.transpose(1, 2)  # (H, G*m, T)
        err, energy = (dot_hat - dot).square(), dot.square()  # (H, G*m, T)
        seen = visible(pos, key_pos, sliding)  # (G*m, T)
        measured = seen if hidden is None else seen & ~hidden  # (H, G*m, T) seen and kept
        if not bool(measured.all()):
            err, energy = err.masked_fill(~measured, 0.0), energy.masked_fill(~measured, 0.0)
        sums[0] += err.sum((1, 2)).double()
        sums[1] += energy.sum((1, 2)).double()
        exact = masked_logits(dot, pos, key_pos, scaling, sliding, softcap)  # (H, G*m, T)
        approx = masked_logits(dot_hat, pos, key_pos, scaling, sliding, softcap)  # (H, G*m, T)
        if hidden is not None:
            approx = approx.masked_fill(hidden, -math.inf)
        shift = torch.where(measured, approx - exact, 0.0)  # (H, G*m, T) finite where measured
        sums[4] += shift.square().sum((1, 2)).double()
        sums[5] += measured.expand(H, -1, -1).sum((1, 2)).double()
        p, p_hat = torch.softmax(exact, -1), torch.softmax(approx, -1)  # (H, G*m, T)
        if sliding or hidden is not None:
            # a query that sees no prefix key (past a sliding window, or all of it evicted) reads nothing from it
            p, p_hat = p.nan_to_num_(0.0), p_hat.nan_to_num_(0.0)
        o, o_hat = p @ v, p_hat @ v_hat  # (H, G*m, D)
        sums[2] += (o_hat - o).square().sum((1, 2)).double()
        sums[3] += o.square().sum((1, 2)).double()
        sees = seen.any(-1)  # (G*m,) queries that see some prefix key
        if hidden is not None and bool((hidden & seen).any()):
            sums[6] = math.nan  # p-hat is zero where p is not: the divergence is infinite
        else:
            gap = torch.log_softmax(exact, -1) - torch.log_softmax(approx, -1)  # (H, G*m, T)
            sums[6] += torch.where(p > 0, p * gap, 0.0).sum((1, 2)).double()
        sums[7] += float(sees.sum())
    return sums


#: the sums :func:`layer_sums` keeps per (layer, KV head)
SUMS = 8


@dataclass
class AttentionError:
    """Sums per (layer, KV head) pooled over the run's windows, so that the per-layer ratios are exact."""

    sums: torch.Tensor | None = None  # (SUMS, L, H) float64: the sums of layer_sums
    queries: int = 0  # query positions per window (the most any window had)

    def add(self, qs: ScoredQueries, kv: KVSequence, kv_hat: KVSequence) -> None:
        """One window: ``kv`` its exact prefix cache, ``kv_hat`` the decoded one, both ``(L, H, T, D)``."""
        L = kv.shape[0]
        if qs.q.shape[0] != L or kv_hat.shape != kv.shape:
            raise ValueError(f"queries of {qs.q.shape[0]} layers for caches {tuple(kv.shape)} / {tuple(kv_hat.shape)}")
        sums = torch.stack([layer_sums(qs.q[layer], qs.positions, kv, kv_hat, layer, qs.scaling[layer],
                                       qs.sliding[layer], qs.softcap[layer]) for layer in range(L)], dim=1)
        # (SUMS, L, H)
        self.sums = sums if self.sums is None else self.sums + sums
        self.queries = max(self.queries, int(qs.q.shape[2]))

    def per_layer(self) -> tuple[torch.Tensor, ...] | None:
        """Per layer, each ``(L,)``: the figures of :data:`FIGURES` in order, NaN for a layer where no query saw a
        prefix key; None where nothing was added."""
        if self.sums is None:
            return None
        s = self.sums.sum(2)  # (SUMS, L) pooled over KV heads

        def ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
            return torch.where(den > 0, num / den.clamp_min(1e-300), torch.full_like(num, math.nan))

        return ratio(s[0], s[1]), ratio(s[2], s[3]).sqrt(), ratio(s[4], s[5]), ratio(s[6], s[7])

    def summary(self) -> dict:
        """The run's figures: the mean over layers of the per-layer ones, and the query positions per window. A layer
        without a figure is left out of its mean (the KL of a layer with an evicted key included: it is NaN, so a run
        that evicts keys has no KL)."""
        got = self.per_layer()
        if got is None:
            return {**dict.fromkeys(FIGURES, math.nan), "attn_queries": 0}

        def mean(x: torch.Tensor) -> float:
            x = x[~x.isnan()]
            return float(x.mean()) if x.numel() else math.nan

        figures = dict(zip(FIGURES, map(mean, got)))
        if bool((got[3].isnan() & ~got[1].isnan()).any()):
            figures["attn_kl"] = math.nan  # some layer evicted a seen key: no finite divergence for the run
        return {**figures, "attn_queries": self.queries}

    def annotate(self, rows: list[dict]) -> list[dict]:
        """``rows`` (one per layer and kind) with their layer's figures as columns, NaN where not measured."""
        got = self.per_layer()
        out = []
        for row in rows:
            values = [math.nan] * len(FIGURES) if got is None else [float(x[row["layer"]]) for x in got]
            out.append({**row, **dict(zip(FIGURES, values))})
        return out


#: the run's attention figures, in the order :meth:`AttentionError.per_layer` gives them
FIGURES = ("attn_logit_rel_mse", "attn_output_rel_err", "attn_logit_mse", "attn_kl")
