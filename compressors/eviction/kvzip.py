"""KVzip (Kim et al., arXiv 2505.23416): query-agnostic eviction by how much the model's reconstruction of its own
context attends to each cached entry, ranked over the whole cache at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from compressors.eviction.evict import Eviction, select
from compressors.eviction.pooled import select_pooled
from compressors.eviction.reconstruction import NO_PROMPT, reconstruction_flops, reconstruction_scores, repeat_prompt
from kvbench.core.checks import check_choice, check_range
from kvbench.core.kv import Context, KVSequence


@dataclass
class KVzip(Eviction):
    """KVzip (Kim, Kim, Kwon, Yun, Song, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
    arXiv 2505.23416), as kvpress 0.5.5's ``KVzipPress`` and the authors' code (snu-mllab/KVzip) score and select:
    the encoder feeds the context to the model again after a prompt asking it to repeat it, on top of the context's
    cache, in chunks of ``chunk_size`` tokens (:mod:`compressors.eviction.reconstruction`), and scores each entry by
    the maximum attention any query of the reconstruction pays it. An entry the model needs to reproduce its
    context is one a later question may need, whatever the question.

    Head-wise selection: the ``L * H * floor(keep * T)`` entries of highest score over every layer and KV head at
    once (``layerwise=True``: ``H * floor(keep * T)`` per layer, shared by its heads), so layers and heads keep
    different counts. The first ``sinks`` tokens are kept in every head. The encoder runs the model (one pass per
    chunk, about a prefill's cost, plus a 16-token check that the model made the cache): that is its encode time,
    and ``encode_flops_per_token`` counts it.

    Deviations from the references, also in the ``deviations`` fact:

    - the context is the harness's window of text, not a chat-template user turn: no system prompt precedes it to
      exempt, so the first ``sinks`` tokens are always kept instead (kvpress 0.5.5 keeps its ``n_sink`` too);
    - the repeat prompt is the reference's, as token ids of the context's tokenizer, and the suffix its chat
      template's opening of the assistant turn (``\\n`` without a template, as kvpress); without a tokenizer in the
      context (a bare model) the prompt and suffix are left out: the chunk alone is fed again (a later chunk after
      the previous chunk's last 8 tokens), and the stat ``repeat_prompt_missing`` counts such sequences;
    - the reconstruction runs on the stored 16-bit cache (cast to the model's dtype) rather than the prefill's own;
      scores are computed in float32 (the references: in the model's dtype);
    - each layer's own logit scale, sliding window and soft-capping apply as in the model (kvpress divides by
      ``sqrt(head_dim)`` and refuses Gemma 3, whose local layers the window hides from the reconstruction);
    - the budget is ``L * H * floor(keep * T)`` entries where kvpress keeps ``numel - int(numel *
      compression_ratio)`` (equal wherever ``keep * T`` is whole); ties go to the lower (layer, head, token) index;
    - KVzip+'s normalisation (kvpress's ``kvzip_plus_normalization``, off by default there) is not implemented.
    """

    sinks: int = 4
    chunk_size: int = 2048
    layerwise: bool = False

    name = "kvzip"
    needs_model = True
    equal_counts = False
    max_rel_mse = 0.0  # kept entries at 16 bits (dropped ones are not distortion)
    deviations = (
        "context is a text window, not a chat-template turn: no system prompt is exempt; the first sinks tokens "
        "are kept instead (as kvpress 0.5.5's n_sink)",
        "repeat prompt as the context tokenizer's ids, suffix from its chat template ('\\n' without one); without a "
        "tokenizer the prompt and suffix are left out (stat repeat_prompt_missing)",
        "reconstruction on the stored 16-bit cache cast to the model's dtype; scores in float32",
        "each layer's own scale, sliding window and soft-capping apply (kvpress: 1/sqrt(head_dim), no Gemma 3)",
        "budget L*H*floor(keep*T) (kvpress: numel - int(numel * compression_ratio)); ties to the lower "
        "(layer, head, token) index",
        "KVzip+ normalisation not implemented",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range(self.name, "chunk_size", self.chunk_size, 1, 1 << 30, integer=True)
        check_choice(self.name, "layerwise", self.layerwise, (True, False))
        self.budget_pool = "layer" if self.layerwise else "cache"
        self._prompt = NO_PROMPT  # the last sequence's: what encode_flops_per_token counts

    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        if kv.tokens is None:
            raise ValueError(f"{self.name} feeds the context's token ids to the model again, but this sequence has none")
        self._prompt = repeat_prompt(getattr(ctx.model, "tokenizer", None))
        self._add("repeat_prompt_missing", float(not self._prompt.from_tokenizer))
        return reconstruction_scores(self.name, kv, ctx, self._prompt, self.chunk_size, self.sinks)  # (L, H, T)

    def choose(self, scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        sinks = min(self.sinks, scores.shape[-1], int(budgets.min()))
        forced = select(scores, sinks, sinks)  # (L, H, T) the sinks of every head
        totals = budgets.sum(1) if self.layerwise else budgets.sum()
        return select_pooled(scores, forced, totals, self.budget_pool)

    def encode_flops_per_token(self, config: Any, n_tokens: int) -> float:
        return reconstruction_flops(config, n_tokens, self.chunk_size, self._prompt, self.sinks)

    def facts(self, n_tokens: int) -> dict[str, Any]:
        return {**super().facts(n_tokens), "deviations": list(self.deviations)}
