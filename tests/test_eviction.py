"""Token eviction: exact kept counts per (layer, KV head), protected sinks and windows, the positions stream, the
kept KV at 16 bits or through an inner compressor, and attention scores recomputed from the model's queries."""

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import tiny_arch, tiny_llama

from compressors.eviction.evict import n_kept, select
from compressors.eviction.expected_attention import ExpectedAttention
from compressors.eviction.h2o import H2O, accumulated_scores
from compressors.eviction.kept_positions import (
    ALL,
    GAPS,
    MASK,
    _code_gaps,
    _code_mask,
    decode_positions,
    encode_positions,
)
from compressors.eviction.knorm import KNorm
from compressors.eviction.query_attention import Queries, attention_sums, capture_queries, per_kv_head
from compressors.eviction.random_eviction import RandomEviction
from compressors.eviction.snapkv import SnapKV
from compressors.eviction.streaming_llm import StreamingLLM
from compressors.eviction.tova import TOVA, last_query_scores
from compressors.quantizers.turboquant import TurboQuant
from kvbench.coding.bitstream import Bitstream
from kvbench.core.codec import decoder_for, state_bytes
from kvbench.core.compressor import Compressor, rebuild
from kvbench.core.config import compose, make_compressor
from kvbench.core.kv import Context, KVSequence
from kvbench.inputs.capture import capture_window

T = 80
METHODS = {
    "streaming_llm": StreamingLLM(keep=0.3, sinks=4),
    "knorm": KNorm(keep=0.3),
    "random_eviction": RandomEviction(keep=0.3, seed=3),
    "snapkv": SnapKV(keep=0.3, window=8),
    "tova": TOVA(keep=0.3),
    "h2o": H2O(keep=0.3, recent=0.5),
    "expected_attention": ExpectedAttention(keep=0.3, sinks=4, future=32),
}


@pytest.fixture(scope="module")
def trace():
    """A tiny Llama (4 query heads, 2 KV heads) and its cache of 80 tokens with the token ids."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (T + 10,), generator=torch.Generator().manual_seed(7))
    got = capture_window(model, ids, T, torch.float16)
    kv = KVSequence(got["k"], got["v"], ids[:T])
    return model, kv, Context.for_kv(kv, model)


def _roundtrip(comp, kv, ctx):
    bs = comp.encode(kv, ctx)
    stored = Bitstream.from_bytes(bs.data)
    return bs, decoder_for(comp, state_bytes(comp)).decode(stored, Context.for_kv(kv, ctx.model))


# ---------------------------------------------------------------------------------------------- selection


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_keeps_the_requested_count_per_head_with_protected_tokens(name, trace):
    _, kv, ctx = trace
    comp = METHODS[name]
    _, out = _roundtrip(comp, kv, ctx)
    n = round(0.3 * T)  # 24
    assert out.kept is not None and out.kept.shape == kv.shape[:3]
    assert (out.kept.sum(-1) == n).all()
    sinks, window = comp.protected(T, n)
    assert out.kept[..., :sinks].all() and out.kept[..., T - window :].all()
    if name == "streaming_llm":  # the sinks and the recent window, nothing else
        assert out.kept[..., T - (n - 4) :].all() and out.kept[..., 4 : T - (n - 4)].sum() == 0
    if name == "h2o":
        assert window == 12  # half the budget is the recent window


def test_selection_breaks_ties_towards_the_earlier_token_and_ranks_nan_last():
    scores = torch.tensor([[[1.0, 3.0, 3.0, float("nan"), 3.0, 0.0]]])
    assert select(scores, 2).nonzero()[:, -1].tolist() == [1, 2]
    assert select(scores, 5)[0, 0, 3].item() is False


def test_protected_tokens_come_first_sinks_before_the_window_when_the_budget_is_small():
    scores = torch.arange(20.0).flip(0).expand(1, 2, 20)  # the method itself prefers the earliest tokens
    kept = select(scores, 6, sinks=2, window=3)
    assert kept[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 17, 18, 19]
    kept = select(scores, 4, sinks=2, window=3)  # no room for the whole window: its latest tokens first
    assert kept[0, 0].nonzero().flatten().tolist() == [0, 1, 18, 19]
    kept = select(scores, 1, sinks=2, window=3)
    assert kept[0, 0].nonzero().flatten().tolist() == [0]


def test_knorm_keeps_the_lowest_norm_keys(random_kv):
    kv = random_kv(T=64)
    kept = KNorm(keep=0.25).kept_mask(kv, Context.for_kv(kv))
    norm = kv.k.float().norm(dim=-1)  # (L, H, T)
    assert (norm.masked_fill(~kept, -1).amax(-1) <= norm.masked_fill(kept, math.inf).amin(-1)).all()


def test_keep_one_keeps_everything_without_scoring(trace):
    _, kv, _ = trace
    comp = SnapKV(keep=1.0)
    bs = comp.encode(kv, Context.for_kv(kv))  # no model: nothing to score when everything is kept
    out = comp.decode(Bitstream.from_bytes(bs.data), Context.for_kv(kv))
    assert out.kept.all() and torch.equal(out.k, kv.k) and torch.equal(out.v, kv.v)
    assert "positions" not in bs.parts


# ---------------------------------------------------------------------------------------------- positions


def _mask_with(rows):
    return torch.tensor(rows, dtype=torch.bool).reshape(len(rows), 1, -1)


def test_positions_roundtrip_and_pick_the_smaller_code():
    g = torch.Generator().manual_seed(0)
    L, H, n, k = 3, 2, 200, 50
    scattered = select(torch.rand(L, H, n, generator=g), k)
    clustered = select(torch.rand(L, H, n, generator=g), k, sinks=4, window=k - 4)
    for kept, expect in ((scattered, MASK), (clustered, GAPS)):
        coded = encode_positions(kept)
        mask = kept.reshape(L * H, n).numpy()
        bits = {MASK: _code_mask(mask, k).bits, GAPS: _code_gaps(mask, k).bits}
        assert coded.flag == expect and coded.bits == min(bits.values())
        sec = {name: s if isinstance(s, bytes) else s[0] for name, s in coded.sections.items()}
        assert torch.equal(decode_positions(coded.header, sec, (L, H, n)), kept)
    # a random mask costs about log2 C(n, k) bits a row; sinks plus a window a few dozen bits a row
    ideal = L * H * (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)
    assert encode_positions(scattered).bits < ideal * 1.05 + 64
    assert encode_positions(clustered).bits < 40 * L * H


def test_gap_code_roundtrips_edge_gaps():
    # kept at the very start and end, gaps of every bit length, one row all at the end
    rows = [[1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1], [0] * 9 + [1, 1, 1], [1, 1, 1] + [0] * 9, [0, 0, 1, 0, 0, 0, 1] + [0] * 4 + [1]]
    kept = _mask_with(rows)
    coded = _code_gaps(kept.reshape(4, 12).numpy(), 3)
    sec = {name: s if isinstance(s, bytes) else s[0] for name, s in coded.sections.items()}
    assert torch.equal(decode_positions(coded.header, sec, (4, 1, 12)), kept)


def test_every_kept_row_pays_for_its_positions_and_all_kept_costs_none():
    kept = torch.ones(2, 2, 30, dtype=torch.bool)
    coded = encode_positions(kept)
    assert coded.flag == ALL and coded.sections == {}
    with pytest.raises(ValueError, match="at least one entry"):
        encode_positions(torch.zeros(2, 2, 30, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------- stored KV


def test_decode_gives_zeros_at_evicted_entries_and_exact_kept_ones(random_kv):
    kv = random_kv(T=100, D=32)
    ctx = Context.for_kv(kv)
    comp = KNorm(keep=0.4)
    bs, out = _roundtrip(comp, kv, ctx)
    assert out.shape == kv.shape and out.k.dtype == kv.k.dtype
    assert torch.equal(out.k[out.kept], kv.k[out.kept]) and torch.equal(out.v[out.kept], kv.v[out.kept])
    assert (out.k[~out.kept] == 0).all() and (out.v[~out.kept] == 0).all()
    kv_bits = 2 * 16 * out.kept.sum().item() * 32
    assert bs.parts["k"] + bs.parts["v"] == kv_bits
    assert bs.num_bits == sum(bs.parts.values()) and bs.num_bits - kv_bits == sum(
        v for p, v in bs.parts.items() if p not in ("k", "v"))


def test_ratio_is_the_kept_fraction_up_to_positions_and_frame(random_kv):
    kv = random_kv(L=4, H=2, T=512, D=64)
    bs = StreamingLLM(keep=0.5).encode(kv, Context.for_kv(kv))
    ratio = 16 * 2 * kv.k.numel() / bs.num_bits
    assert 1.98 < ratio < 2.0
    bs = RandomEviction(keep=0.25).encode(kv, Context.for_kv(kv))
    assert 3.9 < 16 * 2 * kv.k.numel() / bs.num_bits < 4.0


def test_inner_turboquant_codes_the_kept_vectors_and_its_bits_add_up(random_kv):
    kv = random_kv(T=120, D=64)
    ctx = Context.for_kv(kv)
    comp = make_compressor(compose(["+compressor=knorm", "compressor.keep=0.25", "compressor.inner=turboquant"]).compressor)
    assert isinstance(comp.inner, TurboQuant)
    bs, out = _roundtrip(comp, kv, ctx)
    kept = out.kept
    n = kept[0, 0].sum().item()
    k_kept, v_kept = kv.k[kept].reshape(2, 2, n, 64), kv.v[kept].reshape(2, 2, n, 64)
    alone = TurboQuant().encode(KVSequence(k_kept, v_kept), Context(2, 2, n, 64, kv.k.dtype))
    inner_parts = {p.removeprefix("inner/"): b for p, b in bs.parts.items() if p.startswith("inner/")}
    assert inner_parts == dict(alone.parts) and sum(inner_parts.values()) == alone.num_bits
    assert bs.num_bits == bs.parts["frame"] + bs.parts["header"] + sum(
        b for p, b in bs.parts.items() if p.startswith("positions")) + alone.num_bits
    direct = TurboQuant().decode(Bitstream.from_bytes(alone.data), Context(2, 2, n, 64, kv.k.dtype))
    assert torch.equal(out.k[kept].reshape(2, 2, n, 64), direct.k) and torch.equal(out.v[kept], direct.v.reshape(-1, 64))
    assert (out.k[~kept] == 0).all()
    assert comp.describe()["inner"]["name"] == "turboquant"


@dataclass
class _Fitted(Compressor):
    """A 16-bit store whose fitted offset travels as state: enough to see delegation."""

    offset: float = 0.0

    name = "fitted_test"

    def fit(self, calib, config=None):
        self.learned = float(calib[0].k.float().mean())

    def state(self):
        return {"offset": np.float64(self.learned).tobytes()} if hasattr(self, "learned") else {}

    def load_state(self, sections: Mapping[str, bytes]) -> None:
        self.learned = float(np.frombuffer(sections["offset"], dtype=np.float64)[0])

    def encode(self, kv, ctx):
        return Bitstream.pack(self.name, {"k": (kv.k.float() - self.learned).half().numpy().tobytes(),
                                          "v": kv.v.numpy().tobytes()})

    def decode(self, bs, ctx):
        sec = bs.sections(expect=self.name)
        k = torch.from_numpy(np.frombuffer(sec["k"], dtype=np.float16).copy()).reshape(ctx.shape)
        v = torch.from_numpy(np.frombuffer(sec["v"], dtype=np.float16).copy()).reshape(ctx.shape)
        return KVSequence((k.float() + self.learned).half(), v)


def test_fitted_state_of_the_inner_compressor_is_delegated(random_kv):
    kv, calib = random_kv(T=64), random_kv(T=64, seed=4)
    comp = StreamingLLM(keep=0.5, inner=_Fitted())
    comp.fit([calib])
    state = comp.state()
    assert list(state) == ["inner/offset"]
    fresh = rebuild(comp)
    assert fresh.state() == {} and fresh.inner is not comp.inner
    dec = decoder_for(comp, state_bytes(comp))
    assert dec.inner.learned == comp.inner.learned
    ctx = Context.for_kv(kv)
    out = dec.decode(Bitstream.from_bytes(comp.encode(kv, ctx).data), ctx)
    assert torch.allclose(out.k[out.kept].float(), kv.k[out.kept].float(), atol=1e-2)
    with pytest.raises(ValueError, match="inner compressor"):
        StreamingLLM().load_state({"inner/offset": b"\x00" * 8})
    with pytest.raises(ValueError, match="inner compressor"):
        rebuild(comp).load_state({"offset": b"\x00" * 8})


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("keep", [0, 1.5, -0.2, "half", True])
def test_keep_outside_the_unit_interval_names_the_field_and_range(keep):
    with pytest.raises(ValueError, match=r"knorm\.keep=.*allowed: 0 < keep <= 1"):
        KNorm(keep=keep)


def test_a_keep_that_would_keep_nothing_names_the_field_and_the_range(random_kv):
    kv = random_kv(T=40)
    with pytest.raises(ValueError, match=r"random_eviction\.keep=0\.01 keeps .* = 0 of 40 tokens.*0\.025 <= keep <= 1"):
        RandomEviction(keep=0.01).encode(kv, Context.for_kv(kv))


@pytest.mark.parametrize(("overrides", "message"), [
    (["+compressor=streaming_llm", "compressor.sinks=-1"], r"streaming_llm\.sinks=-1 is out of range"),
    (["+compressor=snapkv", "compressor.kernel=4"], r"snapkv\.kernel=4 must be odd"),
    (["+compressor=snapkv", "compressor.window=0"], r"snapkv\.window=0 is out of range"),
    (["+compressor=snapkv", "compressor.pooling=mean"], r"snapkv\.pooling='mean' is not allowed"),
    (["+compressor=h2o", "compressor.recent=2"], r"h2o\.recent=2 is out of range"),
    (["+compressor=h2o", "compressor.normalize=2"], r"h2o\.normalize=2 is not allowed; choose one of \[True, False\]"),
    (["+compressor=tova", "compressor.per_head=maybe"],
     r"tova\.per_head='maybe' is not allowed; choose one of \[True, False\]"),
    (["+compressor=expected_attention", "compressor.future=0"], r"expected_attention\.future=0 is out of range"),
    (["+compressor=expected_attention", "compressor.covariance=2"], r"expected_attention\.covariance=2 is not allowed"),
    (["+compressor=random_eviction", "compressor.seed=-1"], r"random_eviction\.seed=-1 is out of range"),
    (["+compressor=knorm", "compressor.inner=nonesuch"], r"knorm\.inner='nonesuch' is not a compressor config"),
    (["+compressor=knorm", "compressor.inner=pipeline"], r"knorm\.inner='pipeline' cannot code the kept vectors"),
    (["+compressor=knorm", "compressor.inner=streaming_llm"], r"knorm\.inner='streaming_llm' cannot code"),
    (["+compressor=knorm", "compressor.inner=recompute"], r"knorm\.inner='recompute' cannot code"),
])
def test_bad_fields_give_errors_that_name_them(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_compressor(compose(overrides).compressor)


def test_scoring_with_queries_needs_the_model_and_its_tokens(trace, random_kv):
    model, kv, _ = trace
    with pytest.raises(ValueError, match="needs the model in the context"):
        SnapKV(keep=0.5, window=8).encode(kv, Context.for_kv(kv))
    with pytest.raises(ValueError, match="token ids"):
        TOVA(keep=0.5).encode(KVSequence(kv.k, kv.v), Context.for_kv(kv, model))
    other = tiny_llama(seed=1)
    with pytest.raises(ValueError, match="does not reproduce this sequence's keys"):
        TOVA(keep=0.5).encode(kv, Context.for_kv(kv, other))


# ---------------------------------------------------------------------------------------------- scores


def test_recomputed_queries_give_the_models_own_attention(trace):
    _, kv16, _ = trace
    model = tiny_llama()
    model.set_attn_implementation("eager")  # the only implementation that returns attention weights
    got = capture_window(model, kv16.tokens, T, torch.float32)
    kv = KVSequence(got["k"], got["v"], kv16.tokens)
    ctx = Context.for_kv(kv, model)
    sums = attention_sums(capture_queries("test", kv, ctx, 0), kv.k)  # (L, Hq, T)
    with torch.no_grad():
        out = model(kv.tokens.unsqueeze(0), output_attentions=True)
    ref = torch.stack([a[0].sum(1) for a in out.attentions])  # (L, Hq, T) summed over the queries
    torch.testing.assert_close(sums, ref, atol=1e-4, rtol=1e-4)
    last = attention_sums(capture_queries("test", kv, ctx, T - 5), kv.k)  # the last 5 queries only
    ref_last = torch.stack([a[0, :, T - 5 :].sum(1) for a in out.attentions])
    torch.testing.assert_close(last, ref_last, atol=1e-5, rtol=1e-4)


def test_sliding_windows_and_soft_capping_restrict_attention():
    L, Hq, H, n, D = 1, 2, 1, 12, 4
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(L, Hq, n, D, generator=g), torch.randn(L, H, n, D, generator=g)
    got = attention_sums(Queries(q, q, 0, [0.5], [3], [2.0], None), k)
    logits = torch.tanh(q[0] @ k[0].repeat(Hq, 1, 1).transpose(1, 2) * 0.5 / 2.0) * 2.0  # (Hq, n, n)
    i, j = torch.arange(n).unsqueeze(1), torch.arange(n)
    logits = logits.masked_fill(~((j <= i) & (i - j < 3)), -math.inf)
    torch.testing.assert_close(got[0], torch.softmax(logits, -1).sum(1))


@pytest.mark.parametrize("name", ["snapkv", "tova", "h2o", "expected_attention"])
def test_attention_scores_differ_per_kv_head(name, trace):
    _, kv, ctx = trace
    comp = TOVA(keep=0.3, per_head=True) if name == "tova" else METHODS[name]
    scores = comp.scores(kv, ctx)  # (L, H, T)
    kept = comp.kept_mask(kv, ctx)
    assert scores.shape == kv.shape[:3]
    assert not torch.allclose(scores[:, 0], scores[:, 1])
    if name != "h2o":  # on a random tiny model the causal sums of every head favour the same earliest tokens
        assert not torch.equal(kept[:, 0], kept[:, 1])


def test_tova_averages_the_last_querys_attention_over_the_heads_of_a_layer():
    attn = torch.tensor([[[0.1, 0.2, 0.7], [0.3, 0.3, 0.4], [0.6, 0.2, 0.2], [0.0, 0.5, 0.5]]])  # (1, Hq=4, 3)
    got = last_query_scores(attn, 2, per_head=False)  # (1, H=2, 3)
    mean = torch.tensor([(0.1 + 0.3 + 0.6 + 0.0) / 4, (0.2 + 0.3 + 0.2 + 0.5) / 4, (0.7 + 0.4 + 0.2 + 0.5) / 4])
    torch.testing.assert_close(got, mean.expand(1, 2, 3))
    per_head = last_query_scores(attn, 2, per_head=True)  # each KV head's two query heads summed
    torch.testing.assert_close(per_head, torch.tensor([[[0.4, 0.5, 1.1], [0.6, 0.7, 0.7]]]))


def test_tova_keeps_the_same_positions_in_every_kv_head_of_a_layer(trace):
    _, kv, ctx = trace
    comp = TOVA(keep=0.3)
    assert comp.per_head is False
    attn = attention_sums(capture_queries("test", kv, ctx, T - 1), kv.k)  # (L, Hq, T)
    scores = comp.scores(kv, ctx)  # (L, H, T)
    torch.testing.assert_close(scores, attn.mean(1, keepdim=True).expand_as(scores))
    kept = comp.kept_mask(kv, ctx)
    assert (kept == kept[:, :1]).all() and (kept.sum(-1) == round(0.3 * T)).all()
    assert torch.equal(kept, select(scores, round(0.3 * T), 0, 1))


def test_tova_per_head_reproduces_the_per_kv_head_selection(trace):
    _, kv, ctx = trace
    comp = TOVA(keep=0.3, per_head=True)
    earlier = per_kv_head(attention_sums(capture_queries("test", kv, ctx, T - 1), kv.k), kv.shape[1])  # (L, H, T)
    torch.testing.assert_close(comp.scores(kv, ctx), earlier)
    assert torch.equal(comp.kept_mask(kv, ctx), select(earlier, round(0.3 * T), 0, 1))


def test_h2o_normalised_scores_are_the_raw_sums_over_the_number_of_queries_that_see_each_key():
    # T = 4: key i is seen by 4 - i causal queries; the raw sums favour the earliest key, the means do not
    sums = torch.tensor([[[3.0, 2.0, 1.5, 1.0], [1.0, 1.2, 0.5, 0.2]]])  # (1, Hq=2, 4)
    raw = accumulated_scores(sums, 1, normalize=False)  # (1, 1, 4)
    norm = accumulated_scores(sums, 1, normalize=True)
    torch.testing.assert_close(raw, torch.tensor([[[4.0, 3.2, 2.0, 1.2]]]))
    torch.testing.assert_close(norm, torch.tensor([[[3 / 4 + 1 / 4, 2 / 3 + 1.2 / 3, 1.5 / 2 + 0.5 / 2, 1.0 + 0.2]]]))
    torch.testing.assert_close(norm * torch.tensor([4.0, 3.0, 2.0, 1.0]), raw)
    assert raw[0, 0].argmax() == 0 and norm[0, 0].argmax() == 3


def test_h2o_scores_on_a_model_follow_the_normalize_field(trace):
    _, kv, ctx = trace
    sums = attention_sums(capture_queries("test", kv, ctx, 0), kv.k)  # (L, Hq, T)
    raw = H2O(keep=0.3, normalize=False).scores(kv, ctx)
    torch.testing.assert_close(raw, per_kv_head(sums, kv.shape[1]))
    assert H2O(keep=0.3).normalize is True
    torch.testing.assert_close(H2O(keep=0.3).scores(kv, ctx), raw / torch.arange(T, 0, -1, dtype=raw.dtype))


def test_expected_attention_averages_rope_over_the_future_positions(trace):
    from kvbench.core.rope import Rotary

    model, kv, ctx = trace
    comp = ExpectedAttention(future=1)
    qs = capture_queries("test", kv, ctx, 70)
    D = kv.shape[-1]
    x = torch.randn(kv.shape[0], 1, 1, D)  # (L, 1, 1, D)
    M = comp._mean_rotation(qs, T, D)  # one future position: exactly RoPE at position T
    torch.testing.assert_close(torch.einsum("lhtd,lde->lhte", x, M), Rotary(model.config).apply(x, T))
    M4 = ExpectedAttention(future=4)._mean_rotation(qs, T, D)
    mean = torch.stack([Rotary(model.config).apply(x, T + i) for i in range(4)]).mean(0)
    torch.testing.assert_close(torch.einsum("lhtd,lde->lhte", x, M4), mean)


def test_snapkv_scores_are_the_window_attention_averaged_as_the_reference_pools_it(trace):
    _, kv, ctx = trace
    comp = SnapKV(keep=0.3, window=8, kernel=3)
    assert comp.pooling == "avg"
    qs = capture_queries("test", kv, ctx, T - 8)
    attn = attention_sums(qs, kv.k)[..., : T - 8]  # (L, Hq, T - 8)
    # kvpress's SnapKVPress: the window's mean attention, averaged over the kernel with the padded edges counted as
    # zeros, averaged over each KV head's query heads; its scale differs, its order does not
    L = kv.shape[0]
    mean = attn / 8
    padded = torch.nn.functional.pad(mean, (1, 1))  # zeros at both edges
    pooled = (padded[..., :-2] + padded[..., 1:-1] + padded[..., 2:]) / 3  # (L, Hq, T - 8)
    reference = pooled.reshape(L, 2, 2, T - 8).mean(2)  # two query heads per KV head
    got = comp.scores(kv, ctx)[..., : T - 8]
    torch.testing.assert_close(got, reference * 8 * 2)
    k = n_kept("snapkv", 0.3, T)
    assert torch.equal(comp.kept_mask(kv, ctx), select(torch.nn.functional.pad(reference, (0, 8)), k, 0, 8))
    # the edges are averaged over the padding: an average over real neighbours only would differ there
    real = torch.nn.functional.avg_pool1d(mean.reshape(-1, 1, T - 8), 3, 1, 1, count_include_pad=False)
    assert not torch.allclose(got[..., 0], real.reshape(L, 4, T - 8).reshape(L, 2, 2, T - 8).sum(2)[..., 0] * 8)


def test_snapkv_max_pooling_is_a_variant(trace):
    _, kv, ctx = trace
    comp = SnapKV(keep=0.3, window=8, kernel=3, pooling="max")
    attn = attention_sums(capture_queries("test", kv, ctx, T - 8), kv.k)[..., : T - 8]  # (L, Hq, T - 8)
    pooled = torch.nn.functional.max_pool1d(attn.reshape(-1, 1, T - 8), 3, 1, 1).reshape(attn.shape)
    expect = pooled.reshape(kv.shape[0], 2, 2, T - 8).sum(2)  # two query heads per KV head
    torch.testing.assert_close(comp.scores(kv, ctx)[..., : T - 8], expect)


def test_the_kept_count_is_the_reference_floor_and_h2o_keeps_no_recent_window_by_default(trace):
    # kvpress keeps int(T * (1 - compression_ratio)) tokens
    assert [n_kept("x", 0.5, t) for t in (255, 256, 257)] == [int(t * (1 - 0.5)) for t in (255, 256, 257)]
    assert n_kept("x", 0.3, 10) == 3 and n_kept("x", 0.7, 10) == 7  # not 2 and 6 for 0.3 x 10 = 2.9999...
    with pytest.raises(ValueError, match=r"keeps floor\(0.001 x 256\) = 0 of 256 tokens per head"):
        n_kept("x", 0.001, 256)
    _, kv, ctx = trace
    assert H2O().recent == 0.0 and H2O(keep=0.3).protected(T, 24) == (0, 0)
    kept = H2O(keep=0.3).kept_mask(kv, ctx)
    assert torch.equal(kept, select(H2O(keep=0.3).scores(kv, ctx), n_kept("h2o", 0.3, T)))


def test_a_run_counts_positions_and_reports_the_dropped_share(tiny_cfg, tiny_handle):
    from kvbench.measure.run import measure

    for overrides in (["+compressor=snapkv", "compressor.window=8"], ["+compressor=random_eviction"]):
        cfg = tiny_cfg(*overrides, "compressor.keep=0.25")
        summary, _ = measure(cfg, make_compressor(cfg.compressor), tiny_handle)
        assert summary["dropped_fraction"] == pytest.approx(0.75)
        assert summary["bits_by_part"]["positions"] > 0
        assert 3.3 < summary["compression_ratio"] < 4.0
        assert summary["rel_mse_k"] == 0.0 and summary["lossless"] is False


def _tiny_gemma(sliding_window: int, kv_heads: int = 1):
    model = tiny_arch("gemma3", num_hidden_layers=3, num_key_value_heads=kv_heads, head_dim=32,
                      sliding_window=sliding_window,
                      layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    model.set_attn_implementation("eager")
    return model


def test_queries_of_a_model_with_qk_norm_sliding_layers_and_its_own_scale_give_its_attention():
    model = _tiny_gemma(16)
    ids = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(1))
    got = capture_window(model, ids, 60, torch.float32)
    kv = KVSequence(got["k"], got["v"], ids)
    qs = capture_queries("test", kv, Context.for_kv(kv, model), 0)
    assert qs.sliding == [16, 16, None] and qs.scaling == [24**-0.5] * 3
    with torch.no_grad():
        out = model(ids.unsqueeze(0), output_attentions=True)
    ref = torch.stack([a[0].sum(1) for a in out.attentions])  # (L, Hq, T)
    torch.testing.assert_close(attention_sums(qs, kv.k), ref, atol=1e-5, rtol=1e-4)


def test_expected_attention_gives_keys_outside_every_future_window_nothing_and_leaves_full_layers_alone():
    model = _tiny_gemma(16, kv_heads=4)  # one query head per KV head: each softmax is renormalised on its own
    ids = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(1))
    got = capture_window(model, ids, 60, torch.float32)
    kv = KVSequence(got["k"], got["v"], ids)
    ctx = Context.for_kv(kv, model)
    aware = ExpectedAttention(keep=0.25, sinks=2, future=8, value_norm=False).scores(kv, ctx)  # (L, H, T)
    blind = ExpectedAttention(keep=0.25, sinks=2, future=8, value_norm=False, sliding=False).scores(kv, ctx)
    # a key t is seen by a future query p in [60, 68) iff p - t < 16: t >= 45 by the first, t >= 53 by all
    assert (aware[:2, :, :45] == 0).all() and (aware[:2, :, 45:] > 0).all()
    share = ((torch.arange(45, 60) + 16 - 60).clamp(max=8) / 8).float()  # (15,) of the 8 future queries
    ratio = aware[:2, :, 45:] / blind[:2, :, 45:]  # the renormalised softmax times each key's share
    torch.testing.assert_close(ratio / ratio[..., -1:], (share / share[-1]).expand_as(ratio))
    torch.testing.assert_close(aware[2], blind[2])  # the full-attention layer is as before
    kept = ExpectedAttention(keep=0.25, sinks=2, future=8).kept_mask(kv, ctx)  # (L, H, T) 15 entries each
    assert not kept[:2, :, 2:45].any()  # the local layers spend nothing outside the window but the sinks


# ---------------------------------------------------------------------------------------------- in the loop


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_runs_in_the_task_loop_and_the_decode_loop_with_its_entries_hidden(name, trace):
    """Scores and greedy text through the compressed cache (lm-eval's requests), and the latency loop; the cache
    holds fewer bytes than the 16-bit one and attention sees only the kept entries."""
    from conftest import ByteTokenizer
    from lm_eval.api.instance import Instance
    from omegaconf import OmegaConf

    from kvbench.cache.compressed import CompressedCache
    from kvbench.inputs.models import ModelHandle
    from kvbench.measure.evaluation.lm import CompressedKVLM
    from kvbench.measure.latency import run_once

    model = trace[0]
    comp = METHODS[name]
    handle = ModelHandle.from_loaded(model, ByteTokenizer(), OmegaConf.create({"name": "tiny", "source": "hf", "path": "x"}))
    lm = CompressedKVLM(handle, comp, residual=0, progress=False)
    ctx_text = "the pass key is 4711. remember it. " * 3
    (scored,) = lm.loglikelihood([Instance("loglikelihood", {}, (ctx_text, " 4711"), 0)])
    base = lm.baseline[("ll", ctx_text, " 4711")]
    assert math.isfinite(scored[0]) and scored[0] != base[0]
    gen = Instance("generate_until", {}, (ctx_text, {"until": ["\n"], "max_gen_toks": 4}), 1)
    assert isinstance(lm.generate_until([gen])[0], str)
    assert lm.accounting["compressed_tokens"] > 0

    ids = trace[1].tokens[:64].unsqueeze(0)
    cache = CompressedCache(comp, residual=8, chunk=1 << 20, model=handle)
    row = run_once(model, ids, cache, 3, "cpu")
    assert row["bytes_held"] < 0.6 * 2 * 2 * 2 * 67 * 16 * 2  # K and V, 2 layers, 2 heads, 16 dims, float16
    kept = cache.kept_mask(0)  # (H, tokens held): the window and the fed tokens are all visible
    assert kept is not None and not bool(kept.all()) and bool(kept[:, -10:].all())
