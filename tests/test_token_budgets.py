"""Budgets given as a number of tokens (``keep_tokens``) instead of a fraction, and the kept-position code of rows
that keep different counts (the budget rules of tests/test_adaptive_budgets.py)."""

import math

import pytest
import torch

from compressors.eviction.evict import n_kept, select
from compressors.eviction.kept_positions import GAPS, MASK, PER_ROW, decode_positions, encode_positions
from compressors.eviction.knorm import KNorm
from compressors.eviction.streaming_llm import StreamingLLM
from kvbench.coding.bitstream import Bitstream
from kvbench.core.config import compose, make_compressor
from kvbench.core.kv import Context


def _sections(coded):
    return {name: s if isinstance(s, bytes) else s[0] for name, s in coded.sections.items()}


# ---------------------------------------------------------------------------------------------- keep_tokens


@pytest.mark.parametrize("name", ["knorm", "streaming_llm", "random_eviction"])
def test_keep_tokens_keeps_what_the_same_fraction_keeps(name, random_kv):
    kv = random_kv(T=96)
    ctx = Context.for_kv(kv)
    by_share = make_compressor(compose([f"+compressor={name}", "compressor.keep=0.25"]).compressor)
    by_count = make_compressor(compose([f"+compressor={name}", "compressor.keep=null",
                                        "compressor.keep_tokens=24"]).compressor)
    assert by_count.keep is None and by_count.keep_tokens == 24 == n_kept(name, 0.25, 96)
    a, b = by_share.encode(kv, ctx), by_count.encode(kv, ctx)
    assert a.data == b.data  # the same tokens kept, the same stream
    out = by_count.decode(Bitstream.from_bytes(b.data), ctx)
    assert (out.kept.sum(-1) == 24).all()


def test_keep_tokens_past_the_context_keeps_all_of_it_and_says_what_it_protects(random_kv):
    kv = random_kv(T=40)
    comp = KNorm(keep=None, keep_tokens=100)
    assert comp.n_keep(40) == 40 and comp.n_keep(400) == 100
    assert comp.kept_mask(kv, Context.for_kv(kv)).all()
    assert StreamingLLM(keep=None, keep_tokens=64, sinks=4).always_kept(1000).text() == "4 sinks + 60 recent"


@pytest.mark.parametrize("fields", [{"keep": 0.5, "keep_tokens": 64}, {"keep": None, "keep_tokens": None}])
def test_not_exactly_one_budget_names_both_fields(fields):
    with pytest.raises(ValueError, match=r"knorm: give exactly one of keep .* and keep_tokens .*keep=null "
                                          r"keep_tokens=N"):
        KNorm(**fields)


def test_both_budgets_on_the_command_line_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"snapkv: give exactly one of keep.*got keep=0.5, keep_tokens=64"):
        make_compressor(compose(["+compressor=snapkv", "compressor.keep_tokens=64"]).compressor)


@pytest.mark.parametrize("n", [0, -3, 2.5, True])
def test_a_token_budget_must_be_a_positive_whole_number(n):
    with pytest.raises(ValueError, match=r"knorm\.keep_tokens="):
        KNorm(keep=None, keep_tokens=n)


def test_a_token_budget_leaves_earlier_cell_keys_alone():
    assert "keep_tokens" not in KNorm().keyed() and KNorm().describe()["keep_tokens"] is None
    assert KNorm(keep=None, keep_tokens=8).keyed()["keep_tokens"] == 8


# ---------------------------------------------------------------------------------------------- unequal rows


def _ragged(seed: int, L=3, H=2, T=120):
    """Rows keeping different counts: one keeps nothing, one everything, the rest 1 .. T - 1."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, T, (L, H), generator=g)
    counts[0, 0], counts[1, 1] = 0, T
    return select(torch.rand(L, H, T, generator=g), counts), counts


@pytest.mark.parametrize("clustered", [False, True])
def test_rows_of_different_counts_roundtrip_with_their_counts_in_the_header(clustered):
    kept, counts = _ragged(1)
    if clustered:  # the gap code wins where kept tokens come in runs
        kept = select(torch.zeros(kept.shape), counts, sinks=4, window=counts)
    coded = encode_positions(kept)
    assert coded.flag & PER_ROW and (coded.flag & GAPS) == (GAPS if clustered else MASK)
    assert torch.equal(decode_positions(coded.header, _sections(coded), tuple(kept.shape)), kept)
    if not clustered:  # each row about log2 C(T, k_r) bits, under its own count's model
        T = kept.shape[-1]
        ideal = sum(math.lgamma(T + 1) - math.lgamma(k + 1) - math.lgamma(T - k + 1)
                    for k in counts.flatten().tolist()) / math.log(2)
        assert coded.sections["positions"][1] < ideal * 1.05 + 64


def test_a_header_whose_counts_disagree_with_the_positions_is_refused():
    from kvbench.coding.bitstream import BitstreamError, read_varints, varints

    kept, counts = _ragged(2)
    coded = encode_positions(kept)
    (k, flag, *listed), _ = read_varints(coded.header, 2 + counts.numel())
    listed[2] += 1 if listed[2] < k else -1
    with pytest.raises(BitstreamError, match="eviction positions"):
        decode_positions(varints([k, flag, *listed]) + coded.header[len(varints([k, flag, *counts.flatten().tolist()])):],
                         _sections(coded), tuple(kept.shape))
