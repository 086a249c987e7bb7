"""RULER-style tasks: deterministic data of the asked length with every answer in it, the string-match scorer, the
task group, and errors for unreadable data files (byte-level tokenizer, fake State of the Union text)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from conftest import ByteTokenizer
from omegaconf import OmegaConf

from kvbench.measure.evaluation import ruler, ruler_text
from kvbench.measure.evaluation import task_data as data
from kvbench.measure.evaluation.chance import chance_scores, haystack_words
from kvbench.measure.evaluation.evaluate import primary
from kvbench.measure.evaluation.tasks import TASKS, task_specs

LENGTH = 2560  # bytes: the byte-level tokenizer needs ~1,900 for the longest instructions and worked example


@pytest.fixture()
def home(monkeypatch, tmp_path):
    """An empty ``$KVBENCH_HOME`` and a fake State of the Union: sentences of ~800 distinct words."""
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    rng = np.random.default_rng(0)
    words = sorted({"".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 6)) for _ in range(800)})
    docs = []
    for _ in range(4):
        sentences = [" ".join(rng.choice(words, 9)).capitalize() + "." for _ in range(150)]
        docs.append(" ".join(sentences))
    monkeypatch.setattr(data, "_sotu", lambda: docs)
    monkeypatch.setattr(ruler_text, "COMMON", 1)
    return tmp_path


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _cfg(**ruler_cfg) -> OmegaConf:
    return OmegaConf.create({"seed": 0, "model": {"name": "tiny"},
                             "ruler": {"lengths": [LENGTH], "per_length": 2, "max_gen_toks": None, **ruler_cfg}})


@pytest.mark.parametrize("family", list(ruler.FAMILIES))
def test_every_family_is_deterministic_of_the_asked_length_and_holds_its_answers(family, home, tokenizer):
    path = ruler.ruler_data(tokenizer, family, LENGTH, 3, seed=0)
    first = path.read_bytes()
    path.unlink()
    assert ruler.ruler_data(tokenizer, family, LENGTH, 3, seed=0) == path and path.read_bytes() == first  # same seed, same bytes
    other = ruler.ruler_data(tokenizer, family, LENGTH, 3, seed=1)
    assert other != path and other.read_bytes() != first
    rows = _rows(path)
    assert [r["id"] for r in rows] == [0, 1, 2] and len({r["context"] for r in rows}) == 3
    for r in rows:
        n = len(tokenizer(r["context"] + r["query"]).input_ids)
        assert n == r["n_tokens"] and LENGTH - 8 <= n <= LENGTH  # within a few tokens, never over
        assert r["answers"] and r["length"] == LENGTH and r["family"] == family
        # the query asks and starts the answer; the material it asks about is all in the context
        assert r["query"].startswith("\n") and r["query"].endswith((" is", " are", ":"))  # ends in the answer prefix
        assert not any(a in r["query"] for a in r["answers"])
        task = r["context"].rsplit("\n\n", 1)[-1]  # the asked task, after the worked example
        for a in r["answers"]:
            assert a in task, f"{a!r} is not in the context of {family}"
        assert ruler.string_match(" ".join(r["answers"]), r["answers"]) == 1.0


def test_needles_sit_at_their_depths_and_chains_in_order(home, tokenizer):
    (r, *_) = _rows(ruler.ruler_data(tokenizer, "ruler_niah_multivalue", 4096, 1, seed=0))
    task = r["context"].rsplit("\n\n", 1)[-1]
    at = sorted(task.index(f"for {r['asked'][0]} is: {v}.") / len(task) for v in r["answers"])
    assert np.allclose(at, sorted(r["depths"]), atol=0.08)
    (vt, *_) = _rows(ruler.ruler_data(tokenizer, "ruler_vt", 4096, 1, seed=0))
    task = vt["context"].rsplit("\n\n", 1)[-1]
    first, *rest = vt["answers"]
    assert f"VAR {first} = {vt['asked'][0]}." in task
    pos = [task.index(f"VAR {b} = VAR {a}.") for a, b in zip(vt["answers"], rest)]
    assert pos == sorted(pos)  # each variable is bound before it is read


def test_niah_is_zero_shot_and_the_others_have_one_worked_example(home, tokenizer):
    (niah, *_) = _rows(ruler.ruler_data(tokenizer, "ruler_niah_multikey", LENGTH, 1, seed=0))
    assert niah["context"].startswith("A special magic number is hidden") and niah["context"].count("hidden within") == 1
    assert niah["context"].count("One of the special magic numbers") == 4  # the four needles, no worked example's
    for family, opens in (("ruler_vt", "Memorize and track"), ("ruler_cwe", "Below is a numbered list"),
                          ("ruler_fwe", "Read the following coded text")):
        (r, *_) = _rows(ruler.ruler_data(tokenizer, family, LENGTH, 1, seed=0))
        assert r["context"].count(opens) == 2 and r["context"].startswith(opens)


class ChatTokenizer:
    """The byte tokenizer with a chat template, as an instruction-tuned model's tokenizer has."""

    chat_template = "<user>{content}</user><assistant>"
    name_or_path = "chat-bytes"

    def __call__(self, text: str, add_special_tokens: bool = True):
        return ByteTokenizer()(text)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return f"<sys>be brief</sys><user>{messages[0]['content']}</user>" + ("<assistant>" if add_generation_prompt else "")

    def __len__(self) -> int:
        return 128


def test_the_chat_template_wraps_the_task_and_the_answer_prefix_opens_the_reply(home):
    tok = ChatTokenizer()
    (r, *_) = _rows(ruler.ruler_data(tok, "ruler_niah_single_number_noise", LENGTH, 1, seed=0, chat_template=True))
    assert r["chat_template"] and r["context"].startswith("<sys>be brief</sys><user>A special magic number")
    assert r["query"].startswith("\nWhat is the special magic number") and "?</user><assistant>The special magic" in r["query"]
    assert len(tok(r["context"] + r["query"]).input_ids) == r["n_tokens"] <= LENGTH  # the template counts
    (plain, *_) = _rows(ruler.ruler_data(tok, "ruler_niah_single_number_noise", LENGTH, 1, seed=0))
    assert not plain["chat_template"] and "<user>" not in plain["context"] + plain["query"]


def test_chat_template_auto_follows_the_model_kind():
    from kvbench.measure.evaluation.tasks import uses_chat_template

    instruct = OmegaConf.create({"model": {"name": "smollm2_135m"}, "ruler": {"chat_template": "auto"}})
    base = OmegaConf.create({"model": {"name": "gemma3_270m"}, "ruler": {"chat_template": "auto"}})
    local = OmegaConf.create({"model": {"name": "hf", "path": "/m/Qwen2-0.5B-Instruct"}, "ruler": {"chat_template": "auto"}})
    assert uses_chat_template(instruct, ChatTokenizer()) and uses_chat_template(local, ChatTokenizer())
    assert not uses_chat_template(base, ChatTokenizer()) and not uses_chat_template(instruct, ByteTokenizer())
    with pytest.raises(ValueError, match="has no chat template"):
        uses_chat_template(OmegaConf.create({"ruler": {"chat_template": True}}), ByteTokenizer())


def test_chance_comes_from_content_free_answerers(home, tokenizer):
    rows = {f: _rows(ruler.ruler_data(tokenizer, f, LENGTH, 4, seed=0))
            for f in ("ruler_fwe", "ruler_cwe", "ruler_niah_single_number_essay", "ruler_vt")}
    fwe, cwe = chance_scores(rows["ruler_fwe"]), chance_scores(rows["ruler_cwe"])
    assert set(fwe) == {"haystack_words"} and fwe["haystack_words"] > 0.02 and cwe["haystack_words"] > 0.02
    # the haystack is what follows the task's instructions: coded words only, no instruction or worked-example words
    words = haystack_words("ruler_fwe", rows["ruler_fwe"][0]["context"])
    assert all(len(w) == 6 for w in words) and set(rows["ruler_fwe"][0]["answers"]) <= set(words)
    n_fwe = len(words)
    assert fwe["haystack_words"] == pytest.approx(3 / n_fwe, abs=0.06)  # three of the coded words, uniformly
    niah = chance_scores(rows["ruler_niah_single_number_essay"])
    assert niah == {"haystack_words": 0.0, "random_value": 0.0}  # seven random digits never match
    assert set(chance_scores(rows["ruler_vt"])) == {"haystack_words", "random_value"}
    assert chance_scores(rows["ruler_fwe"]) == fwe  # seeded: the same examples give the same chance


def test_aggregation_answers_are_the_most_frequent(home, tokenizer):
    (cwe, *_) = _rows(ruler.ruler_data(tokenizer, "ruler_cwe", 3000, 1, seed=0))
    listed = re.findall(r"\d+\. ([a-z]+)", cwe["context"].rsplit("\n\n", 1)[-1].split("\nQuestion")[0])
    counts = {w: listed.count(w) for w in set(listed)}
    assert all(counts[a] == 6 for a in cwe["answers"]) and len(cwe["answers"]) == 10
    assert max(c for w, c in counts.items() if w not in cwe["answers"]) == 1
    (fwe, *_) = _rows(ruler.ruler_data(tokenizer, "ruler_fwe", 3000, 1, seed=0))
    stream = fwe["context"].rsplit("\n\n", 1)[-1].split("coded words. ", 1)[1].split("\nQuestion")[0].split()
    top = sorted({w for w in stream if w != "..."}, key=stream.count, reverse=True)
    assert top[:3] == fwe["answers"] and stream.count(top[2]) > stream.count(top[3])


def test_string_match_scores_the_fraction_of_answers_found():
    answers = ["1234567", "7654321", "Tall-Tiger", "abcdef"]
    assert ruler.string_match(" 1234567, 7654321, tall-tiger and ABCDEF.", answers) == 1.0
    assert ruler.string_match(" 1234567 and 7654321", answers) == 0.5
    assert ruler.string_match(" I do not know", answers) == 0.0
    assert ruler.string_match("\x00tall-tiger", ["tall-tiger"]) == 1.0
    assert ruler.process_results({"answers": answers}, [" 7654321"]) == {ruler.METRIC: 0.25}
    with pytest.raises(ValueError, match="at least one"):
        ruler.string_match("x", [])


def test_the_group_expands_to_every_family_and_length(home, tokenizer):
    assert "ruler" in TASKS and all(name.startswith("ruler_") for name in ruler.FAMILIES)
    specs = task_specs(["ruler"], _cfg(lengths=[LENGTH, 3000], per_length=1), tokenizer)
    names = [s["task"] for s in specs]
    assert len(names) == 2 * len(ruler.FAMILIES) >= 8 * 2 and len(set(names)) == len(names)
    assert all(n.startswith("ruler_") for n in names)
    assert "ruler_vt_2560" in names and "ruler_cwe_3000" in names
    for s in specs:
        assert primary(s) == (ruler.METRIC, "none") and s["process_results"] is ruler.process_results
    budgets = {s["task"]: s["generation_kwargs"]["max_gen_toks"] for s in specs}
    assert budgets["ruler_niah_single_uuid_noise_2560"] > budgets["ruler_niah_single_number_noise_2560"]
    one = task_specs(["ruler_vt", "ruler", "ruler_vt"], _cfg(max_gen_toks=5, per_length=1), tokenizer)
    assert [s["task"] for s in one][0] == "ruler_vt_2560" and len(one) == len(ruler.FAMILIES)
    assert {s["generation_kwargs"]["max_gen_toks"] for s in one} == {5}
    lengths = task_specs(["ruler_fwe"], _cfg(lengths=[3072, 4096]), tokenizer)
    assert [s["task"] for s in lengths] == ["ruler_fwe_3k", "ruler_fwe_4k"]


def test_a_length_too_short_for_the_prompt_says_so(home, tokenizer):
    with pytest.raises(ValueError, match=r"ruler_cwe at 256 tokens.*choose a ruler.lengths entry above"):
        ruler.ruler_data(tokenizer, "ruler_cwe", 256, 1, seed=0)
    with pytest.raises(ValueError, match="unknown RULER task 'ruler_bogus'"):
        ruler.ruler_data(tokenizer, "ruler_bogus", LENGTH, 1, seed=0)


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: p.write_text('{"context": "x", "query": "?", "answers": ["1"], "length": 256}\n{"context": "y", oops\n'), "line 2: not JSON"),
    (lambda p: p.write_text('{"context": "x", "query": "?", "length": 256}\n'), r"line 1: missing field\(s\) \['answers'\]"),
    (lambda p: p.write_text("[1, 2]\n"), "must be a JSON object"),
    (lambda p: p.write_text(""), "is empty"),
], ids=["bad-json", "missing-field", "not-an-object", "empty"])
def test_a_malformed_data_file_names_itself_and_the_command_that_rebuilds_it(damage, message, home, tokenizer):
    (spec,) = task_specs(["ruler_vt"], _cfg(), tokenizer)
    path = spec["dataset_kwargs"]["data_files"]["test"]
    damage(type(home)(path))
    with pytest.raises(data.TaskDataError, match=message) as err:
        task_specs(["ruler_vt"], _cfg(), tokenizer)
    assert path in str(err.value)
    assert ("delete it and rerun `python -m kvbench eval +compressor=identity model=tiny tasks=[ruler_vt] "
            f"ruler.lengths=[{LENGTH}] ruler.per_length=2 seed=0 limit=1`") in str(err.value)


def test_a_missing_data_file_names_itself_and_the_command_for_existing_tasks(tmp_path):
    with pytest.raises(data.TaskDataError, match=r"gone\.jsonl is missing; delete it and rerun `python -m kvbench eval"):
        data.check_jsonl(tmp_path / "gone.jsonl", ("context",), "delete it and rerun `python -m kvbench eval tasks=[passkey]`")
    bad = tmp_path / "passkey.jsonl"
    bad.write_text('{"context": "x"}\n')
    with pytest.raises(data.TaskDataError, match=r"missing field\(s\) \['passkey'\]"):
        data.check_jsonl(bad, ("context", "passkey"), "rebuild")


def test_the_runner_pairs_ruler_scores_through_lm_eval(tiny_model, tmp_path, monkeypatch):
    from compressors.exact.identity import Identity
    from kvbench.inputs.models import ModelHandle
    from kvbench.measure.evaluation.evaluate import evaluate
    from kvbench.measure.evaluation.tasks import task_config

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    rows = [{"context": f"The magic number is {v}. The magic number is", "answers": [str(v), "7"], "length": 64, "id": i}
            for i, v in enumerate((12345, 67890, 13579))]
    path = data.write_jsonl(tmp_path / "ruler_toy.jsonl", rows)
    spec = task_config("ruler", "ruler_toy_64", path)
    spec["generation_kwargs"] = {**spec["generation_kwargs"], "max_gen_toks": 4}
    handle = ModelHandle.from_loaded(tiny_model, ByteTokenizer(), OmegaConf.create({"name": "tiny", "source": "hf", "path": "x"}))
    cfg = OmegaConf.create({"model": {"name": "tiny"}, "device": "cpu", "dtype": "float16", "seed": 0, "tasks": [],
                            "limit": None, "bootstrap_iters": 0, "cache": {"residual": 0, "chunk": 128, "mode": "auto"}})
    summary, out = evaluate(cfg, Identity(), handle, progress=False, specs=[spec])
    t = summary["tasks"]["ruler_toy_64"]
    assert summary["protocol"] == "context_only"  # the default, where the config does not name one
    assert t["chance"] == 0.0 and t["chance_answerers"] == {"haystack_words": 0.0}  # no haystack word is a number
    assert t["query_tokens_mean"] == 1 and t["context_tokens_mean"] == np.mean([len(r["context"]) - 1 for r in rows])
    assert t["metric"] == ruler.METRIC and t["n"] == 3 and t["identical"] and t["identical_responses"] == 3
    assert t["lm_eval_base"][f"{ruler.METRIC},none"] == pytest.approx(t["acc_base"])
    assert [r["length"] for r in out] == [64] * 3
    assert {r["base"] for r in out} <= {0.0, 0.5, 1.0}  # a fraction of the two answers per example


@pytest.mark.integration
def test_ruler_eval_cli_on_smollm2(tmp_path):
    """Two RULER tasks end to end on the real model: identity reproduces every baseline generation."""
    from kvbench.__main__ import main

    assert main(["eval", "+compressor=identity", "tasks=[ruler_niah_single_number_noise,ruler_vt]", "ruler.lengths=[1024]",
                 "limit=2", f"paths.results={tmp_path}"]) == 0
    (summary_file,) = tmp_path.glob("runs/eval-identity-*/eval.json")
    s = json.loads(summary_file.read_text())
    assert set(s["tasks"]) == {"ruler_niah_single_number_noise_1k", "ruler_vt_1k"}
    for t in s["tasks"].values():
        assert t["metric"] == ruler.METRIC and t["n"] == 2 and t["identical"] and t["identical_responses"] == 2
