"""Budget rules over any eviction method's scores: AdaKV (a layer's heads share its budget) and PyramidKV (budgets
falling with depth), each checked against kvpress 0.5.5's selection rule re-implemented from its source, and what
their streams carry (every row's count, exact)."""

from dataclasses import dataclass

import pytest
import torch
from conftest import tiny_llama

from compressors.eviction.adakv import AdaKV, safeguard
from compressors.eviction.evict import Eviction, n_kept
from compressors.eviction.kept_positions import PER_ROW
from compressors.eviction.pyramidkv import PyramidKV, pyramid_budgets
from kvbench.coding.bitstream import Bitstream, read_varints
from kvbench.core.codec import decoder_for, state_bytes
from kvbench.core.config import compose, make_compressor
from kvbench.core.kv import Context, KVSequence
from kvbench.inputs.capture import capture_window


@dataclass
class _Given(Eviction):
    """Scores fixed in advance (``given``), the last ``window`` tokens protected: a scorer for the rules."""

    window: int = 0

    name = "given_test"

    def scores(self, kv, ctx):
        return self.given


def _given(scores, window=0, **fields):
    scorer = _Given(window=window, **fields)
    scorer.given = scores
    return scorer


def _rule(cls, scores, window=0, **fields):
    return cls(scorer=_given(scores, window), **fields)


def _kept(rule, scores):
    L, H, T = scores.shape
    kv = KVSequence(torch.zeros(L, H, T, 4, dtype=torch.float16), torch.zeros(L, H, T, 4, dtype=torch.float16))
    return rule.kept_mask(kv, Context.for_kv(kv))


def _random_scores(L, H, T, seed):
    return torch.rand(L, H, T, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- the reference


def kvpress_adakv(scores: torch.Tensor, compression_ratio: float, alpha: float, window: int = 0) -> torch.Tensor:
    """kvpress 0.5.5 ``AdaKVPress.compress`` (kvpress/presses/adakv_press.py; kvpress-0.5.5-py3-none-any.whl,
    sha256 900bdb175b546f19c844a8d40e9e7bc6bff7f302689821263d376e31ff62f07e, released after NVIDIA/kvpress commit
    8bb29b9c3078452a86d692f29123fa6c793e2b05, whose adakv_press.py lacks the safeguard's floor of 1), layer by layer
    as its forward hook runs it, on the same scores. SnapKVPress's observation window scores its layer's maximum
    (``F.pad(scores, (0, window_size), value=scores.max().item())``). Returns the kept ``(L, H, T)`` mask."""
    kept = []
    for layer_scores in scores:  # one module at a time, batch of one
        s = layer_scores.unsqueeze(0).clone()  # (1, H, T)
        if window:
            s[..., -window:] = s[..., :-window].max()
        bsz, num_key_value_heads, k_len = s.shape
        n_kept = max(1, int(k_len * (1 - compression_ratio)))  # kvpress.utils.compute_n_kept
        n_safe = int(n_kept * alpha)
        if alpha > 0:
            n_safe = max(1, n_safe) if n_kept > 0 else 0
        top_indices = torch.topk(s, n_safe, dim=-1).indices
        s.scatter_(-1, top_indices, torch.finfo(s.dtype).max)
        n_pruned = num_key_value_heads * (k_len - n_kept)
        indices = torch.topk(-s.reshape(bsz, -1), n_pruned, dim=1).indices.flatten()
        mask = torch.ones(num_key_value_heads * k_len, dtype=torch.bool)
        mask[indices] = False  # masked_key_indices: the pruned (head, position) pairs
        kept.append(mask.reshape(num_key_value_heads, k_len))
    return torch.stack(kept)


def kvpress_layer_budget(layer_idx: int, num_hidden_layers: int, q_len: int, compression_ratio: float,
                         window_size: int, beta: int) -> int:
    """kvpress 0.5.5 ``PyramidKVPress.get_layer_budget`` (kvpress/presses/pyramidkv_press.py, same wheel), in its
    floating-point arithmetic."""
    max_capacity_prompt = window_size + q_len * (1 - compression_ratio)
    min_num = (max_capacity_prompt - window_size) / beta
    max_num = (max_capacity_prompt - window_size) * 2 - min_num
    if max_num >= q_len - window_size:
        max_num = q_len - window_size
        min_num = (max_capacity_prompt - window_size) * 2 - max_num
    if not (q_len >= max_num >= min_num >= window_size):
        return max(1, round(q_len * (1 - compression_ratio)))
    steps = (max_num - min_num) / (num_hidden_layers - 1) if num_hidden_layers > 1 else 0.0
    value = max_num - layer_idx * steps
    assert abs(value - round(value)) != 0.5 and abs(abs(value - round(value)) - 0.5) > 1e-9  # no rounding tie here
    return round(value)


def kvpress_pyramidkv(scores: torch.Tensor, compression_ratio: float, window: int, beta: int) -> torch.Tensor:
    """``PyramidKVPress.compress``: SnapKV's scores (window at the layer's maximum), each head's top
    ``get_layer_budget`` entries."""
    L, H, T = scores.shape
    kept = torch.zeros(L, H, T, dtype=torch.bool)
    for layer in range(L):
        s = scores[layer].clone()
        if window:
            s[..., -window:] = s[..., :-window].max()
        n = kvpress_layer_budget(layer, L, T, compression_ratio, window, beta)
        kept[layer].scatter_(-1, s.topk(n, dim=-1).indices, True)
    return kept


@pytest.mark.parametrize(("keep", "alpha", "window", "seed"),
                         [(0.25, 0.2, 0, 0), (0.5, 0.2, 8, 1), (0.125, 0.0, 0, 2), (0.25, 1.0, 4, 3), (0.5, 0.05, 0, 4),
                          (0.125, 0.05, 0, 5)])  # int(16 * 0.05) = 0: the safeguard's floor of one
def test_adakv_keeps_the_entries_kvpress_adakvpress_keeps_on_the_same_scores(keep, alpha, window, seed):
    scores = _random_scores(5, 4, 128, seed)
    scores[:, 0] *= 0.1  # a head whose scores all lose to the others': only the safeguard keeps any of it
    got = _kept(_rule(AdaKV, scores, window, keep=keep, alpha_safeguard=alpha), scores)
    assert torch.equal(got, kvpress_adakv(scores, 1 - keep, alpha, window))
    n = n_kept("adakv", keep, 128)
    assert (got[:, 0].sum(-1) == max(window, safeguard(n, alpha))).all()


@pytest.mark.parametrize(("keep", "alpha", "window", "seed"), [(0.25, 0.2, 0, 6), (0.5, 0.2, 8, 7), (0.125, 1.0, 4, 8)])
def test_adakv_with_one_kv_head_per_layer_keeps_what_the_uniform_budget_keeps(keep, alpha, window, seed):
    """A layer with a single KV head (gemma-3's MQA) has no heads to share its budget between: AdaKV's selection is
    the scorer's own uniform one, whatever the safeguard (the eviction study's gemma cells rest on this)."""
    scores = _random_scores(6, 1, 128, seed)
    assert torch.equal(_kept(_rule(AdaKV, scores, window, keep=keep, alpha_safeguard=alpha), scores),
                       _kept(_given(scores, window, keep=keep), scores))


@pytest.mark.parametrize(("L", "T", "keep", "window", "beta"), [
    (5, 512, 0.5, 16, 8),  # the pyramid: 480, 368, 256, 144, 32
    (7, 512, 0.75, 16, 8),  # the first layer capped at T - window, the last raised to keep the mean
    (6, 512, 0.25, 16, 20),  # 128 / 20 < 16: kvpress falls back to a uniform budget
    (4, 256, 0.25, 0, 3),  # no observation window (a scorer without one)
])
def test_pyramidkv_keeps_the_entries_kvpress_pyramidkvpress_keeps_on_the_same_scores(L, T, keep, window, beta):
    scores = _random_scores(L, 2, T, L + T)
    rule = _rule(PyramidKV, scores, window, keep=keep, beta=beta)
    assert torch.equal(_kept(rule, scores), kvpress_pyramidkv(scores, 1 - keep, window, beta))
    assert rule.budgets(L, 2, T)[:, 0].tolist() == [kvpress_layer_budget(i, L, T, 1 - keep, window, beta)
                                                   for i in range(L)]


# ---------------------------------------------------------------------------------------------- budgets


def test_pyramid_budgets_fall_with_depth_and_sum_to_the_uniform_total():
    for L, T, n, w, beta in [(5, 512, 256, 16, 8), (30, 2048, 512, 0, 20), (24, 4096, 1536, 64, 20), (7, 100, 33, 3, 5)]:
        b = pyramid_budgets(L, T, n, w, beta)
        assert sum(b) == L * n and all(x >= y for x, y in zip(b, b[1:])) and b[0] > b[-1] >= max(w, 1)
    assert pyramid_budgets(5, 512, 128, 16, 20) == [128] * 5  # the window does not fit the last layer
    assert pyramid_budgets(1, 512, 256, 0, 8) == [256]
    assert pyramid_budgets(4, 64, 8, 0, 20) == [8] * 4  # the last layer would round to nothing


def test_pyramidkv_on_the_tiny_model_keeps_fewer_entries_deeper_and_the_same_total():
    model = tiny_llama(layers=4)
    ids = torch.randint(0, 128, (128,), generator=torch.Generator().manual_seed(1))
    got = capture_window(model, ids, 128, torch.float16)
    kv = KVSequence(got["k"], got["v"], ids)
    ctx = Context.for_kv(kv, model)
    comp = make_compressor(compose(["+compressor=pyramidkv", "compressor.scorer={name:snapkv,window:4}",
                                    "compressor.beta=4", "compressor.keep=0.25"]).compressor)
    assert comp.pyramid_window(128) == 4  # the scorer's observation window
    out = decoder_for(comp, state_bytes(comp)).decode(Bitstream.from_bytes(comp.encode(kv, ctx).data), Context.for_kv(kv))
    per_layer = out.kept.sum(-1)  # (L, H)
    assert (per_layer == per_layer[:, :1]).all()  # the heads of a layer keep its budget each
    assert per_layer[:, 0].tolist() == [56, 40, 24, 8] and int(per_layer.sum()) == 4 * 2 * n_kept("p", 0.25, 128)
    assert out.kept[..., -4:].all()  # SnapKV's window in every layer
    assert torch.equal(out.k[out.kept], kv.k[out.kept])


def test_adakv_on_the_tiny_model_shares_each_layers_budget_between_its_heads():
    model = tiny_llama()
    ids = torch.randint(0, 128, (96,), generator=torch.Generator().manual_seed(2))
    got = capture_window(model, ids, 96, torch.float16)
    kv = KVSequence(got["k"], got["v"], ids)
    ctx = Context.for_kv(kv, model)
    comp = make_compressor(compose(["+compressor=adakv", "compressor.scorer=expected_attention",
                                    "compressor.keep=0.25"]).compressor)
    bs = comp.encode(kv, ctx)
    out = decoder_for(comp, state_bytes(comp)).decode(Bitstream.from_bytes(bs.data), Context.for_kv(kv))
    k = n_kept("adakv", 0.25, 96)
    per_head = out.kept.sum(-1)  # (L, H)
    assert (per_head.sum(1) == 2 * k).all() and not (per_head == k).all()
    assert (per_head >= 4 + safeguard(k, 0.2)).all()  # expected attention's 4 sinks, then the safeguard
    assert out.kept[..., :4].all() and torch.equal(out.v[out.kept], kv.v[out.kept])
    # the stream carries every row's count: the decoder rebuilt them from it alone
    (top, flag, *counts), _ = read_varints(Bitstream.from_bytes(bs.data).sections()["header"], 2 + per_head.numel())
    assert flag & PER_ROW and counts == per_head.flatten().tolist() and top == max(counts)


@pytest.mark.parametrize("inner", ["{name:fp8}", "{name:kivi,bits:4,group_size:8,residual:4}"])
def test_rows_of_unequal_counts_code_each_row_as_the_inner_coder_codes_it_alone(inner):
    """AdaKV's kept KV through a per-vector coder: each (layer, KV head)'s kept entries decode as the inner coder
    decodes that row coded by itself, and the stream counts every row's inner stream, frames included."""
    from kvbench.core.compressor import rebuild

    L, H, T, D = 3, 2, 48, 16
    g = torch.Generator().manual_seed(5)
    kv = KVSequence(torch.randn(L, H, T, D, generator=g).half(), torch.randn(L, H, T, D, generator=g).half())
    comp = make_compressor(compose(["+compressor=adakv", "compressor.scorer=knorm", "compressor.keep=0.5",
                                    f"+compressor.inner={inner}"]).compressor)
    ctx = Context(L, H, T, D, torch.float16)
    bs = comp.encode(kv, ctx)
    out = decoder_for(comp, state_bytes(comp)).decode(Bitstream.from_bytes(bs.data), ctx)
    counts = out.kept.sum(-1)  # (L, H)
    assert not (counts == counts[0, 0]).all()  # the rows keep unequal counts
    alone, inner_bits = rebuild(comp.inner), 0
    for layer in range(L):
        for head in range(H):
            row = out.kept[layer, head]  # (T,)
            sub = KVSequence(kv.k[layer, head, row][None, None], kv.v[layer, head, row][None, None])
            one = alone.encode(sub, Context(1, 1, int(row.sum()), D, torch.float16))
            back = alone.decode(one, Context(1, 1, int(row.sum()), D, torch.float16))
            assert torch.equal(out.k[layer, head, row], back.k[0, 0].half())
            assert torch.equal(out.v[layer, head, row], back.v[0, 0].half())
            inner_bits += one.num_bits
    sections = Bitstream.from_bytes(bs.data).parts
    assert sum(n for name, n in sections.items() if name.startswith("inner/")) == inner_bits
    assert not torch.equal(out.k[out.kept], kv.k[out.kept])  # coded, not 16-bit
    with pytest.raises(Exception, match="checksum|corrupt"):
        damaged = bytearray(bs.data)
        damaged[len(damaged) // 2] ^= 0xFF
        comp.decode(Bitstream.from_bytes(bytes(damaged)), ctx)


@pytest.mark.parametrize("cls", [AdaKV, PyramidKV])
def test_keep_tokens_gives_the_rules_what_the_same_fraction_gives(cls):
    scores = _random_scores(4, 3, 160, 9)
    by_share = _kept(_rule(cls, scores, 4, keep=0.25, **({"beta": 4} if cls is PyramidKV else {})), scores)
    by_count = _kept(_rule(cls, scores, 4, keep=None, keep_tokens=40, **({"beta": 4} if cls is PyramidKV else {})),
                     scores)
    assert torch.equal(by_share, by_count) and int(by_count.sum()) == 4 * 3 * 40


def test_the_rule_takes_the_budget_and_the_scorer_keeps_its_own_fields():
    comp = make_compressor(compose(["+compressor=adakv", "compressor.scorer={name:snapkv,window:8,keep:0.9}",
                                    "compressor.keep=0.25"]).compressor)
    assert comp.scorer.keep == 0.25 and comp.scorer.window == 8 and comp.needs_model
    assert comp.label() == "adakv (snapkv)" and comp.facts(256)["scorer"] == "snapkv"
    assert comp.facts(256)["always_kept"] == "8 last" and comp.facts(256)["deviations"]
    assert not make_compressor(compose(["+compressor=pyramidkv", "compressor.scorer=knorm"]).compressor).needs_model


@pytest.mark.parametrize(("overrides", "message"), [
    (["+compressor=adakv", "compressor.alpha_safeguard=1.5"], r"adakv\.alpha_safeguard=1.5 is out of range"),
    (["+compressor=adakv", "compressor.scorer=turboquant"], r"adakv\.scorer='turboquant' is not an eviction method"),
    (["+compressor=adakv", "compressor.scorer=pyramidkv"], r"adakv\.scorer='pyramidkv' is not an eviction method"),
    (["+compressor=adakv", "compressor.scorer=nonesuch"], r"adakv\.scorer='nonesuch' is not a compressor config"),
    (["+compressor=adakv", "compressor.scorer={name:knorm,inner:turboquant}"],
     r"adakv\.scorer='knorm' has inner='turboquant'.*inner=null"),
    (["+compressor=pyramidkv", "+compressor.inner=turboquant"],
     r"pyramidkv\.inner='turboquant': pyramidkv's layers.*only a coder that fits nothing.*fp8, kivi"),
    (["+compressor=adakv", "+compressor.inner={name:kvtc,bits:2}"], r"adakv\.inner='kvtc'.*only a coder that fits"),
    (["+compressor=pyramidkv", "compressor.beta=0"], r"pyramidkv\.beta=0 is out of range"),
    (["+compressor=pyramidkv", "compressor.window_size=-1"], r"pyramidkv\.window_size=-1 is out of range"),
    (["+compressor=pyramidkv", "compressor.keep_tokens=64"], r"pyramidkv: give exactly one of keep .* keep_tokens"),
])
def test_bad_fields_give_one_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_compressor(compose(overrides).compressor)


@pytest.mark.parametrize("name", ["adakv", "pyramidkv", "kvzip"])
def test_rows_of_different_counts_run_in_the_task_loop_and_the_decode_loop(name):
    """lm-eval's requests through the compressed cache and the latency loop, with each head's own entries hidden."""
    from conftest import ByteTokenizer
    from lm_eval.api.instance import Instance
    from omegaconf import OmegaConf

    from kvbench.cache.compressed import CompressedCache
    from kvbench.inputs.models import ModelHandle
    from kvbench.measure.evaluation.lm import CompressedKVLM
    from kvbench.measure.latency import run_once

    model = tiny_llama()
    comp = make_compressor(compose([f"+compressor={name}", "compressor.keep=0.3"] + (
        [] if name == "kvzip" else ["compressor.scorer={name:snapkv,window:8}"])).compressor)
    handle = ModelHandle.from_loaded(model, ByteTokenizer(), OmegaConf.create({"name": "tiny", "source": "hf", "path": "x"}))
    lm = CompressedKVLM(handle, comp, residual=0, progress=False)
    text = "the pass key is 4711. remember it. " * 3
    (scored,) = lm.loglikelihood([Instance("loglikelihood", {}, (text, " 4711"), 0)])
    assert scored[0] != lm.baseline[("ll", text, " 4711")][0] and lm.accounting["compressed_tokens"] > 0
    ids = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(0)).unsqueeze(0)
    cache = CompressedCache(comp, residual=8, chunk=1 << 20, model=handle)
    run_once(model, ids, cache, 3, "cpu")
    kept = cache.kept_mask(0)  # (H, tokens held)
    assert kept is not None and not bool(kept.all()) and bool(kept[:, -10:].all())
