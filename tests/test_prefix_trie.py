"""The radix trie and the prefix-cache policies: exact matches at block granularity, budgets, LRU vs PLT."""

import numpy as np
import pytest

from kvbench.core.prefix_cache import PrefixCache, replay
from kvbench.core.radix import RadixTrie


def _common(a, b):
    n = min(len(a), len(b))
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if neq.size else n


def _random_stream(rng, n=60, vocab=5):
    """Sessions that share prefixes of random length with random earlier sessions (small vocab: many forks)."""
    seqs = []
    for _ in range(n):
        tail = rng.integers(0, vocab, size=int(rng.integers(0, 40)))
        if seqs and rng.random() < 0.8:
            base = seqs[int(rng.integers(len(seqs)))]
            seqs.append(np.concatenate([base[: int(rng.integers(0, len(base) + 1))], tail]))
        else:
            seqs.append(tail)
    return seqs


@pytest.mark.parametrize("block", [1, 3, 16])
def test_match_is_the_longest_earlier_prefix_in_whole_blocks(block):
    rng = np.random.default_rng(block)
    trie = RadixTrie(block)
    seqs = _random_stream(rng)
    for j, s in enumerate(seqs):
        expect = max([_common(s, seqs[i]) for i in range(j)], default=0)
        expect = min(expect, len(s) // block * block) // block * block
        m = trie.insert(s, owner=j)
        assert m.tokens == expect, (j, m.tokens, expect)
        if m.tokens:  # the owner's sequence really starts with the matched prefix
            o = seqs[trie.owner[m.node]]
            assert np.array_equal(o[: m.tokens], s[: m.tokens])
    # every whole block of every sequence is stored exactly once
    fine = RadixTrie(block)
    unique = sum(len(s) // block * block - fine.insert(s).tokens for s in seqs)
    assert trie.n_tokens == unique and trie.index_nbytes() == 8 * unique


def test_split_keeps_labels_and_values_exact():
    t = RadixTrie(2, with_values=True)
    t.insert([1, 2, 3, 4, 5, 6], values=[0, -1, -1, -1, -1, -1])
    t.insert([1, 2, 3, 4, 9, 9, 7], values=[0, -1, -1, -1, -2, -2, -5])  # splits after 4 tokens; 7 is a partial block
    assert t.n_tokens == 8
    upper = t.match([1, 2, 3, 4]).node
    assert list(t.label(upper)) == [1, 2, 3, 4] and t.value_sum[upper] == -3
    leaf = t.match([1, 2, 3, 4, 9, 9]).node
    assert list(t.label(leaf)) == [9, 9] and t.value_sum[leaf] == -7 and t.depth[leaf] == 6
    assert t.match([1, 2, 3, 5]).tokens == 2  # the mismatch is inside the second block
    t.trim(leaf, 2)
    assert t.match([1, 2, 3, 4, 9, 9]).tokens == 4 and t.n_tokens == 6


def test_only_leaves_are_trimmed_and_in_whole_blocks():
    t = RadixTrie(2)
    t.insert([1, 2, 3, 4])
    t.insert([1, 2, 5, 6])
    inner = t.match([1, 2]).node
    with pytest.raises(ValueError, match="leaf"):
        t.trim(inner, 2)
    with pytest.raises(ValueError, match="trim 1"):
        t.trim(t.match([1, 2, 3, 4]).node, 1)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        RadixTrie(0)
    with pytest.raises(ValueError, match="integer"):
        RadixTrie().insert(np.array([0.5, 1.5]))


def test_unbounded_replay_hits_exactly_the_shared_prefixes():
    rng = np.random.default_rng(0)
    seqs = _random_stream(rng, vocab=3)
    r = replay(seqs, block_size=4)
    fine = RadixTrie(4)
    assert r.hit_tokens == sum(fine.insert(s).tokens for s in seqs)
    assert r.evicted_tokens == 0 and r.held_max_tokens == fine.n_tokens


@pytest.mark.parametrize("policy", ["lru", "plt"])
def test_budget_is_never_exceeded_and_hits_are_a_cached_prefix(policy):
    rng = np.random.default_rng(1)
    seqs = _random_stream(rng, n=120, vocab=3)
    cache = PrefixCache(block_size=2, budget_tokens=50, policy=policy)
    for j, s in enumerate(seqs):
        before = cache.lookup(s)
        got = cache.request(s, rng.normal(-2, 1, size=len(s)), rid=j)
        assert got.hit_tokens == before
        assert cache.held_tokens <= 50
        if got.hit_tokens:
            assert np.array_equal(seqs[got.owner][: got.hit_tokens], s[: got.hit_tokens])


def _hot_and_scan(n_rounds=30, hot_len=64, tail=16, scan=4, scan_len=48):
    """A hot system prompt reused every few requests, with one-off sessions in between (a scan)."""
    rng = np.random.default_rng(0)
    hot = rng.integers(1000, 2000, hot_len)
    seqs, lps = [], []
    for _ in range(n_rounds):
        seqs.append(np.concatenate([hot, rng.integers(0, 1000, tail)]))
        lps.append(np.full(len(seqs[-1]), -1.0))
        for _ in range(scan):
            seqs.append(rng.integers(2000, 3000, scan_len))
            lps.append(np.full(scan_len, -1.0))
    return seqs, lps


def test_plt_keeps_the_hot_prefix_that_lru_loses_to_a_scan():
    seqs, lps = _hot_and_scan()
    lru = replay(seqs, 16, budget_tokens=160, policy="lru", logprobs=lps)
    plt = replay(seqs, 16, budget_tokens=160, policy="plt", logprobs=lps)
    # LRU: four one-off sessions (192 tokens) push the hot prompt out before it comes back
    assert lru.hit_tokens == 0
    # PLT: the prompt's hit count keeps it; every later round hits its 64 tokens
    assert plt.hit_tokens == 64 * 29
    assert plt.held_max_tokens <= 160 and lru.held_max_tokens <= 160


def test_plt_prior_prefers_the_likely_prefix_among_equally_frequent_ones():
    rng = np.random.default_rng(3)
    likely, unlikely = rng.integers(0, 100, 32), rng.integers(100, 200, 32)
    seqs = [likely, unlikely, rng.integers(200, 300, 32), likely, unlikely]
    lps = [np.full(32, -0.1), np.full(32, -6.0), np.full(32, -3.0), np.full(32, -0.1), np.full(32, -6.0)]
    # room for two of the three 32-token prompts: the one-off third arrival forces an eviction
    plt = replay(seqs, 16, budget_tokens=64, policy="plt", logprobs=lps)
    lru = replay(seqs, 16, budget_tokens=64, policy="lru", logprobs=lps)
    assert plt.hits[3] == 32  # the likely prompt survived: PLT evicted the improbable one
    assert lru.hits[3] == 0  # LRU evicted the oldest, the likely one


def test_block_hash_weights_count_tokens():
    seqs = [np.array([0, 1, 2]), np.array([0, 1, 3]), np.array([0, 4])]
    r = replay(seqs, 1, id_tokens=512, prompt_tokens=[1500, 1400, 700])
    assert r.prompt_tokens == 3600
    assert r.hit_tokens == 1024 + 512


class _CountingTrie(RadixTrie):
    """Counts the child lookups a walk makes (one per node entered, plus the one that finds no child)."""

    lookups = 0

    def _key(self, arr, pos):
        self.lookups += 1
        return super()._key(arr, pos)


def test_insert_is_linear_and_memory_follows_unique_tokens():
    """20,000 sessions of ~300 tokens (6M tokens) sharing 100 prompts; scripts/bench_trie.py runs 100,000 and
    times them. Here the work is counted instead: an insert makes a child lookup per node on its path (at most a
    branch node and a leaf here) plus a split and a new leaf, never one per token or block."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 49152, 200) for _ in range(100)]
    tails = rng.integers(0, 49152, (20_000, 100))
    pick = rng.integers(0, 100, 20_000)
    trie = _CountingTrie(16)
    worst = 0
    for i in range(20_000):
        before = trie.lookups
        m = trie.insert(np.concatenate([prompts[pick[i]], tails[i]]), owner=i)
        # the walk: one lookup per node entered and one that misses; a split re-keys two edges, a new leaf one
        worst = max(worst, trie.lookups - before - len(m.path))
        assert len(m.path) <= 3
    assert worst <= 4, f"an insert made {worst} child lookups beyond one per node on its path"
    unique = 100 * 192 + 20_000 * (300 // 16 * 16 - 192)
    assert trie.n_tokens == unique
    assert trie.index_nbytes() == 8 * unique
    assert trie.n_nodes <= 100 + 20_000  # one branch node per prompt, one leaf per session
