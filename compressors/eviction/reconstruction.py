"""KVzip's context reconstruction (Kim et al., arXiv 2505.23416): the context fed to the model again after a repeat
prompt, on top of the context's own cache, and every cached entry scored by the most attention any query of that
reconstruction pays it.

As the reference does (snu-mllab/KVzip ``ModelKVzip.self_task``/``scoring`` and ``KVScore._get_score``; kvpress
0.5.5 ``KVzipPress.prepare``/``score_kvzip``): the context is cut into chunks of ``chunk_size`` tokens; chunk ``i``
is reconstructed in a pass of its own, ``REPEAT`` (``REPEAT_PART`` and the previous chunk's last ``OVERLAP`` tokens
for a later chunk), the chat template's opening of the assistant turn, then the chunk's tokens, at the positions
after the context. Each query of the pass is softmaxed over the first ``sinks`` tokens, the chunk's own keys and
the pass's keys (causally), not over the rest of the context; an entry of the chunk scores the maximum of that
attention over the pass's queries and the query heads of its KV head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from compressors.eviction.query_attention import QUERY_CHUNK, capture_queries, decoder_stack
from kvbench.core.flops import forward_flops_per_token, prefill_flops_per_token
from kvbench.core.kv import Context, KVSequence
from kvbench.inputs.attention_modules import attention_modules, project, sliding_window, softcap

#: the reference's repeat prompts, for the first chunk and for each later one
REPEAT = "\n\nRepeat the previous context exactly."
REPEAT_PART = "\n\nRepeat the part of the previous context exactly, starting with"
#: tokens of the previous chunk that follow a later chunk's prompt (the reference's ``prev_postfix_size``)
OVERLAP = 8
#: leading tokens whose keys the encoder recomputes to check that the model in the context made this cache
GUARD = 16


@dataclass(frozen=True)
class Prompt:
    """The token ids around each reconstructed chunk: ``first`` before the first chunk, ``later`` (then the previous
    chunk's last :data:`OVERLAP` tokens) before each later one, ``suffix`` between them and the chunk.
    ``from_tokenizer``: False where the context had no tokenizer and the prompt is left out."""

    first: tuple[int, ...]
    later: tuple[int, ...]
    suffix: tuple[int, ...]
    from_tokenizer: bool

    def ids(self, tokens: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """``(R,)``: the reconstruction input of the chunk ``tokens[start:end]``."""
        head = list(self.first) if start == 0 else list(self.later) + tokens[max(0, start - OVERLAP) : start].tolist()
        lead = torch.tensor(head + list(self.suffix), dtype=tokens.dtype)
        return torch.cat([lead, tokens[start:end]])

    def length(self, start: int, end: int) -> int:
        """Tokens of the reconstruction input of the chunk ``[start, end)``."""
        head = len(self.first) if start == 0 else len(self.later) + min(OVERLAP, start)
        return head + len(self.suffix) + end - start


NO_PROMPT = Prompt((), (), (), False)


def repeat_prompt(tokenizer: Any) -> Prompt:
    """The repeat prompts as ``tokenizer``'s ids, and the chat template's opening of the assistant turn as kvpress
    takes it (a user turn rendered around a dummy context, split after it); a newline where the tokenizer has no
    chat template. :data:`NO_PROMPT` without a tokenizer."""
    if tokenizer is None:
        return NO_PROMPT

    def ids(text: str) -> tuple[int, ...]:
        return tuple(int(i) for i in tokenizer(text, add_special_tokens=False).input_ids)

    suffix = "\n"
    if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "apply_chat_template"):
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                             add_generation_prompt=True, tokenize=False, enable_thinking=False)
        suffix = text.split(separator)[1]
    return Prompt(ids(REPEAT), ids(REPEAT_PART), ids(suffix), True)


def chunk_bounds(n_tokens: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of every chunk the context is reconstructed in."""
    return [(s, min(s + chunk_size, n_tokens)) for s in range(0, n_tokens, chunk_size)]


def _project(attn: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``(Hq, R, D)`` and keys ``(H, R, D)`` of the attention module's input ``hidden`` ``(1, R, hidden)``,
    before RoPE (after the model's q/k norms), float32."""
    return project(attn, "q", hidden)[0].float().cpu(), project(attn, "k", hidden)[0].float().cpu()


@dataclass
class _Pass:
    """What one reconstruction pass gives the scoring: per layer the pass's queries and keys (RoPE applied) and how
    the layer's attention is computed."""

    q: torch.Tensor  # (L, Hq, R, D)
    k: torch.Tensor  # (L, H, R, D)
    scaling: list[float]
    sliding: list[int | None]
    softcap: list[float | None]


def _reconstruct(model: Any, kv: KVSequence, ctx: Context, ids: torch.Tensor) -> _Pass:
    """Run the decoder stack on ``ids`` after the stored cache and capture every layer's queries and keys."""
    from transformers import DynamicCache

    from kvbench.core.rope import Rotary

    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    T, R = kv.n_tokens, ids.numel()
    cache = DynamicCache()  # full layers: a sliding layer's window is applied by the model's own mask
    for layer in range(kv.shape[0]):
        cache.update(kv.k[layer].unsqueeze(0).to(device, dtype), kv.v[layer].unsqueeze(0).to(device, dtype), layer)
    q, k, scaling, sliding, softcaps = [], [], [], [], []

    def hook(attn: Any, args: tuple, kwargs: dict) -> None:
        qi, ki = _project(attn, kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])
        q.append(qi)
        k.append(ki)
        scaling.append(float(attn.scaling))
        sliding.append(sliding_window(attn))
        softcaps.append(softcap(attn))

    decoder = decoder_stack(model, "kvzip")
    hooks = [attn.register_forward_pre_hook(hook, with_kwargs=True) for attn in attention_modules(decoder, "kvzip")]
    try:
        positions = torch.arange(ctx.start + T, ctx.start + T + R, device=device).unsqueeze(0)  # (1, R)
        decoder(input_ids=ids.to(device).unsqueeze(0), position_ids=positions, cache=cache, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    rope = Rotary(model.config)
    return _Pass(rope.apply(torch.stack(q), ctx.start + T), rope.apply(torch.stack(k), ctx.start + T), scaling,
                 sliding, softcaps)


def _chunk_scores(p: _Pass, layer: int, keys: torch.Tensor, start: int, end: int, sinks: int) -> torch.Tensor:
    """``(H, end - start)``: the most attention a query of the pass pays each entry of the chunk in ``layer``,
    softmaxed over the sinks, the chunk and the pass's own keys; ``keys`` ``(H, T, D)`` the stored ones."""
    H, T, _ = keys.shape
    q = p.q[layer]  # (Hq, R, D)
    Hq, R, _ = q.shape
    sink = min(sinks, start)
    sub = torch.cat([keys[:, :sink].float(), keys[:, start:end].float(), p.k[layer]], dim=1)  # (H, S, D)
    sub = sub.repeat_interleave(Hq // H, dim=0)  # (Hq, S, D)
    key_pos = torch.cat([torch.arange(sink), torch.arange(start, end), T + torch.arange(R)])  # (S,)
    best = torch.zeros(Hq, end - start)
    for c in range(0, R, QUERY_CHUNK):
        qb = q[:, c : c + QUERY_CHUNK]  # (Hq, b, D)
        q_pos = (T + torch.arange(c, c + qb.shape[1])).unsqueeze(1)  # (b, 1)
        logits = qb @ sub.transpose(1, 2) * p.scaling[layer]  # (Hq, b, S)
        if p.softcap[layer]:
            logits = torch.tanh(logits / p.softcap[layer]) * p.softcap[layer]
        visible = key_pos <= q_pos  # (b, S) causal within the pass; the context is all earlier
        if p.sliding[layer]:
            visible &= q_pos - key_pos < p.sliding[layer]
        probs = torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1)  # (Hq, b, S)
        best = torch.maximum(best, probs[..., sink : sink + end - start].amax(1))
    return best.reshape(H, Hq // H, end - start).amax(1)  # (H, c) max over the KV head's query heads


@torch.no_grad()
def reconstruction_scores(owner: str, kv: KVSequence, ctx: Context, prompt: Prompt, chunk_size: int,
                          sinks: int) -> torch.Tensor:
    """``(L, H, T)``: KVzip's score of every cached entry (module docstring), from one reconstruction pass per
    chunk on top of the stored cache. The first :data:`GUARD` tokens are prefilled once to check that the model in
    the context made this cache, from the sequence's first token (:func:`capture_queries`'s check)."""
    n = min(GUARD, kv.n_tokens)
    head = kv.slice_tokens(0, n)
    capture_queries(owner, head, Context.for_kv(head, ctx.model, start=ctx.start), n - 1)
    model = ctx.model if isinstance(ctx.model, torch.nn.Module) else ctx.model.model
    L, H, T, _ = kv.shape
    scores = torch.zeros(L, H, T)
    for start, end in chunk_bounds(T, chunk_size):
        p = _reconstruct(model, kv, ctx, prompt.ids(kv.tokens, start, end))
        for layer in range(L):
            scores[layer, :, start:end] = _chunk_scores(p, layer, kv.k[layer], start, end, sinks)
    return scores


def reconstruction_flops(config: Any, n_tokens: int, chunk_size: int, prompt: Prompt, sinks: int) -> float:
    """Model FLOPs of :func:`reconstruction_scores` per context token: the guard's prefill, every pass's decoder
    stack (each token after the context and, on average, half its pass) and the scoring logits (``QKᵀ`` over the
    sinks, the chunk and the pass: half the attention term of that many keys)."""
    n = min(GUARD, n_tokens)
    total = n * prefill_flops_per_token(config, n, head=False)
    no_context = forward_flops_per_token(config, 0, head=False)
    for start, end in chunk_bounds(n_tokens, chunk_size):
        R = prompt.length(start, end)
        keys = min(sinks, start) + end - start + R
        total += R * forward_flops_per_token(config, n_tokens + R // 2, head=False)
        total += R * (forward_flops_per_token(config, keys, head=False) - no_context) / 2
    return total / n_tokens
