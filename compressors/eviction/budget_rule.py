"""A budget rule over any eviction method's scores (``scorer=NAME``): the method scores the cache, the rule decides
how many entries each layer and KV head keeps of it (PyramidKV by depth, AdaKV by the heads' own scores)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from compressors.eviction.evict import Eviction
from kvbench.core.kv import Context, KVSequence


@dataclass
class BudgetRule(Eviction):
    """The kept entries of ``scorer`` (an eviction method: a config name such as ``snapkv``, a ``{name: ...,
    FIELD: ...}`` node or an :class:`Eviction`) under this rule's budget: ``keep`` (or ``keep_tokens``) is the
    rule's and the scorer's own is replaced by it; the scorer's protected tokens (sinks, observation window) stay
    protected in every row. The kept KV is stored at 16 bits, or by an ``inner`` coder that fits nothing (rows keep
    different counts, so each is coded alone: :mod:`compressors.eviction.evict`); the scorer's ``inner`` must be
    null."""

    scorer: Any = "snapkv"

    needs_model = True  # the default scorer's; an instance says what its own scorer needs
    equal_counts = False
    max_rel_mse = 0.0  # kept entries at 16 bits (dropped ones are not distortion)
    #: where this rule departs from the reference it cites, filed with the run's facts
    deviations: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        from compressors.dedup.pipeline import resolve_compressor

        self.scorer = resolve_compressor(self.scorer, f"{self.name}.scorer")
        if not isinstance(self.scorer, Eviction) or isinstance(self.scorer, BudgetRule):
            raise ValueError(f"{self.name}.scorer={self.scorer.name!r} is not an eviction method that scores tokens; "
                             "give one such as snapkv, expected_attention, knorm or kvzip")
        if self.scorer.inner is not None:
            raise ValueError(f"{self.name}.scorer={self.scorer.name!r} has inner={self.scorer.inner.name!r}; "
                             f"{self.name} stores the kept KV itself (16-bit): give the scorer with inner=null")
        self.scorer.keep, self.scorer.keep_tokens = self.keep, self.keep_tokens  # the budget is the rule's
        # instance attributes: what the harness hands over depends on the scorer
        self.needs_model = bool(self.scorer.needs_model)
        self.needs_config = bool(self.scorer.needs_config)
        self.window_word = self.scorer.window_word

    def scores(self, kv: KVSequence, ctx: Context) -> torch.Tensor:
        return self.scorer.scores(kv, ctx)

    def protected(self, n_tokens: int, n_keep: int) -> tuple[int, int]:
        return self.scorer.protected(n_tokens, n_keep)

    def method(self) -> str:
        return f"{self.name} ({self.scorer.name})"

    def encode_flops_per_token(self, config: Any, n_tokens: int) -> float:
        return self.scorer.encode_flops_per_token(config, n_tokens)

    def facts(self, n_tokens: int) -> dict[str, Any]:
        return {**super().facts(n_tokens), "scorer": self.scorer.name, "deviations": list(self.deviations)}
