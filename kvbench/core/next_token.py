"""A language model's next-token distribution, one token per step on a growing KV cache, and the torch thread count
its arithmetic runs on: what a coder that codes token ids under the model needs on both of its sides (the decoder
only knows the ids it has decoded, so it cannot take its rows from a batched prefill, which rounds differently)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch


@contextmanager
def torch_threads(n: int | None) -> Iterator[int]:
    """Run the block on ``n`` torch intra-op threads (None: as the process is set), then restore the setting.
    Yields the number in use."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


class NextTokenModel:
    """p(. | tokens so far), one token per step on a growing KV cache: the only way a decoder can compute it.
    ``threads``: the intra-op threads the steps are meant to run on (how a reduction is split is part of the
    arithmetic); the caller runs them inside :func:`torch_threads` of it."""

    def __init__(self, model: Any, threads: int | None = None) -> None:
        from transformers import DynamicCache

        self.model = model
        self.threads = threads
        self.device = next(model.parameters()).device
        self.cache = DynamicCache(config=model.config)

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        """Feed one token on the cache; return the next token's logits, ``(V,)`` in the model's dtype: a plain
        cached decode step, what greedy generation pays per token."""
        ids = torch.tensor([[token]], dtype=torch.long, device=self.device)  # (1, 1)
        return self.model(ids, cache=self.cache, use_cache=True).logits[0, -1]  # (V,)

    def after(self, token: int) -> np.ndarray:
        """Feed one token; return the next token's distribution, ``(V,)`` float64, the same bits on every call
        with the same history, weights, kernels and threads."""
        return torch.softmax(self.step(token).double(), dim=-1).cpu().numpy()  # (V,)
