"""Task accuracy in the loop: statistics, task data, the lm-eval model classes and the runner (tiny model, toy tasks)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import ByteTokenizer
from lm_eval.api.instance import Instance
from omegaconf import OmegaConf

from compressors.exact.identity import Identity
from compressors.quantizers.kivi import KIVI
from kvbench.inputs.models import ModelHandle
from kvbench.measure.evaluation import task_data as data
from kvbench.measure.evaluation.evaluate import evaluate, format_eval
from kvbench.measure.evaluation.lm import CompressedKVLM
from kvbench.measure.evaluation.stats import paired_scores
from kvbench.measure.evaluation.tasks import task_config, task_specs


@pytest.fixture()
def handle(tiny_model):
    return ModelHandle.from_loaded(tiny_model, ByteTokenizer(), OmegaConf.create({"name": "tiny", "source": "hf", "path": "x"}))


def _ll(ctx: str, cont: str, i: int = 0) -> Instance:
    return Instance("loglikelihood", {}, (ctx, cont), i)


def test_bigbench_formatting_follows_the_json_task_conventions():
    task = {"task_prefix": "Yes or no? ", "example_input_prefix": "\n\nQ: ", "example_output_prefix": " \nA: ",
            "append_choices_to_input": False}
    row = data.format_bigbench(task, {"input": "Is it?", "target_scores": {"yes": 0, "no": 1}})
    assert row == {"context": "Yes or no? \n\nQ: Is it?", "query": " \nA:", "choices": ["yes", "no"], "label": 1}
    listed = data.format_bigbench({}, {"input": "Pick", "target_scores": {"a": 1, "b": 0}})
    assert listed["context"] == "Q: Pick" and listed["query"] == "\n  choice: a\n  choice: b\nA:"
    assert data.format_bigbench({}, {"input": "Tie", "target_scores": {"a": 1, "b": 1}}) is None


def test_passkey_and_lastword_data(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    words = "the union is strong and the people are free under law".split()
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(words, 3000)).replace(" law ", " law. ") for _ in range(5)]
    monkeypatch.setattr(data, "_sotu", lambda: docs)
    tok = ByteTokenizer()
    path = data.passkey_data(tok, 600, [0.1, 0.9], 2, seed=0)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["depth"] for r in rows] == [0.1, 0.9, 0.1, 0.9]
    for r in rows:
        assert abs(r["n_tokens"] - 600) <= 4 and r["query"] == data.PASSKEY_QUESTION and r["query"].endswith("The pass key is")
        needle = data.PASSKEY_NEEDLE.format(key=r["passkey"]).strip()
        hay = len(r["context"]) - len(data.PASSKEY_INTRO) - len(needle)
        at = (r["context"].index(needle) - len(data.PASSKEY_INTRO)) / hay  # depth within the haystack
        assert abs(at - r["depth"]) < 0.03
    assert data.passkey_data(tok, 600, [0.1, 0.9], 2, seed=0) == path  # cached by its parameters
    lw = [json.loads(line) for line in data.lastword_data(tok, 3, 200, seed=0).read_text().splitlines()]
    assert len(lw) == 3 and all(r["target"] == "law" and len(tok(r["context"]).input_ids) <= 200 for r in lw)


def test_unknown_task_names_the_available_ones():
    with pytest.raises(ValueError, match="passkey"):
        task_specs(["bogus"], OmegaConf.create({}), ByteTokenizer())


def test_identity_reproduces_the_baseline_request_by_request(handle):
    lm = CompressedKVLM(handle, Identity(), residual=0, progress=False)
    reqs = [_ll("the cat sat on the", " mat", 0), _ll("the cat sat on the", " hat", 1), _ll("a", "bc", 2)]
    out = lm.loglikelihood(reqs)
    assert [lm.baseline[("ll", *r.args)] for r in reqs] == out
    assert lm.replay().loglikelihood(reqs) == out
    assert lm.accounting["contexts"] == 2  # the two requests sharing a context share one prefill
    gen = Instance("generate_until", {}, ("once upon a time", {"until": ["\n"], "max_gen_toks": 6}), 3)
    text = lm.generate_until([gen])
    assert lm.replay().generate_until([gen]) == text


@pytest.mark.parametrize("protocol", ["context_only", "query_aware"])
def test_the_compressed_segment_holds_exactly_the_context(handle, protocol, monkeypatch):
    lm = CompressedKVLM(handle, KIVI(bits=2, group_size=16), protocol=protocol, residual=0, progress=False)
    doc = {"context": "The cat sat on the mat. The dog sat on the rug. " * 3, "query": "\nWhere did the cat sit? On the"}
    text = doc["context"] + doc["query"]
    seen = []
    caches = lm.caches
    monkeypatch.setattr(lm, "caches", lambda p, baseline=True: seen.append((p, *caches(p, baseline))) or seen[-1][1:])
    req = Instance("generate_until", doc, (text, {"until": ["\x00"], "max_gen_toks": 5}), 0, metadata=("toy", 7, 1))
    lm.generate_until([req])
    ((prompt, comp, base),) = seen
    ids = handle.tokenizer(text).input_ids
    n_ctx = len(doc["context"]) if protocol == "context_only" else len(ids) - 1  # one token per byte
    assert prompt.context == ids[:n_ctx] and prompt.context + prompt.query == ids
    # after generating: one segment, the context's tokens from position 0; query and answer never coded
    assert [(s.start, s.length) for s in comp.segments] == [(0, n_ctx)] and comp.tokens[:n_ctx] == prompt.context
    assert comp.window_tokens == len(ids) - n_ctx + lm.accounting["generated_tokens"] - 1
    assert not base.segments and lm.shapes[("toy", 7)] == (n_ctx, len(ids) - n_ctx)
    with pytest.raises(ValueError, match="cache.mode=chunked"):
        CompressedKVLM(handle, KIVI(), mode="chunked")


def test_a_process_runs_each_requests_baseline_once_whatever_the_compressor(tiny_model, monkeypatch):
    from kvbench.measure.evaluation import lm as lm_module

    monkeypatch.setattr(lm_module, "BASELINES", {})
    named = ModelHandle.from_loaded(tiny_model, ByteTokenizer(), OmegaConf.create({"name": "tiny", "source": "hf", "path": "x"}))
    named._meta = {}  # as a packaged model's: its weights have a name, so its baseline may be kept
    gen = Instance("generate_until", {"query": " Again?"}, ("once upon a time Again?", {"until": ["\n"], "max_gen_toks": 4}), 0)
    ll = _ll("the cat sat on the", " mat")
    runs = []
    for compressor in (Identity(), KIVI(bits=2, group_size=16)):
        lm = CompressedKVLM(named, compressor, residual=0, progress=False)
        sides = []
        real = lm.generate
        monkeypatch.setattr(lm, "generate", lambda cache, *a, sides=sides, real=real: sides.append(cache.compressor is None)
                            or real(cache, *a))
        lm.generate_until([gen])
        lm.loglikelihood([ll])
        runs.append((sides, lm.replay().generate_until([gen]), lm.replay().loglikelihood([ll])))
    (first, *base_1), (second, *base_2) = runs
    assert first == [False, True] and second == [False]  # the second compressor's run generates only its own side
    assert base_1 == base_2 and len(lm_module.BASELINES) == 2
    built = CompressedKVLM(ModelHandle.from_loaded(tiny_model, ByteTokenizer(), OmegaConf.create({"name": "tiny"})), Identity())
    assert built.memo_key("gen", built.prompt("abc")) is None  # a model built in the process is never kept


def test_kivi_scores_differ_from_the_baseline(handle):
    lm = CompressedKVLM(handle, KIVI(bits=2, group_size=16), residual=0, progress=False)
    req = _ll("some context that is long enough to quantize " * 2, " ok")
    (comp,) = lm.loglikelihood([req])
    base = lm.baseline[("ll", *req.args)]
    assert comp[0] != base[0] and abs(comp[0] - base[0]) < 0.5 * abs(base[0])
    assert lm.accounting["segment_bits"] > 0 and lm.accounting["compressed_tokens"] == len(req.args[0].rstrip()) - 1


def _toy_tasks(tmp_path) -> list[dict]:
    mc = tmp_path / "mc.jsonl"
    mc.write_text("".join(json.dumps({"context": f"Q{i}: is {i} even?\nA:", "choices": ["yes", "no"], "label": i % 2}) + "\n"
                          for i in range(6)))
    gen = tmp_path / "gen.jsonl"
    gen.write_text("".join(json.dumps({"context": f"The pass key is {k}. Again, the pass key is", "passkey": str(k)}) + "\n"
                           for k in (11111, 22222)))
    spec = task_config("passkey", "toy_gen", gen)
    spec["generation_kwargs"] = {**spec["generation_kwargs"], "max_gen_toks": 4}
    return [task_config("bigbench", "toy_mc", mc), spec]


def test_runner_pairs_lm_eval_results(handle, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    cfg = OmegaConf.create({"model": {"name": "tiny"}, "device": "cpu", "dtype": "float16", "seed": 0, "tasks": [],
                            "limit": 4, "bootstrap_iters": 0, "cache": {"residual": 0, "chunk": 128, "mode": "auto"}})
    summary, rows = evaluate(cfg, Identity(), handle, progress=False, specs=_toy_tasks(tmp_path))
    assert set(summary["tasks"]) == {"toy_mc", "toy_gen"}
    mc, gen = summary["tasks"]["toy_mc"], summary["tasks"]["toy_gen"]
    assert mc["n"] == 4 and gen["n"] == 2 and gen["metric"] == "exact_match"
    for t in (mc, gen):
        assert t["identical"] and t["identical_responses"] == t["n"] and t["diff"] == 0 and t["mcnemar_p"] == 1.0
        assert t["ci95_low"] == t["ci95_high"] == 0.0 and t["paired_test"] == "mcnemar_exact"
    assert mc["lm_eval_base"]["acc,none"] == mc["acc_base"]
    assert summary["bits_per_element"] > 16  # identity: 16 bits plus the frame
    assert len(rows) == 6 and "toy_mc" in format_eval(summary)
    assert mc["chance"] == 0.5 and gen["chance"] == 0.0  # two choices; a generated key is never right by chance
    for t in (mc, gen):
        assert t["near_chance"] == (t["acc_base"] < t["chance"] + 0.1)
    clear = [t for t in (mc, gen) if not t["near_chance"]]
    assert summary["overall_informative"]["n"] == sum(t["n"] for t in clear)
    assert summary["overall"]["ci_method"] == "bootstrap_stratified"
    assert summary["near_chance_tasks"] == sorted(n for n, t in summary["tasks"].items() if t["near_chance"])
    # each example's scores, so that two cells can be paired with each other, and the compressor's facts
    for name, t in summary["tasks"].items():
        mine = [r for r in rows if r["task"] == name]
        assert t["doc_ids"] == [r["doc_id"] for r in mine] and t["scores_comp"] == [r["comp"] for r in mine]
        assert t["scores_base"] == [r["base"] for r in mine]
    assert summary["compressor_facts"]["exact_tokens"] and summary["compressor_facts"]["quality_reference"] is False


def test_eval_config_composes_with_the_model_and_dataset_groups():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from kvbench.core.config import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = hydra_compose("eval", overrides=["+compressor=kivi", "tasks=[passkey]", "limit=2", "model=gemma3_270m"])
        lat = hydra_compose("latency", overrides=["+compressor=identity", "latency.contexts=[128]"])
    assert cfg.model.name == "gemma3_270m" and list(cfg.tasks) == ["passkey"] and cfg.compressor.bits == 2
    assert list(lat.latency.contexts) == [128] and lat.dataset.name == "sotu"


@pytest.mark.integration
def test_eval_cli_identity_is_exact_on_smollm2(tmp_path):
    """`python -m kvbench eval` end to end on the real model: identity reproduces every response."""
    from kvbench.__main__ import main

    assert main(["eval", "+compressor=identity", "tasks=[passkey,sotu_lastword]", "limit=2", "passkey.lengths=[512]",
                 "passkey.depths=[0.5]", "passkey.per_depth=2", "lastword.n=4", "lastword.context_tokens=256", f"paths.results={tmp_path}"]) == 0
    (summary_file,) = tmp_path.glob("runs/eval-identity-*/eval.json")
    s = json.loads(summary_file.read_text())
    assert set(s["tasks"]) == {"passkey_512", "sotu_lastword"}
    for t in s["tasks"].values():
        assert t["identical_responses"] == t["n"] == 2
    assert s["overall"]["diff"] == 0.0


def test_cache_uses_storage_dtype(handle):
    lm = CompressedKVLM(handle, Identity(), residual=0, dtype=torch.bfloat16, progress=False)
    lm.loglikelihood([_ll("abcdef", "g")])
    assert lm.accounting["segment_bits"] > 0


def test_six_flips_one_way_are_the_fewest_mcnemar_calls_significant():
    from kvbench.measure.evaluation.stats import smallest_significant_flips

    assert smallest_significant_flips() == 6  # 2 * 0.5**6 = 0.031 < 0.05 <= 2 * 0.5**5 = 0.0625
    base = np.ones(20)
    comp = base.copy()
    comp[:6] = 0
    assert paired_scores(base, comp)["mcnemar_p"] < 0.05
    comp[5] = 1
    assert paired_scores(base, comp)["mcnemar_p"] >= 0.05


def test_generation_stops_at_the_first_stop_string(handle):
    lm = CompressedKVLM(handle, Identity(), residual=0, progress=False)
    free = Instance("generate_until", {}, ("abc", {"until": ["\x00never"], "max_gen_toks": 12}), 0)
    (text,) = lm.generate_until([free])
    assert len(text) > 2, "the tiny model's greedy text is too short for this test"
    stop = text[1]
    lm2 = CompressedKVLM(handle, Identity(), residual=0, progress=False)
    (cut,) = lm2.generate_until([Instance("generate_until", {}, ("abc", {"until": [stop], "max_gen_toks": 12}), 0)])
    assert cut == text.split(stop)[0]
    assert lm2.accounting["generated_tokens"] < lm.accounting["generated_tokens"]  # it stopped early
