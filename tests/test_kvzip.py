"""KVzip: its scores are the maximum attention the model's reconstruction of its own context pays each entry
(checked against the model's own attention weights on the context and the reconstruction fed in one pass), the
reconstruction input is the reference's prompt as the tokenizer's ids, the selection is head-wise over the whole
cache, and the scoring pass is the encoder's cost."""

from types import SimpleNamespace

import pytest
import torch
from conftest import ARCHITECTURES, CharTokenizer, tiny_arch, tiny_llama

from compressors.eviction.evict import n_kept
from compressors.eviction.kvzip import KVzip
from compressors.eviction.reconstruction import (
    NO_PROMPT,
    REPEAT,
    REPEAT_PART,
    chunk_bounds,
    reconstruction_scores,
    repeat_prompt,
)
from kvbench.coding.bitstream import Bitstream
from kvbench.core.codec import decoder_for, state_bytes
from kvbench.core.config import compose, make_compressor
from kvbench.core.flops import prefill_flops_per_token
from kvbench.core.kv import Context, KVSequence
from kvbench.inputs.capture import capture_window

T = 72


def _tiny_gemma():
    return tiny_arch("gemma3", num_hidden_layers=3, num_key_value_heads=2, head_dim=32, sliding_window=24,
                     layer_types=["sliding_attention", "sliding_attention", "full_attention"])


def _case(model, n=T, seed=3, sharpen=1.0):
    """``model`` in eager attention (the one that returns its weights), its float32 cache of ``n`` random ids, and
    a context with a byte tokenizer. ``sharpen`` multiplies every layer's logit scale: a random tiny model's
    attention is so flat that most entries' maximum comes from the reconstruction's first query, which has seen
    only one token of it; sharpened, the maxima fall all over the reconstruction and depend on its whole input."""
    model.set_attn_implementation("eager")
    for layer in model.model.layers:
        layer.self_attn.scaling *= sharpen
    ids = torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))
    got = capture_window(model, ids, n, torch.float32)
    kv = KVSequence(got["k"], got["v"], ids)
    return kv, Context.for_kv(kv, SimpleNamespace(model=model, tokenizer=CharTokenizer()))


def _brute_force(model, kv, chunk_size, sinks):
    """The reference's score computed from the model's own attention: for each chunk, the context and its
    reconstruction input in one forward pass; the reconstruction's rows of every layer's attention, restricted to
    the sinks, the chunk and the reconstruction (renormalised: the reference softmaxes over those keys only), then
    the maximum over the rows and the query heads of each KV head."""
    tok = CharTokenizer()
    ids = kv.tokens
    L, H, n, _ = kv.shape
    out = torch.zeros(L, H, n)
    for i, (start, end) in enumerate(chunk_bounds(n, chunk_size)):
        if i == 0:
            prompt = tok(REPEAT).input_ids
        else:
            prompt = tok(REPEAT_PART).input_ids + ids[max(0, start - 8) : start].tolist()
        repeat = torch.tensor(prompt + tok("\n").input_ids + ids[start:end].tolist())
        with torch.no_grad():
            att = model(torch.cat([ids, repeat]).unsqueeze(0), output_attentions=True).attentions
        sink = min(sinks, start)
        cols = torch.cat([torch.arange(sink), torch.arange(start, end), n + torch.arange(repeat.numel())])
        for layer, a in enumerate(att):
            rows = a[0, :, n:][:, :, cols]  # (Hq, R, S)
            rows = rows / rows.sum(-1, keepdim=True)
            best = rows[..., sink : sink + end - start].amax(1)  # (Hq, c)
            out[layer, :, start:end] = best.reshape(H, -1, end - start).amax(1)
    return out


@pytest.mark.parametrize("chunk_size", [T, 32])  # one chunk; three, the later ones after the previous 8 tokens
@pytest.mark.parametrize("family", ["gemma", *ARCHITECTURES])  # and every architecture conftest builds
def test_scores_are_the_max_attention_of_the_reconstruction_as_the_model_computes_it(family, chunk_size):
    model = _tiny_gemma() if family == "gemma" else tiny_arch(family)  # gemma: sliding windows, q/k norms, own scale
    kv, ctx = _case(model, sharpen=16.0)
    prompt = repeat_prompt(ctx.model.tokenizer)
    got = reconstruction_scores("test", kv, ctx, prompt, chunk_size, sinks=4)
    torch.testing.assert_close(got, _brute_force(model, kv, chunk_size, 4), atol=2e-5, rtol=1e-4)
    if family == "gemma":  # a local layer's reconstruction cannot see an entry older than its window: it scores 0
        assert (got[:2, :, : T - 24] == 0).all() and (got[2] > 0).all()


def test_the_prompt_is_the_references_in_the_tokenizers_ids_with_the_templates_assistant_opening():
    class Templated(CharTokenizer):
        chat_template = "{user}"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize, enable_thinking):
            assert add_generation_prompt and not tokenize
            return f"<u>{messages[0]['content']}</u><a>"

    tok = CharTokenizer()
    plain = repeat_prompt(tok)
    assert plain.first == tuple(tok(REPEAT).input_ids) and plain.later == tuple(tok(REPEAT_PART).input_ids)
    assert plain.suffix == tuple(tok("\n").input_ids) and plain.from_tokenizer
    assert repeat_prompt(Templated()).suffix == tuple(tok("</u><a>").input_ids)
    ids = torch.arange(100)
    later = plain.ids(ids, 40, 60)
    assert later.tolist() == list(plain.later) + list(range(32, 40)) + list(plain.suffix) + list(range(40, 60))
    assert plain.length(40, 60) == later.numel() and NO_PROMPT.ids(ids, 0, 10).tolist() == list(range(10))


def test_without_a_tokenizer_the_chunk_alone_is_fed_again_and_the_stats_say_so():
    model = tiny_llama()
    kv, _ = _case(model)
    comp = KVzip(keep=0.5)
    ctx = Context.for_kv(kv, SimpleNamespace(model=model, tokenizer=None))
    assert torch.equal(comp.scores(kv, ctx), reconstruction_scores("t", kv, ctx, NO_PROMPT, 2048, 4))
    assert comp.stats()["repeat_prompt_missing"] == 1.0
    assert "without a tokenizer" in " ".join(comp.facts(T)["deviations"])


@pytest.mark.parametrize("layerwise", [False, True])
def test_selection_is_head_wise_over_the_whole_cache_or_each_layer_with_the_sinks_kept(layerwise):
    model = tiny_llama()
    kv, ctx = _case(model, n=96)
    comp = KVzip(keep=0.25, layerwise=layerwise)
    scores = comp.scores(kv, ctx)  # (L, H, T)
    bs = comp.encode(kv, ctx)
    out = decoder_for(comp, state_bytes(comp)).decode(Bitstream.from_bytes(bs.data), Context.for_kv(kv))
    L, H, n = scores.shape
    k = n_kept("kvzip", 0.25, n)
    ranked = scores.clone()
    ranked[..., :4] = float("inf")  # the sinks first
    flat = ranked.reshape(L, -1) if layerwise else ranked.reshape(1, -1)
    top = flat.topk(H * k if layerwise else L * H * k, dim=1).indices
    want = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, top, True).reshape(L, H, n)
    assert torch.equal(out.kept, want) and out.kept[..., :4].all()
    assert int(out.kept.sum()) == L * H * k
    if layerwise:
        assert (out.kept.sum((1, 2)) == H * k).all()
    assert len(set(out.kept.sum(-1).flatten().tolist())) > 1  # heads keep what their scores earn
    assert torch.equal(out.k[out.kept], kv.k[out.kept]) and (out.k[~out.kept] == 0).all()


def test_the_scoring_pass_is_the_encoders_time_and_its_flops(tiny_cfg, tiny_handle):
    from kvbench.measure.run import measure

    cfg = tiny_cfg("+compressor=kvzip", "compressor.keep=0.25", "metrics.nll=false")
    comp = make_compressor(cfg.compressor)
    summary, _ = measure(cfg, comp, tiny_handle)
    stats = summary["compressor_stats"]
    assert stats["repeat_prompt_missing"] == 0.0 and 0 < stats["score_s"] <= summary["encode_s"]
    assert summary["decode_flops_per_token"] == 0.0
    config = tiny_handle.model.config
    n = 64  # dataset.seq_len
    prefill = prefill_flops_per_token(config, n, head=False)
    # the context fed again (with the prompt) after itself: more than one prefill of it, less than three
    assert 1.0 * prefill < summary["encode_flops_per_token"] == comp.encode_flops_per_token(config, n) < 3 * prefill
    assert summary["compressor_facts"]["deviations"] and summary["dropped_fraction"] == pytest.approx(0.75)


@pytest.mark.parametrize(("overrides", "message"), [
    (["compressor.chunk_size=0"], r"kvzip\.chunk_size=0 is out of range"),
    (["compressor.layerwise=2"], r"kvzip\.layerwise=2 is not allowed"),
    (["+compressor.inner=turboquant"], r"kvzip\.inner='turboquant': kvzip's layers and heads keep different"),
    (["compressor.keep_tokens=8"], r"kvzip: give exactly one of keep .* and keep_tokens"),
])
def test_bad_fields_name_themselves(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_compressor(compose(["+compressor=kvzip", *overrides]).compressor)


def test_a_model_that_did_not_make_the_cache_is_refused():
    kv, _ = _case(tiny_llama())
    with pytest.raises(ValueError, match="does not reproduce this sequence's keys"):
        KVzip(keep=0.5).encode(kv, Context.for_kv(kv, SimpleNamespace(model=tiny_llama(seed=1), tokenizer=None)))
