"""A prefix KV cache under a memory budget, replayed over a request stream: LRU against the probabilistic
language trie (PLT).

Every request looks up the longest cached prefix of its prompt (those tokens skip prefill: a hit), then its whole
prompt is cached (at block granularity) and, while the cache holds more than ``budget_tokens``, the least valuable
leaf gives up blocks from its tail. Only leaves are evicted, so what stays cached is always a set of prefixes.

* ``lru`` — least recently used leaf first: the policy of production radix caches (SGLang RadixAttention,
  Zheng et al., arXiv 2312.07104; vLLM's block LRU evicts tail blocks first in the same way).
* ``plt`` — expected reuse, after the probabilistic language trie of "Sequential KV Cache Compression via
  Probabilistic Language Tries" (arXiv 2604.15356), which weights trie nodes by the model's probability of the
  prefix. A node's priority is ``clock + hits + weight * p_M``: ``hits`` counts the requests that used the node
  (observed frequency); ``p_M = exp(mean log p(token | history))`` over the prefix from the root is the model's
  length-normalised probability of that prefix (the prior that matters for a node seen once — boilerplate,
  templates and instructions are likely text, one-off user text is not); ``clock`` is the GreedyDual-Size-Frequency
  inflation value (Cherkasova 1998), raised to each evicted priority so that once-hot prefixes age out. Ties go
  to the least recently used.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbench.core.checks import check_choice, check_range
from kvbench.core.radix import ROOT, RadixTrie

POLICIES = ("lru", "plt")


@dataclass
class Lookup:
    """What one request found and left behind."""

    hit_tokens: int  # cached prefix reused (prefill saved)
    owner: int  # a previous request whose prompt starts with that prefix (-1 when nothing hit)


@dataclass
class PrefixCache:
    """Radix-trie prefix cache with eviction under ``budget_tokens`` (None: unbounded)."""

    block_size: int = 16
    budget_tokens: int | None = None
    policy: str = "lru"
    plt_weight: float = 1.0

    trie: RadixTrie = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_range("prefix_cache", "block_size", self.block_size, 1, 1 << 20, integer=True)
        check_choice("prefix_cache", "policy", self.policy, POLICIES)
        if self.budget_tokens is not None:
            check_range("prefix_cache", "budget_tokens", self.budget_tokens, 0, 1 << 62, integer=True)
        check_range("prefix_cache", "plt_weight", self.plt_weight, 0.0, 1e9)
        self.trie = RadixTrie(int(self.block_size), with_values=self.policy == "plt")
        self._clock = 0  # requests seen
        self._inflation = 0.0  # GreedyDual clock
        self._last: dict[int, int] = {}
        self._hits: dict[int, int] = {}
        self._version: dict[int, int] = {}
        self._heap: list[tuple[float, int, int, int]] = []
        self.evicted_tokens = 0

    # ---- priorities ----------------------------------------------------------------------------------------
    def _priority(self, node: int) -> float:
        if self.policy == "lru":
            return float(self._last[node])
        t = self.trie
        p_model = math.exp(t.value_sum[node] / t.depth[node]) if t.depth[node] else 0.0
        return self._inflation + self._hits[node] + self.plt_weight * p_model

    def _push(self, node: int) -> None:
        v = self._version.get(node, 0) + 1
        self._version[node] = v
        heapq.heappush(self._heap, (self._priority(node), self._last[node], v, node))

    # ---- requests ------------------------------------------------------------------------------------------
    def lookup(self, tokens) -> int:
        """Cached prefix length for ``tokens``, without touching the cache."""
        return self.trie.match(tokens).tokens

    def request(self, tokens, logprobs=None, rid: int = -1) -> Lookup:
        """Serve one prompt: reuse its cached prefix, cache the rest, evict down to the budget.

        ``logprobs`` (natural log, one per token; the first token has none and may be 0) feed the PLT prior.
        """
        self._clock += 1
        t = self.trie
        m = t.insert(tokens, owner=rid, values=logprobs if self.policy == "plt" else None)
        owner = t.owner[m.node] if m.tokens else -1
        for node in m.path:
            # a split leaves the old node below the new one; both inherit its history
            below = next(iter(t.children[node].values()), None) if node not in self._last else None
            if below is not None and below in self._last:
                self._last[node], self._hits[node] = self._last[below], self._hits[below]
            self._last[node] = self._clock
            self._hits[node] = self._hits.get(node, 0) + 1
        for node in m.path:
            if t.is_leaf(node):
                self._push(node)
        self._evict()
        return Lookup(m.tokens, owner)

    def _evict(self) -> None:
        if self.budget_tokens is None:
            return
        t = self.trie
        while t.n_tokens > self.budget_tokens:
            prio, _, v, node = heapq.heappop(self._heap)
            if self._version.get(node) != v or not t.is_leaf(node):
                continue
            excess = t.n_tokens - self.budget_tokens
            B = t.block_size
            n = min(t.length[node], -(-excess // B) * B)
            parent = t.parent[node]
            t.trim(node, n)
            self.evicted_tokens += n
            if self.policy == "plt":
                self._inflation = max(self._inflation, prio)
            if t.alive[node]:
                self._push(node)
            elif parent != ROOT and t.is_leaf(parent):
                self._push(parent)

    @property
    def held_tokens(self) -> int:
        return self.trie.n_tokens


@dataclass
class ReplayResult:
    policy: str
    budget_tokens: int | None
    block_size: int
    requests: int
    prompt_tokens: int
    hit_tokens: int  # prefill tokens saved
    requests_with_hit: int
    held_mean_tokens: float
    held_max_tokens: int
    evicted_tokens: int
    hits: list[int] = field(repr=False, default_factory=list)
    owners: list[int] = field(repr=False, default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict:
        return {
            "policy": self.policy,
            "budget_tokens": self.budget_tokens,
            "block_size": self.block_size,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "hit_rate": self.hit_rate,
            "request_hit_rate": self.requests_with_hit / self.requests if self.requests else 0.0,
            "prefill_tokens_saved": self.hit_tokens,
            "memory_held_mean_tokens": self.held_mean_tokens,
            "memory_held_max_tokens": self.held_max_tokens,
            "evicted_tokens": self.evicted_tokens,
        }


def replay(sessions: Sequence, block_size: int = 16, budget_tokens: int | None = None, policy: str = "lru",
           logprobs: Iterable | None = None, plt_weight: float = 1.0, id_tokens: int = 1,
           prompt_tokens: Sequence[int] | None = None) -> ReplayResult:
    """Serve ``sessions`` (token-id arrays, in arrival order) through a :class:`PrefixCache`.

    For block-hash traces an id stands for ``id_tokens`` tokens and ``prompt_tokens`` gives each prompt's real
    length: a hit of ``k`` ids then saves ``min(k * id_tokens, prompt length)`` tokens. Budgets are in ids then.
    """
    cache = PrefixCache(block_size, budget_tokens, policy, plt_weight)
    lps = list(logprobs) if logprobs is not None else [None] * len(sessions)
    hits, owners, held = [], [], []
    total = hit_total = with_hit = 0
    for i, toks in enumerate(sessions):
        got = cache.request(toks, lps[i], rid=i)
        n = len(toks) * id_tokens if prompt_tokens is None else int(prompt_tokens[i])
        h = min(got.hit_tokens * id_tokens, n)
        total += n
        hit_total += h
        with_hit += h > 0
        hits.append(got.hit_tokens)
        owners.append(got.owner)
        held.append(cache.held_tokens)
    return ReplayResult(policy, budget_tokens, int(block_size), len(sessions), total, hit_total, with_hit,
                        float(np.mean(held)) if held else 0.0, int(max(held, default=0)), cache.evicted_tokens,
                        hits, owners)
