"""Every architecture a user is likely to bring, on a tiny random model of each built from its config (conftest's
:data:`ARCHITECTURES`): Llama (GQA), an MHA Llama, Mistral (a sliding window on every layer), Qwen 2 (q/k/v biases),
Qwen 3 (QK-norm), Gemma 3 (QK-norm, a local and a global layer, one KV head, its own logit scale), Phi-3 (a fused
``qkv_proj``, a sliding window on every layer, partial RoPE) and OLMo 2 (QK-norm over all heads at once).

On each: the captured KV is the model's own cache and its pre-RoPE keys rotate back to it; the queries the harness
reads off the attention modules give the model's own attention (what every attention-scoring eviction method and
the attention-error metric rest on: kvpress #76, QK-norm broke SnapKV there); every compressor config passes the
contract suite on the model's cache; the attention-error metric reads the model's attention and is 0 on the exact
cache; the task loss on a decoded exact cache is the model's own NLL; a run measures the next-token loss, the
attention error and the recall probe; the task eval scores and generates through a compressed cache. An architecture whose attention modules the harness cannot read is refused by name.
"""

import math

import pytest
import torch
from conftest import ARCHITECTURES, ByteTokenizer, CharTokenizer, tiny_arch
from omegaconf import OmegaConf
from stream_cases import ALL, check_distortion, check_roundtrip, instantiate, model_case
from transformers import DynamicCache

from compressors.eviction.query_attention import attention_sums, capture_queries
from kvbench.core.config import make_compressor
from kvbench.core.kv import Context, KVSequence
from kvbench.core.rope import Rotary
from kvbench.inputs.attention_modules import UnsupportedArchitecture
from kvbench.inputs.capture import capture_window
from kvbench.inputs.model_queries import masked_logits
from kvbench.measure.metrics.attention_error import AttentionError, continuation_queries
from kvbench.measure.metrics.task_loss import continuation_nll

ARCHS = list(ARCHITECTURES)
#: the sliding window of each layer where an architecture has one (Mistral's and Phi-3's from the config, on every
#: layer; Gemma 3's on its local layer), and the logit scale where it is not head_dim ** -0.5
SLIDING = {"mistral": [8, 8], "gemma3": [8, None], "phi3": [12, 12]}
SCALING = {"gemma3": 24**-0.5}
T, E = 32, 6  # prefix tokens (longer than every sliding window), scored continuation tokens
#: the contract's cache: longer than every default's exact window (KIVI's and KVTC's 128 recent tokens), as
#: tests/stream_cases.py's DISTORTION_TOKENS, and short enough for the model-running decoders on seven models
CONTRACT_TOKENS = 160
#: the contract runs on llama in tests/test_compressors_base.py; OLMo 2 (here for its norm over all heads) is left
#: out: without a norm before attention its tiny random model's values are ~1e-3, below FP8's normal range
CONTRACT_ARCHS = [a for a in ARCHS if a not in ("llama", "olmo2")]


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))


def _eager(arch: str):
    model = tiny_arch(arch)
    model.set_attn_implementation("eager")  # the implementation that returns its attention weights
    with torch.no_grad():  # larger queries: attention as peaked as a trained model's, so the scale and windows matter
        for layer in model.model.layers:
            attn = layer.self_attn
            proj = getattr(attn, "q_proj", None) or attn.qkv_proj
            proj.weight *= 4
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_keeps_the_models_own_cache_and_pre_rope_keys_that_rotate_back_to_it(arch):
    model = tiny_arch(arch)
    ids = _ids(T)
    got = capture_window(model, ids, T, torch.float32, pre_rope=True)
    plain = capture_window(model, ids, T, torch.float32)
    assert "k_pre_rope" not in plain
    assert torch.equal(plain["k"], got["k"]) and torch.equal(plain["v"], got["v"])
    with torch.no_grad():
        own = model(ids[None], cache=DynamicCache(config=model.config), use_cache=True).cache  # its own layer types
    L, H, D = model.config.num_hidden_layers, model.config.num_key_value_heads, model.model.layers[0].self_attn.head_dim
    assert got["k"].shape == got["v"].shape == got["k_pre_rope"].shape == (L, H, T, D)
    for i, layer in enumerate(own.layers):
        held = layer.keys.shape[2]  # a sliding layer holds its window's tail; the capture keeps every token
        torch.testing.assert_close(got["k"][i, :, T - held :], layer.keys[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(got["v"][i, :, T - held :], layer.values[0], rtol=0, atol=1e-6)
    rope = Rotary(model.config)
    torch.testing.assert_close(rope.apply(got["k_pre_rope"]), got["k"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rope.undo(got["k"]), got["k_pre_rope"], rtol=1e-5, atol=1e-5)
    half = capture_window(model, ids, T, torch.float16, pre_rope=True)
    assert half["k"].dtype == half["k_pre_rope"].dtype == torch.float16


@pytest.mark.parametrize("arch", ARCHS)
def test_the_queries_read_off_the_attention_modules_give_the_models_own_attention(arch):
    """Every attention-scoring eviction method (SnapKV, TOVA, H2O, expected attention, and AdaKV or PyramidKV over
    them) scores with these queries and this attention."""
    model = _eager(arch)
    ids = _ids(T)
    got = capture_window(model, ids, T, torch.float32)
    kv = KVSequence(got["k"], got["v"], ids)
    qs = capture_queries("test", kv, Context.for_kv(kv, model), 0)
    assert qs.sliding == SLIDING.get(arch, [None, None])
    assert qs.scaling == pytest.approx([SCALING.get(arch, 16**-0.5)] * 2)
    with torch.no_grad():
        out = model(ids[None], output_attentions=True)
    ref = torch.stack([a[0].sum(1) for a in out.attentions])  # (L, Hq, T)
    torch.testing.assert_close(attention_sums(qs, kv.k), ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("arch", CONTRACT_ARCHS)
def test_every_compressor_config_passes_the_contract_on_the_models_cache(arch, name):
    """Every eviction method keeps a valid set (its declared counts, kept entries exact), every coder stays under
    its declared distortion, on each architecture's cache, with its model and config where it needs them."""
    case = model_case(name, CONTRACT_TOKENS, arch)
    check_roundtrip(case, case.decoded)
    check_distortion(case)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_attention_error_metric_reads_the_models_attention_and_is_zero_on_the_exact_cache(arch):
    model = _eager(arch)
    ids = _ids(T + E + 1, seed=2)
    got = capture_window(model, ids, T, torch.float32)
    kv, cont = KVSequence(got["k"], got["v"], ids[:T]), ids[T:]
    qs = continuation_queries(model, kv, cont, E)
    assert qs.positions.tolist() == list(range(T, T + E)) and qs.sliding == SLIDING.get(arch, [None, None])
    with torch.no_grad():  # one pass over prefix and continuation: the scored rows' attention on the prefix keys
        att = model(ids[None, : T + E], output_attentions=True).attentions
    Hq, H = qs.q.shape[1], kv.shape[1]
    for layer, a in enumerate(att):
        ref = a[0, :, T:, :T]  # (Hq, E, T)
        ref = torch.nan_to_num(ref / ref.sum(-1, keepdim=True))  # renormalised over the prefix keys
        keys = kv.k[layer].repeat_interleave(Hq // H, dim=0)  # (Hq, T, D)
        logits = masked_logits(qs.q[layer].float() @ keys.transpose(1, 2), qs.positions, torch.arange(T),
                               qs.scaling[layer], qs.sliding[layer], qs.softcap[layer])  # (Hq, E, T)
        torch.testing.assert_close(torch.nan_to_num(torch.softmax(logits, -1)), ref, atol=2e-3, rtol=1e-3)
    exact, noisy = AttentionError(), AttentionError()
    exact.add(qs, kv, KVSequence(kv.k.clone(), kv.v.clone(), kv.tokens))
    assert exact.summary()["attn_logit_rel_mse"] == 0.0 and exact.summary()["attn_output_rel_err"] == 0.0
    assert (exact.sums[1] > 0).all() and (exact.sums[3] > 0).all()  # every layer and KV head was measured
    noisy.add(qs, kv, KVSequence(kv.k + 0.1 * kv.k.std() * torch.randn_like(kv.k), kv.v, kv.tokens))
    assert noisy.summary()["attn_logit_rel_mse"] > 0 and noisy.summary()["attn_output_rel_err"] > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_the_task_loss_on_a_decoded_exact_cache_is_the_models_own_nll(arch):
    model = tiny_arch(arch)
    ids = _ids(T + E + 1, seed=3)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)  # (T + E + 1, V) one pass
    base = float(-logp[T:-1].gather(1, ids[T + 1 :, None]).mean())
    got = capture_window(model, ids, T, torch.float32)
    kv = KVSequence(got["k"], got["v"], ids[:T])
    assert continuation_nll(model, kv, ids[T:]) == pytest.approx(base, abs=1e-5)
    half = capture_window(model, ids, T, torch.float16)  # the harness's cache dtype, decoded from its stored bytes
    kv16 = KVSequence(half["k"], half["v"], ids[:T])
    comp = instantiate("identity")
    ctx = Context.for_kv(kv16)
    decoded = comp.decode(comp.encode(kv16, ctx), ctx)
    assert continuation_nll(model, decoded, ids[T:]) == continuation_nll(model, kv16, ids[T:])
    assert continuation_nll(model, kv16, ids[T:]) == pytest.approx(base, abs=2e-2)  # a 16-bit cache of the same


@pytest.mark.parametrize("arch", ARCHS)
def test_a_run_measures_the_eval_the_attention_error_and_the_recall_probe(arch, tiny_cfg):
    from kvbench.inputs.models import ModelHandle
    from kvbench.measure import run as runner

    handle = ModelHandle.from_loaded(tiny_arch(arch), CharTokenizer(),
                                     OmegaConf.create({"name": "hf", "source": "hf", "path": "unused"}))
    cfg = tiny_cfg("+compressor=identity", "metrics.attn_queries=4", "metrics.recall_tokens=16")
    exact, _ = runner.measure(cfg, make_compressor(cfg.compressor), handle)
    assert math.isfinite(exact["nll_base"]) and exact["delta_nll"] == 0.0
    assert exact["attn_logit_rel_mse"] == 0.0 and exact["attn_output_rel_err"] == 0.0 and exact["attn_queries"] == 4
    assert exact["recall_tokens"] > 0 and exact["delta_nll_recall"] == 0.0
    # the last 4 tokens kept: fewer than any sliding window sees, so every architecture's attention loses some
    cfg = tiny_cfg("+compressor=snapkv", "compressor.window=4", "compressor.keep=null", "compressor.keep_tokens=4",
                   "metrics.attn_queries=4", "metrics.recall_tokens=16")
    evicted, _ = runner.measure(cfg, make_compressor(cfg.compressor), handle)
    assert evicted["nll_base"] == exact["nll_base"] and math.isfinite(evicted["delta_nll"])
    assert evicted["attn_output_rel_err"] > 0 and evicted["delta_nll_recall"] != 0.0


@pytest.mark.parametrize("arch", ARCHS)
def test_the_task_eval_scores_and_generates_through_a_compressed_cache(arch):
    """lm-eval's requests: the exact cache gives the uncompressed baseline's log-likelihood and text; SnapKV keeping
    a quarter changes the score, except where every layer slides (Mistral, Phi-3) and the kept quarter holds every
    key the windows still reach."""
    from lm_eval.api.instance import Instance

    from kvbench.inputs.models import ModelHandle
    from kvbench.measure.evaluation.lm import CompressedKVLM

    handle = ModelHandle.from_loaded(tiny_arch(arch), ByteTokenizer(),
                                     OmegaConf.create({"name": "hf", "source": "hf", "path": "unused"}))
    context = "the pass key is 4711. remember it. " * 3
    request = Instance("loglikelihood", {}, (context, " 4711"), 0)
    generate = Instance("generate_until", {}, (context, {"until": ["\n"], "max_gen_toks": 4}), 1)
    exact = CompressedKVLM(handle, instantiate("identity"), residual=0, progress=False)
    (scored,) = exact.loglikelihood([request])
    base = exact.baseline[("ll", context, " 4711")]
    assert scored == base and math.isfinite(scored[0])
    text = exact.generate_until([generate])[0]
    evicted = CompressedKVLM(handle, instantiate("snapkv", ("compressor.window=4", "compressor.keep=0.25")),
                             residual=0, progress=False)
    (dropped,) = evicted.loglikelihood([request])
    every_layer_slides = arch in ("mistral", "phi3")
    assert math.isfinite(dropped[0]) and (dropped[0] == base[0]) == every_layer_slides
    assert evicted.accounting["compressed_tokens"] > 0
    if every_layer_slides:
        assert evicted.generate_until([generate])[0] == text


def _gpt_neox():
    """A tiny random GPT-NeoX (Pythia's architecture)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, max_position_embeddings=512)).eval()


def test_an_architecture_whose_attention_cannot_be_read_is_refused_by_name():
    """GPT-NeoX (Pythia) interleaves each head's queries, keys and values in one ``query_key_value`` on a layer's
    ``attention``: its cache is captured as it is, but nothing that reads queries or pre-RoPE keys runs on it."""
    model = _gpt_neox()
    ids = _ids(T)
    got = capture_window(model, ids, T, torch.float16)
    assert got["k"].shape == (2, 4, T, 16)
    with pytest.raises(UnsupportedArchitecture, match=r"capture.pre_rope .*gpt_neox's layer 0 \(GPTNeoXLayer\) has "
                                                      r"none, so gpt_neox is not supported"):
        capture_window(model, ids, T, torch.float16, pre_rope=True)
    kv = KVSequence(got["k"], got["v"], ids)
    with pytest.raises(ValueError, match="snapkv reads .*gpt_neox is not supported"):
        instantiate("snapkv", ("compressor.window=4",)).encode(kv, Context.for_kv(kv, model))
    with pytest.raises(UnsupportedArchitecture, match=r"attention-error metric \(metrics.attn_queries=0 measures a "
                                                      r"run without it\) .*gpt_neox is not supported"):
        continuation_queries(model, kv.slice_tokens(0, T - E - 1), ids[T - E - 1 :], E)


def test_a_run_on_an_architecture_whose_attention_cannot_be_read_measures_all_but_the_attention_error(tiny_cfg):
    from kvbench.inputs.models import ModelHandle
    from kvbench.measure import run as runner

    handle = ModelHandle.from_loaded(_gpt_neox(), CharTokenizer(),
                                     OmegaConf.create({"name": "hf", "source": "hf", "path": "unused"}))
    cfg = tiny_cfg("+compressor=kivi", "metrics.attn_queries=0", "metrics.recall_tokens=16")
    summary, _ = runner.measure(cfg, make_compressor(cfg.compressor), handle)
    assert math.isfinite(summary["delta_nll"]) and math.isfinite(summary["delta_nll_recall"])
    assert math.isnan(summary["attn_output_rel_err"])
