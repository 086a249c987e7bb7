"""The queries a model forms, read off its attention modules during a forward pass, and the logits they give.

Keys alone do not give queries and the attention modules do not return them, so :func:`tap_queries` puts a forward
pre-hook on every attention module that applies the module's own query projection (and ``q_norm`` where the model
has one; :mod:`kvbench.inputs.attention_modules` reads each architecture's) to the hidden states it receives: the
queries are the model's, from its own weights, in whatever pass the caller runs (the prefix alone, or a continuation
on top of a cache). RoPE is left to the caller, who knows the positions (:class:`kvbench.core.rope.Rotary`). Two
users: the eviction scorers' query capture (``compressors.eviction.query_attention``) and the harness's
attention-error metric (:mod:`kvbench.measure.metrics.attention_error`); :func:`masked_logits` is the one place both
turn queries and keys into the logits the model would form.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.inputs.attention_modules import attention_modules, project, sliding_window, softcap


def model_module(ref: Any, owner: str) -> torch.nn.Module:
    """The model in ``ref`` (a module, or a handle holding one); ``owner`` names who needs it in the error."""
    if ref is None:
        raise ValueError(f"{owner} scores with the model's queries: the encoder needs the model in the context "
                         "(needs_model=True; the harness passes it)")
    return ref if isinstance(ref, torch.nn.Module) else ref.model


def decoder_stack(ref: Any, owner: str) -> torch.nn.Module:
    """The decoder stack (its ``layers``, no LM head) of the model in ``ref``: a module, or a handle holding one."""
    model = model_module(ref, owner)
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


@dataclass
class Tap:
    """What the hooks read off the attention modules, one entry per layer in call order."""

    q: list[torch.Tensor] = field(default_factory=list)  # per layer (Hq, n, D) float32 before RoPE, on the CPU
    k: list[torch.Tensor] = field(default_factory=list)  # per layer (H, T, D) float32 before RoPE, where asked
    scaling: list[float] = field(default_factory=list)  # the logit scale (head_dim**-0.5, Gemma's query_pre_attn_scalar)
    sliding: list[int | None] = field(default_factory=list)  # the sliding window, None for full attention
    softcap: list[float | None] = field(default_factory=list)  # logit soft-capping, None where the model has none


@contextmanager
def tap_queries(decoder: torch.nn.Module, pick: slice | torch.Tensor, keys: bool = False,
                owner: str = "the harness") -> Iterator[Tap]:
    """Within the block, every forward pass of ``decoder`` appends to the yielded :class:`Tap` each layer's queries
    of the input positions ``pick`` (a slice, or ``(n,)`` indices on the model's device) and, with ``keys``, the
    keys of every input position (to check the pass against a cache). A model whose attention modules cannot be read
    is refused before any pass (:func:`kvbench.inputs.attention_modules.attention_modules`, naming ``owner``)."""
    tap = Tap()

    def hook(attn: Any, args: tuple, kwargs: dict) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # (1, T, hidden)
        tap.q.append(project(attn, "q", hidden[:, pick])[0].float().cpu())  # (Hq, n, D)
        if keys:
            tap.k.append(project(attn, "k", hidden)[0].float().cpu())  # (H, T, D)
        tap.scaling.append(float(attn.scaling))
        tap.sliding.append(sliding_window(attn))
        tap.softcap.append(softcap(attn))

    hooks = [attn.register_forward_pre_hook(hook, with_kwargs=True) for attn in attention_modules(decoder, owner)]
    try:
        yield tap
    finally:
        for h in hooks:
            h.remove()


def visible(q_pos: torch.Tensor, key_pos: torch.Tensor, sliding: int | None) -> torch.Tensor:
    """``(n, S)`` bool: which keys at ``key_pos`` ``(S,)`` the queries at ``q_pos`` ``(n,)`` see in the model: the
    query at ``i`` sees the key at ``j`` where ``j <= i`` and, on a sliding-window layer, ``i - j < window``."""
    i, j = q_pos.unsqueeze(1), key_pos.unsqueeze(0)  # (n, 1), (1, S)
    seen = j <= i  # (n, S)
    if sliding:
        seen &= i - j < sliding
    return seen


def masked_logits(dots: torch.Tensor, q_pos: torch.Tensor, key_pos: torch.Tensor, scaling: float,
                  sliding: int | None, softcap: float | None) -> torch.Tensor:
    """``(B, n, S)``: the logits the model forms from the dot products ``dots`` ``(B, n, S)`` of queries at
    ``q_pos`` ``(n,)`` and keys at ``key_pos`` ``(S,)``: scaled, soft-capped as in the model, ``-inf`` where the
    query does not see the key (:func:`visible`)."""
    logits = dots * scaling  # (B, n, S)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    seen = visible(q_pos, key_pos, sliding)  # (n, S)
    return logits if bool(seen.all()) else logits.masked_fill(~seen, -math.inf)
