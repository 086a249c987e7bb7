"""One layer of a :class:`~kvbench.cache.compressed.CompressedCache`: the full-precision window of recent tokens,
and the one copy that joins the compressed prefix, the window and the new tokens for attention."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin


class CompressedLayer(CacheLayerMixin):
    """One layer's full-precision window; the compressed prefix is owned by the cache (segments span layers)."""

    is_sliding = False  # every layer keeps all its tokens; the attention mask applies sliding windows
    is_compileable = False
    is_croppable = False

    def __init__(self) -> None:
        super().__init__()
        self.window_k: torch.Tensor | None = None  # (1, H, W, D) in the storage dtype
        self.window_v: torch.Tensor | None = None  # (1, H, W, D)
        self.prefix_len = 0  # tokens held in segments (set by the cache)
        self.compute_dtype: torch.dtype | None = None

    # ``keys``/``values`` read back the whole layer (decoding the segments); the mixin assigns None to them.
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self.window_k is None else self._full(0)

    @keys.setter
    def keys(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("CompressedLayer.keys is read-only; write through Cache.update")

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self.window_v is None else self._full(1)

    @values.setter
    def values(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("CompressedLayer.values is read-only; write through Cache.update")

    def _full(self, which: int) -> torch.Tensor:
        parts = self._owner()._layer_parts(self._index)[which] if self.prefix_len else []
        return assemble([*parts, (self.window_k, self.window_v)[which]], self.compute_dtype)

    def bind(self, owner: Any, index: int) -> None:
        """``owner``: the :class:`~kvbench.cache.compressed.CompressedCache` holding the segments."""
        self._owner, self._index = weakref.ref(owner), index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, store: torch.dtype | None = None) -> None:
        self.device, self.compute_dtype = key_states.device, key_states.dtype
        B, H, _, D = key_states.shape
        store = store or key_states.dtype
        self.window_k = key_states.new_zeros((B, H, 0, D), dtype=store)
        self.window_v = value_states.new_zeros((B, H, 0, value_states.shape[-1]), dtype=store)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, prefix=None, **kwargs):
        """Append the new tokens to the window; return prefix + window + new tokens for attention.

        ``prefix``: the segments' ``([k (1, H, Ts, D), ...], [v ...])`` of this layer, concatenated here in the one
        copy attention needs anyway. The new tokens are returned as the model computed them; only what is *stored*
        is rounded to the cache dtype, so a forward pass sees exactly what a plain cache of that dtype would give it.
        """
        pk, pv = prefix if prefix is not None else ([], [])
        dt = key_states.dtype
        ks = assemble([*pk, self.window_k, key_states], dt)
        vs = assemble([*pv, self.window_v, value_states], dt)
        self.window_k = torch.cat([self.window_k, key_states.to(self.window_k.dtype)], dim=-2)
        self.window_v = torch.cat([self.window_v, value_states.to(self.window_v.dtype)], dim=-2)
        return ks, vs

    def window_len(self) -> int:
        return 0 if self.window_k is None else self.window_k.shape[-2]

    def get_seq_length(self) -> int:
        return self.prefix_len + self.window_len()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.window_k = self.window_v = None
        self.prefix_len = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0 or -tokens_to_remove > self.window_len():
            raise ValueError(f"CompressedCache can only crop tokens still in its window ({self.window_len()}); "
                             f"asked to remove {-tokens_to_remove}")
        if tokens_to_remove:
            self.window_k = self.window_k[..., :tokens_to_remove, :]
            self.window_v = self.window_v[..., :tokens_to_remove, :]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError("CompressedCache holds one sequence (batch size 1); beam search is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise ValueError("CompressedCache holds one sequence (batch size 1); num_return_sequences must be 1")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if indices.numel() != 1:
            raise ValueError("CompressedCache holds one sequence (batch size 1)")


def assemble(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``parts`` (``(1, H, T_i, D)`` each, any float dtype) concatenated along the tokens into one ``dtype`` tensor:
    each part is converted while it is copied in, so a 16-bit prefix read by a float32 model costs one pass over
    it (a conversion and then a concatenation would cost two)."""
    first = parts[0]
    out = torch.empty((*first.shape[:-2], sum(p.shape[-2] for p in parts), first.shape[-1]), dtype=dtype,
                      device=parts[-1].device)
    at = 0
    for p in parts:
        out[..., at : at + p.shape[-2], :].copy_(p)
        at += p.shape[-2]
    return out
