"""Multi-session workloads: many prompts with a known sharing structure, and the statistics of that sharing."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from kvbench.core.checks import check_range
from kvbench.core.radix import RadixTrie


@dataclass
class Session:
    """One request: its prompt's token ids, which family of traffic it belongs to, and which group inside it
    (the system prompt, task, document or conversation it shares)."""

    tokens: np.ndarray  # (T,) int64
    family: str
    group: str = ""


@dataclass
class Workload:
    """Sessions in arrival order. For block-hash traces ``id_tokens`` > 1: each id stands for that many tokens
    and ``prompt_tokens`` holds every prompt's real length."""

    name: str
    sessions: list[Session]
    meta: dict[str, Any] = field(default_factory=dict)
    id_tokens: int = 1
    prompt_tokens: list[int] | None = None

    def stats(self, block_size: int = 16) -> dict[str, Any]:
        return sharing_stats([s.tokens for s in self.sessions], block_size, [s.family for s in self.sessions],
                             self.id_tokens, self.prompt_tokens)


def sharing_stats(seqs: Sequence[np.ndarray], block_size: int = 16, families: Sequence[str] | None = None,
                  id_tokens: int = 1, prompt_tokens: Sequence[int] | None = None) -> dict[str, Any]:
    """How much of a request stream is a prefix already seen, at token and at block granularity.

    ``shared_prefix_tokens``: tokens of each session that are a prefix shared with some earlier session (token
    granularity) — what exact dedup of the KV can save; ``share_rate`` is their fraction. ``ideal_hit_rate``: the
    same at ``block_size`` granularity, as a paged prefix cache with unbounded memory would hit.
    ``dedup_ratio`` = tokens / unique tokens: the KV compression that exact token-level dedup gives.
    """
    fine, coarse = RadixTrie(1), RadixTrie(block_size)
    lengths = [len(s) * id_tokens for s in seqs] if prompt_tokens is None else [int(n) for n in prompt_tokens]
    fam = list(families) if families is not None else ["all"] * len(seqs)
    shared_by: dict[str, list[int]] = {}
    shared = hit = with_shared = 0
    for i, toks in enumerate(seqs):
        s = min(fine.insert(toks).tokens * id_tokens, lengths[i])
        h = min(coarse.insert(toks).tokens * id_tokens, lengths[i])
        shared += s
        hit += h
        with_shared += s > 0
        acc = shared_by.setdefault(fam[i], [0, 0, 0])
        acc[0] += 1
        acc[1] += lengths[i]
        acc[2] += s
    total = sum(lengths)
    unique = total - shared
    return {
        "sessions": len(seqs),
        "tokens": total,
        "mean_tokens": total / len(seqs) if seqs else 0.0,
        "shared_prefix_tokens": shared,
        "share_rate": shared / total if total else 0.0,
        "unique_tokens": unique,
        "dedup_ratio": total / unique if unique else float("inf"),
        "sessions_with_shared_prefix": with_shared,
        "block_size": int(block_size),
        "ideal_hit_tokens": hit,
        "ideal_hit_rate": hit / total if total else 0.0,
        "by_family": {f: {"sessions": a[0], "tokens": a[1], "share_rate": a[2] / a[1] if a[1] else 0.0}
                      for f, a in shared_by.items()},
    }


@dataclass
class WorkloadBuilder:
    """Base of the workload builders. Subclasses are dataclasses whose fields are the workload's sizes."""

    #: registered name (the config group option)
    name: ClassVar[str] = ""

    #: tokens at the end of every session scored (NLL) with the reconstructed cache of the rest
    eval_tokens: int = 16
    seed: int = 0

    def _check(self, **ranges: tuple[float, float]) -> None:
        check_range(self.name, "eval_tokens", self.eval_tokens, 2, 1 << 20, integer=True)
        for f, (lo, hi) in ranges.items():
            check_range(self.name, f, getattr(self, f), lo, hi, integer=isinstance(lo, int) and isinstance(hi, int))

    def build(self, tokenizer: Any, docs: list[str]) -> Workload:
        """Sessions from ``docs`` (the run's text) tokenized with ``tokenizer``."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}
