"""The data a compressor sees: one sequence's KV cache and the context that is free to the decoder."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

SIXTEEN_BIT = (torch.float16, torch.bfloat16)


@dataclass
class KVSequence:
    """One sequence's KV cache, all layers stacked.

    ``k`` and ``v`` are ``(L, H, T, D)``: layers, KV heads, tokens, head_dim, in the cache dtype (16-bit).
    ``tokens`` are the ``T`` token ids the cache was computed from. The encoder may read them; a decoder only has
    them if it decodes them from its own bitstream (and then they are charged).
    """

    k: torch.Tensor  # (L, H, T, D)
    v: torch.Tensor  # (L, H, T, D)
    tokens: torch.Tensor | None = None  # (T,) int64
    k_pre_rope: torch.Tensor | None = None  # (L, H, T, D), only when captured with capture.pre_rope=true
    #: which entries a decoder kept, per (layer, KV head, token), ``(L, H, T)`` bool; None: all of them. Token
    #: eviction drops entries per head; the harness hides dropped ones from attention (positions stay the original
    #: ones) and measures distortion on the kept ones.
    kept: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape:
            raise ValueError(f"K and V shapes differ: {tuple(self.k.shape)} vs {tuple(self.v.shape)}")
        if self.k.dim() != 4:
            raise ValueError(f"KV must be (layers, heads, tokens, head_dim); got shape {tuple(self.k.shape)}")
        if self.tokens is not None and self.tokens.numel() != self.k.shape[2]:
            raise ValueError(f"{self.tokens.numel()} token ids for {self.k.shape[2]} cached tokens")
        if self.kept is not None and (self.kept.dtype != torch.bool or tuple(self.kept.shape) != tuple(self.k.shape[:3])):
            raise ValueError(f"kept must be a bool mask of shape {tuple(self.k.shape[:3])}; got {self.kept.dtype} "
                             f"{tuple(self.kept.shape)}")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.k.shape)  # type: ignore[return-value]

    @property
    def n_tokens(self) -> int:
        return self.k.shape[2]

    @property
    def n_elements(self) -> int:
        """Components in K and V together."""
        return 2 * self.k.numel()

    def slice_tokens(self, start: int, stop: int) -> KVSequence:
        return KVSequence(
            self.k[:, :, start:stop],
            self.v[:, :, start:stop],
            None if self.tokens is None else self.tokens[start:stop],
            None if self.k_pre_rope is None else self.k_pre_rope[:, :, start:stop],
            None if self.kept is None else self.kept[:, :, start:stop],
        )


def first_kv_mismatch(a: KVSequence, b: KVSequence, n: int) -> int:
    """The first of the leading ``n`` tokens where ``a`` and ``b`` differ in any layer, head or channel (``n``
    when they agree on all of them)."""
    diff = (a.k[:, :, :n] != b.k[:, :, :n]) | (a.v[:, :, :n] != b.v[:, :, :n])  # (L, H, n, D)
    bad = diff.any(dim=3).any(dim=1).any(dim=0)  # (n,)
    idx = torch.nonzero(bad)
    return int(idx[0]) if idx.numel() else n


@dataclass
class Context:
    """What the decoder is given for free: shapes, dtype, positions and the model.

    Everything else a decoder reads must come out of the bitstream, where the harness counts it.
    ``model`` is a lazy handle (``kvbench.inputs.models.ModelHandle``) for compressors that recompute KV from tokens;
    the weights are free because every party that holds a KV cache already holds the model that made it. For the
    same reason ``config`` (the model's transformers config: RoPE, layer types) is free; the harness fills it for
    compressors that declare ``needs_config``. ``start`` is the position of the first token (a segment of a longer
    sequence starts later). ``extras`` is encoder-side information only (e.g. token log-probs for a PLT), never
    handed to a decoder.
    """

    n_layers: int
    n_heads: int
    n_tokens: int
    head_dim: int
    dtype: torch.dtype
    model: Any = None
    extras: dict[str, Any] = field(default_factory=dict)
    config: Any = None
    start: int = 0

    @classmethod
    def for_kv(cls, kv: KVSequence, model: Any = None, config: Any = None, start: int = 0) -> Context:
        L, H, T, D = kv.shape
        return cls(L, H, T, D, kv.k.dtype, model, config=config, start=start)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.n_layers, self.n_heads, self.n_tokens, self.head_dim)
