"""The model's forward pass in bounded memory: the decoder stack fed a chunk of tokens at a time through the cache,
and each position's log-probability taken through the LM head a block of rows at a time.

A causal LM's own forward returns float32 logits for every position it is fed, ``(T, V)``: 0.8 GB for a 4,096-token
window on SmolLM2's 49,152-token vocabulary, 2.5 GB on Qwen2.5's 151,936, 34 GB for a 32k window on gemma-3's
262,144, and the log-softmax taken of them as much again. One log-probability per position is all that is kept, so
the decoder stack runs without its LM head and :func:`token_logprobs` applies the head to :data:`LOGIT_BYTES` worth
of rows at a time, computing logits from the last hidden states as transformers' ``LlamaForCausalLM`` and
``Gemma3ForCausalLM`` do: ``lm_head(h)``, then ``cap * tanh(logits / cap)`` where the text config sets
``final_logit_softcapping`` (Gemma 2 and 3).

A long input goes through the cache :data:`PREFILL_CHUNK` tokens at a time (:func:`scored_forward`). With sdpa on
CPU attention itself needs no ``(T, T)`` scores: the flash kernel runs for a causal prefill without a mask and for
a chunk on a cache with a boolean mask alike (torch 2.13: 7 MB beside the inputs for 512 queries on 16k keys, 45 MB
for a 16k-token causal prefill). What grows with the tokens fed at once is the rest: the MLP's
``(T, intermediate)`` activations, the boolean ``(T, T)`` mask built for sliding-window layers (1 GB at 32k) and
eager attention's ``(H, T, T)`` scores. An input no longer than a chunk is one forward pass, as the model's own
forward would run it.
"""

from __future__ import annotations

from typing import Any

import torch

#: tokens fed through the decoder stack at once when prefilling a window
PREFILL_CHUNK = 2048
#: tokens of a continuation fed at once on top of a prefix cache: a cache that hides evicted entries builds a
#: float ``(heads, chunk, cached tokens)`` mask per layer, 0.3 GB at this chunk for 9 heads over 32k tokens
SCORE_CHUNK = 256
#: bytes of float32 logits computed at once: ``LOGIT_BYTES // (4 * vocab)`` rows per block (341 on SmolLM2)
LOGIT_BYTES = 64 * 2**20


def decoder_of(model: Any) -> torch.nn.Module:
    """The decoder stack of a causal LM: embeddings, layers and final norm, no LM head."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def logits_of(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Float32 logits ``(R, V)`` of last hidden states ``(R, hidden)``, as the model's forward computes them."""
    logits = model.get_output_embeddings()(hidden)  # (R, V)
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    if cap is not None:
        logits = logits / cap
        logits = torch.tanh(logits)
        logits = logits * cap
    return logits.float()


def logit_rows(model: Any) -> int:
    """Rows of logits per block: :data:`LOGIT_BYTES` of float32 over the vocabulary."""
    return max(1, LOGIT_BYTES // (4 * int(model.get_output_embeddings().weight.shape[0])))


def token_logprobs(model: Any, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Natural-log probability ``(N,)`` float32 of ``targets`` ``(N,)`` under the logits of ``hidden``
    ``(N, hidden)``, :func:`logit_rows` rows at a time; no ``(N, V)`` tensor is made."""
    rows = logit_rows(model)
    out = torch.empty(targets.numel(), dtype=torch.float32, device=hidden.device)  # (N,)
    for a in range(0, targets.numel(), rows):
        logits = logits_of(model, hidden[a : a + rows])  # (R, V)
        out[a : a + rows] = -torch.nn.functional.cross_entropy(logits, targets[a : a + rows], reduction="none")
    return out


@torch.no_grad()
def scored_forward(model: Any, ids: torch.Tensor, cache: Any, targets: torch.Tensor,
                   chunk: int | None = None) -> torch.Tensor:
    """Feed ``ids`` ``(n,)`` through ``cache`` (filled in place) ``chunk`` tokens at a time (default
    :data:`PREFILL_CHUNK`) and return, for each ``i < len(targets)`` (``n`` or ``n - 1``), the log-probability
    ``(len(targets),)`` of ``targets[i]`` after ``ids[: i + 1]`` and whatever the cache held before."""
    chunk = int(chunk or PREFILL_CHUNK)
    device = next(model.parameters()).device
    decoder = decoder_of(model)
    ids, targets = ids.to(device), targets.to(device)
    out = []
    for a in range(0, ids.numel(), chunk):
        hidden = decoder(input_ids=ids[a : a + chunk].unsqueeze(0), cache=cache, use_cache=True).last_hidden_state[0]  # (c, hidden)
        scored = targets[a : a + chunk]
        if scored.numel():
            out.append(token_logprobs(model, hidden[: scored.numel()], scored))
    return torch.cat(out) if out else torch.empty(0, device=device)
