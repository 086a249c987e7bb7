"""What the harness reads off a causal LM's attention modules, in one place for every architecture it supports.

Queries and keys before RoPE, the logit scale, the sliding window and soft-capping are read from each decoder layer's
``self_attn`` as the model's own forward computes them (transformers 5.x modelling code):

- projections: separate ``q_proj`` and ``k_proj`` (Llama, Mistral, Qwen 2 and 3, Gemma 3; biases included where the
  model has them, as Qwen 2's) or one fused ``qkv_proj`` whose output holds the queries, then the keys, then the
  values (Phi-3: ``num_attention_heads * head_dim`` columns of queries, ``num_key_value_heads * head_dim`` of keys);
- QK-norm: ``q_norm`` / ``k_norm`` over each head (Qwen 3, Gemma 3) or over all heads at once (OLMo 2), as the
  norm's weight size says, before RoPE;
- the sliding window: the module's own ``sliding_window`` where it has the attribute (per layer: Gemma 3's local
  layers, Qwen 2's), else its config's, which Mistral and Phi-3 apply to every layer;
- the logit scale ``scaling`` (``head_dim**-0.5``, Gemma's ``query_pre_attn_scalar**-0.5``) and soft-capping
  ``attn_logit_softcapping`` (Gemma 2).

A model whose layers lack what this reads (GPT-NeoX's per-head interleaved ``query_key_value``, GPT-2's ``c_attn``)
is refused by :func:`attention_modules` with an error naming its model type and what it lacks.
"""

from __future__ import annotations

from typing import Any

import torch


class UnsupportedArchitecture(ValueError):
    """The model's attention modules do not expose what the harness reads off them."""


def _model_type(decoder: Any) -> str:
    config = getattr(decoder, "config", None)
    return str(getattr(config, "model_type", None) or type(decoder).__name__)


def _lacks(attn: Any) -> list[str]:
    """The attributes read off an attention module that ``attn`` lacks."""
    missing = [name for name in ("head_dim", "scaling") if not hasattr(attn, name)]
    if not hasattr(attn, "qkv_proj"):
        missing += [name for name in ("q_proj", "k_proj") if not hasattr(attn, name)]
    elif not all(hasattr(getattr(attn, "config", None), n) for n in ("num_attention_heads", "num_key_value_heads")):
        missing.append("a config with num_attention_heads and num_key_value_heads (to split its fused qkv_proj)")
    return missing


def attention_modules(decoder: Any, owner: str = "the harness") -> list[torch.nn.Module]:
    """Every decoder layer's attention module of the decoder stack ``decoder``, in layer order, each checked to
    expose the projections, head size and logit scale the harness reads; else :class:`UnsupportedArchitecture`
    naming the model type, the module and what it lacks. ``owner`` names who reads them in the error."""
    model_type = _model_type(decoder)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise UnsupportedArchitecture(f"{owner} reads the model's attention modules, but {model_type}'s decoder "
                                      f"({type(decoder).__name__}) has no `layers`")
    out = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            raise UnsupportedArchitecture(
                f"{owner} reads queries and keys off each decoder layer's `self_attn`; {model_type}'s layer {i} "
                f"({type(layer).__name__}) has none, so {model_type} is not supported (supported: attention modules "
                "with q_proj and k_proj, as Llama, Mistral, Qwen 2/3 and Gemma 3 have, or a fused qkv_proj, as Phi-3)")
        if missing := _lacks(attn):
            raise UnsupportedArchitecture(
                f"{owner} reads queries and keys off each layer's attention module; {model_type}'s "
                f"{type(attn).__name__} (layer {i}) lacks {', '.join(missing)}, so {model_type} is not supported "
                "(supported: q_proj and k_proj, or a fused qkv_proj, with head_dim and scaling)")
        out.append(attn)
    return out


def projection(attn: Any, which: str) -> tuple[torch.nn.Module, slice | None]:
    """The module whose output holds the queries (``which="q"``) or keys (``"k"``) before norm and RoPE, and the
    columns of its output that hold them: ``q_proj`` / ``k_proj`` and None (all of them), or the fused ``qkv_proj``
    and its query or key columns."""
    own = getattr(attn, f"{which}_proj", None)
    if own is not None:
        return own, None
    D, config = attn.head_dim, attn.config
    n_q, n_k = config.num_attention_heads * D, config.num_key_value_heads * D
    return attn.qkv_proj, slice(0, n_q) if which == "q" else slice(n_q, n_q + n_k)


def heads(attn: Any, which: str, out: torch.Tensor, columns: slice | None = None) -> torch.Tensor:
    """``(B, H, n, D)``: the queries or keys in the output ``out`` ``(B, n, *)`` of :func:`projection`'s module
    (``columns`` of it), split into heads, the layer's ``q_norm`` / ``k_norm`` applied where it has one: over each
    head, or over all of them at once where the norm's weight spans them (OLMo 2)."""
    D = attn.head_dim
    x = out if columns is None else out[..., columns]  # (B, n, H * D)
    norm = getattr(attn, f"{which}_norm", None)
    weight = getattr(norm, "weight", None)
    if norm is not None and weight is not None and weight.shape[-1] != D:
        x, norm = norm(x), None  # one norm over every head's channels, before the split
    x = x.view(*x.shape[:-1], -1, D)  # (B, n, H, D)
    if norm is not None:
        x = norm(x)
    return x.transpose(1, 2)  # (B, H, n, D)


def project(attn: Any, which: str, hidden: torch.Tensor) -> torch.Tensor:
    """``(B, H, n, D)``: the layer's queries or keys of its input ``hidden`` ``(B, n, hidden)``, before RoPE, as the
    model's forward computes them."""
    module, columns = projection(attn, which)
    return heads(attn, which, module(hidden), columns)


def sliding_window(attn: Any) -> int | None:
    """The layer's sliding window, None for full attention: the module's own ``sliding_window`` where it has the
    attribute (a per-layer choice), else its config's (Mistral and Phi-3 slide every layer)."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return getattr(getattr(attn, "config", None), "sliding_window", None)


def softcap(attn: Any) -> float | None:
    """The layer's logit soft-capping, None where the model has none."""
    return getattr(attn, "attn_logit_softcapping", None)
