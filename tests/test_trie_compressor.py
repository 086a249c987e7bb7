"""The trie (exact cross-session dedup) and pipeline (dedup around an inner compressor): exact decoding, exact
bit accounting, KV that differs under a shared prefix, budgets."""

import numpy as np
import pytest
import torch

from compressors.dedup.pipeline import Pipeline
from compressors.dedup.trie import Trie
from compressors.exact.identity import Identity
from compressors.quantizers.kivi import KIVI
from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.core.kv import Context, KVSequence, first_kv_mismatch
from kvbench.core.prefix_cache import replay

L, H, D = 2, 2, 32


def _kv(T, seed, tok_lo):
    g = torch.Generator().manual_seed(seed)
    return KVSequence(torch.randn(L, H, T, D, generator=g).half(), torch.randn(L, H, T, D, generator=g).half(),
                      torch.randint(tok_lo, tok_lo + 100, (T,), generator=g))


def _join(a, n, b):
    """``a``'s first ``n`` tokens, then ``b``: a session sharing ``a``'s prefix, with its own KV after it."""
    return KVSequence(torch.cat([a.k[:, :, :n], b.k], 2), torch.cat([a.v[:, :, :n], b.v], 2), torch.cat([a.tokens[:n], b.tokens]))


def _sessions():
    a = _kv(100, 0, 0)
    return [a, _join(a, 70, _kv(30, 1, 1000)), _join(a, 70, _kv(50, 2, 2000)), _join(a, 40, _kv(20, 3, 3000)), _kv(60, 4, 4000)]


def _ctxs(kvs):
    return [Context.for_kv(kv) for kv in kvs]


def _roundtrip(comp, kvs):
    bs = comp.encode_set(kvs, _ctxs(kvs))
    out = comp.decode_set(Bitstream.from_bytes(bs.data), _ctxs(kvs))
    return bs, out


@pytest.mark.parametrize("block,unique", [(1, 100 + 30 + 50 + 20 + 60), (16, 100 + 36 + 56 + 28 + 60)])
def test_every_session_decodes_exactly_and_each_prefix_is_stored_once(block, unique):
    kvs = _sessions()
    bs, out = _roundtrip(Trie(block_size=block), kvs)
    for kv, got in zip(kvs, out):
        assert torch.equal(got.k, kv.k) and torch.equal(got.v, kv.v) and torch.equal(got.tokens, kv.tokens)
    assert bs.parts["k"] == bs.parts["v"] == 16 * L * H * D * unique
    width = int(max(int(kv.tokens.max()) for kv in kvs)).bit_length()
    assert bs.parts["labels"] == width * unique
    assert bs.num_bits == sum(bs.parts.values())
    assert set(bs.parts) == {"frame", "index", "labels", "k", "v"}


def test_labels_off_stores_kv_and_topology_only():
    kvs = _sessions()
    bs, out = _roundtrip(Trie(block_size=1, labels=False), kvs)
    assert bs.parts["labels"] == 0 and out[3].tokens is None
    assert torch.equal(out[3].k, kvs[3].k)


def test_kv_that_differs_under_a_shared_prefix_is_stored_not_shared():
    kvs = _sessions()
    kvs[1].k[1, 0, 50, 3] += 1  # as if the second prefill had computed token 50 differently
    assert first_kv_mismatch(kvs[1], kvs[0], 70) == 50
    bs, out = _roundtrip(Trie(block_size=1), kvs)
    assert torch.equal(out[1].k, kvs[1].k)  # still exact
    # session 1 now shares 50 tokens, not 70; session 2 still finds 70 of session 0
    assert bs.parts["k"] == 16 * L * H * D * (100 + 50 + 50 + 20 + 60)
    bs16, _ = _roundtrip(Trie(block_size=16), kvs)
    assert bs16.parts["k"] == 16 * L * H * D * (100 + (100 - 48) + 56 + 28 + 60)
    # sharing on the token match alone, as a serving cache does: session 1 decodes to session 0's prefix KV
    loose = Trie(block_size=1, verify_kv=False)
    bs_tok, out_tok = _roundtrip(loose, kvs)
    assert not loose.lossless
    assert bs_tok.parts["k"] == 16 * L * H * D * (100 + 30 + 50 + 20 + 60)
    assert torch.equal(out_tok[1].k[:, :, :70], kvs[0].k[:, :, :70]) and not torch.equal(out_tok[1].k, kvs[1].k)


@pytest.mark.parametrize("inner", [Identity(), KIVI(bits=2, group_size=16, residual=8)])
def test_pipeline_bits_are_the_index_plus_exactly_the_inner_bits(inner):
    kvs = _sessions()
    pipe = Pipeline(inner=inner, dedup=Trie(block_size=16))
    bs, out = _roundtrip(pipe, kvs)
    plan = Trie(block_size=16).plan(kvs, _ctxs(kvs))
    decoded = []
    for j, (kv, m) in enumerate(zip(kvs, plan.shared)):
        seg = kv.slice_tokens(m, kv.n_tokens)
        alone = inner.encode(seg, Context.for_kv(seg))
        mine = {k: v for k, v in bs.parts.items() if k.startswith(f"{j}/")}
        assert sum(mine.values()) == alone.num_bits  # every bit of the inner stream, no more
        assert {k.split("/", 1)[1] for k in mine} == set(alone.parts)
        head = decoded[plan.parent[j]] if m else None
        seg_hat = inner.decode(alone, Context.for_kv(seg))
        k = seg_hat.k if head is None else torch.cat([head.k[:, :, :m], seg_hat.k], 2)
        decoded.append(KVSequence(k, k))
        assert torch.equal(out[j].k, k)  # the shared prefix decodes as its first session's
    index = bs.parts["index"] + bs.parts["labels"] + bs.parts["frame"]
    assert bs.num_bits == index + sum(v for k, v in bs.parts.items() if "/" in k)
    assert pipe.lossless == inner.lossless


def test_pipeline_beats_its_inner_alone_when_sessions_share():
    kvs = _sessions()
    inner = KIVI(bits=2, group_size=16, residual=8)
    alone = sum(inner.encode(kv, Context.for_kv(kv)).num_bits for kv in kvs)
    bs, _ = _roundtrip(Pipeline(inner=inner, dedup=Trie(block_size=16)), kvs)
    assert bs.num_bits < 0.8 * alone


def test_pipeline_resolves_inner_by_name_node_or_object():
    assert isinstance(Pipeline(inner="kivi").inner, KIVI)
    assert Pipeline(inner={"name": "kivi", "bits": 4}).inner.bits == 4
    assert Pipeline(inner={"_target_": "compressors.quantizers.kivi.KIVI", "bits": 3}).inner.bits == 3
    assert Pipeline(inner=KIVI(bits=5)).inner.bits == 5
    assert Pipeline(dedup={"name": "trie", "block_size": 4}).dedup.block_size == 4
    with pytest.raises(ValueError, match="not a compressor config; available"):
        Pipeline(inner="nope")
    with pytest.raises(ValueError, match="dedup must be a trie"):
        Pipeline(dedup="kivi")
    with pytest.raises(ValueError, match="set compressor"):
        Pipeline(inner="trie")
    with pytest.raises(ValueError, match="kivi.bits"):
        Pipeline(inner={"name": "kivi", "bits": 99})


@pytest.mark.parametrize("policy", ["lru", "plt"])
def test_a_budget_stores_what_the_cache_replay_misses(policy):
    kvs = _sessions() * 2  # the same five prompts arrive twice
    for budget in (0, 64, 160, None):
        comp = Trie(block_size=16, budget_tokens=budget, policy=policy)
        bs, out = _roundtrip(comp, kvs)
        assert all(torch.equal(a.v, b.v) for a, b in zip(kvs, out))
        r = replay([kv.tokens.numpy() for kv in kvs], 16, budget, policy, logprobs=[np.zeros(kv.n_tokens) for kv in kvs])
        stored = sum(kv.n_tokens for kv in kvs) - r.hit_tokens
        assert bs.parts["k"] == 16 * L * H * D * stored
    assert replay([kv.tokens.numpy() for kv in kvs], 16, 0).hit_tokens == 0


def test_single_sequence_and_mismatched_contexts():
    kv = _sessions()[0]
    comp = Trie()
    ctx = Context.for_kv(kv)
    assert torch.equal(comp.decode(Bitstream.from_bytes(comp.encode(kv, ctx).data), ctx).k, kv.k)
    bs = comp.encode_set(_sessions(), _ctxs(_sessions()))
    with pytest.raises(BitstreamError, match="5 sessions"):
        comp.decode_set(bs, [ctx])
    with pytest.raises(BitstreamError, match="written by compressor 'trie'"):
        Pipeline().decode_set(bs, _ctxs(_sessions()))


def test_bad_fields_name_what_is_allowed():
    with pytest.raises(ValueError, match="trie.policy='fifo'.*lru"):
        Trie(policy="fifo")
    with pytest.raises(ValueError, match="trie.block_size"):
        Trie(block_size=0)
    with pytest.raises(ValueError, match="trie.budget_tokens"):
        Trie(budget_tokens=-1)
