"""Rotary position embedding (Su et al., "RoFormer", arXiv 2104.09864) undone and redone on cached keys.

The cache holds keys after RoPE. Coders that model keys across tokens or channels (KVQuant's pre-RoPE per-channel
keys, arXiv 2401.18079; KVTC's PCA with RoPE undone, arXiv 2511.01815) work on the keys before it and put it back
after decoding. Positions and the model config are free to the decoder, so nothing about RoPE costs bits.

The angles come from the model's own rotary-embedding class, built from the config alone (no weights): whatever
scaling the config asks for (Llama 3's frequency bands, Gemma 3's per-layer-type bases and linear scaling) is
applied exactly as in the model's forward pass. Partial rotary embeddings (``cos`` narrower than ``head_dim``)
rotate the leading channels and pass the rest through.
"""

from __future__ import annotations

import importlib
import inspect
from functools import cached_property
from typing import Any

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _text_config(config: Any) -> Any:
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _rotary_class(config: Any) -> type:
    """The ``*RotaryEmbedding`` class of the config's model family."""
    model_type = config.model_type
    families = [model_type, model_type.removesuffix("_text")]
    for family in families:
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        found = [c for name, c in inspect.getmembers(module, inspect.isclass)
                 if name.endswith("RotaryEmbedding") and c.__module__ == module.__name__]
        if found:
            return found[0]
    raise ValueError(f"no rotary embedding found for model type {model_type!r}; RoPE undo needs a transformers "
                     "model family with a *RotaryEmbedding class (Llama, Gemma 3, ...)")


class Rotary:
    """RoPE of one model: ``apply`` (pre-RoPE -> cached keys) and ``undo`` (cached keys -> pre-RoPE), on
    ``(L, H, T, D)`` keys at positions ``start .. start + T - 1`` (or at ``positions``, ``(T,)``: queries picked
    from a longer span), computed in float32."""

    def __init__(self, config: Any) -> None:
        self.config = _text_config(config)
        self.layer_types = list(getattr(self.config, "layer_types", None) or [])
        n_layers = self.config.num_hidden_layers
        if self.layer_types and len(self.layer_types) != n_layers:
            raise ValueError(f"config has {len(self.layer_types)} layer types for {n_layers} layers")

    @cached_property
    def _module(self) -> Any:
        return _rotary_class(self.config)(self.config)

    @cached_property
    def _per_type(self) -> bool:
        return "layer_type" in inspect.signature(self._module.forward).parameters

    def angles(self, n_tokens: int, start: int = 0,
               positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin``, ``(L, 1, T, R)`` float32 (``R`` rotary channels, scaling included)."""
        pos = (torch.arange(start, start + n_tokens) if positions is None else positions.long().cpu()).unsqueeze(0)  # (1, T)
        probe = torch.zeros(1, dtype=torch.float32)
        n_layers = self.config.num_hidden_layers
        if not self._per_type:
            cos, sin = self._module(probe, pos)  # (1, T, R)
            return cos.expand(n_layers, -1, -1).unsqueeze(1), sin.expand(n_layers, -1, -1).unsqueeze(1)
        per_type = {t: self._module(probe, pos, t) for t in sorted(set(self.layer_types))}
        cos = torch.cat([per_type[t][0] for t in self.layer_types])  # (L, T, R)
        sin = torch.cat([per_type[t][1] for t in self.layer_types])  # (L, T, R)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def _rotate(self, k: torch.Tensor, start: int, inverse: bool, positions: torch.Tensor | None = None) -> torch.Tensor:
        L, _, T, D = k.shape
        if L != self.config.num_hidden_layers:
            raise ValueError(f"keys have {L} layers; the model config has {self.config.num_hidden_layers}")
        if positions is not None and positions.numel() != T:
            raise ValueError(f"{positions.numel()} positions for {T} tokens")
        cos, sin = self.angles(T, start, positions)  # (L, 1, T, R)
        R = cos.shape[-1]
        x = k.float()
        rot, rest = x[..., :R], x[..., R:]
        if inverse:
            # the inverse rotation, divided by the squared attention scaling that cos and sin carry
            out = (rot * cos - _rotate_half(rot) * sin) / (cos * cos + sin * sin)
        else:
            out = rot * cos + _rotate_half(rot) * sin
        return torch.cat([out, rest], dim=-1) if R < D else out  # (L, H, T, D) float32

    def apply(self, k_pre: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self._rotate(k_pre, start, inverse=False, positions=positions)

    def undo(self, k: torch.Tensor, start: int = 0) -> torch.Tensor:
        return self._rotate(k, start, inverse=True)
