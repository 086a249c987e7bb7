"""Workload builders, their sharing statistics, chat-template pieces and the block-hash trace reader."""

import json
import zlib

import numpy as np
import pytest

from kvbench.core.config import available, compose
from kvbench.inputs.workloads import make_workload, selected, sharing_stats
from kvbench.inputs.workloads.doc_qa import DocQA
from kvbench.inputs.workloads.fewshot import FewShot
from kvbench.inputs.workloads.fewshot_text import text_task
from kvbench.inputs.workloads.hash_trace import infer_block_tokens, read_hash_trace, trace_report
from kvbench.inputs.workloads.mixed import Mixed
from kvbench.inputs.workloads.multiturn import MultiTurn
from kvbench.inputs.workloads.shared_system import SharedSystem
from kvbench.inputs.workloads.text import chat_tokens, encode


def _docs(text_file):
    text = text_file.read_text()
    n = len(text) // 4
    return [text[i * n : (i + 1) * n] for i in range(4)]


def _prefix(a, b):
    return len(a) <= len(b) and np.array_equal(a, b[: len(a)])


def test_sharing_stats_by_hand():
    seqs = [np.arange(10), np.r_[np.arange(6), [50, 51]], np.r_[np.arange(8), [60]], np.array([7, 7])]
    s = sharing_stats(seqs, block_size=4, families=["a", "a", "b", "c"])
    assert s["tokens"] == 10 + 8 + 9 + 2
    assert s["shared_prefix_tokens"] == 0 + 6 + 8 + 0
    assert s["share_rate"] == pytest.approx(14 / 29)
    assert s["unique_tokens"] == 15 and s["dedup_ratio"] == pytest.approx(29 / 15)
    assert s["ideal_hit_tokens"] == 0 + 4 + 8 + 0  # whole blocks of 4 only
    assert s["sessions_with_shared_prefix"] == 2
    assert s["by_family"]["b"] == {"sessions": 1, "tokens": 9, "share_rate": pytest.approx(8 / 9)}


def test_every_workload_config_composes_and_none_selects_nothing():
    assert {"none", "shared_system", "fewshot", "doc_qa", "multiturn", "mixed"} <= set(available("workload"))
    assert not selected(compose([]).workload)
    for name in available("workload"):
        if name != "none":
            assert make_workload(compose([f"workload={name}"]).workload).name == name


def test_workload_config_errors_name_the_fields():
    with pytest.raises(ValueError, match="bogus.*fields are"):
        make_workload(compose(["workload=shared_system", "+workload.bogus=1"]).workload)
    with pytest.raises(ValueError, match="target_share_rate"):
        make_workload(compose(["workload=mixed", "workload.target_share_rate=1.5"]).workload)
    with pytest.raises(ValueError, match="families.*choose from"):
        Mixed(families=["nope"])


def test_shared_system_shares_the_system_prompt(tokenizer, text_file):
    wl = SharedSystem(n_sessions=5, system_tokens=80, user_tokens=30).build(tokenizer, _docs(text_file))
    toks = [s.tokens for s in wl.sessions]
    head = len(encode(tokenizer, "system: ")) + 80
    assert all(np.array_equal(t[:head], toks[0][:head]) for t in toks)
    st = wl.stats(block_size=1)
    assert st["sessions"] == 5 and st["sessions_with_shared_prefix"] == 4
    assert st["shared_prefix_tokens"] >= 4 * head
    with pytest.raises(ValueError, match="system prompt holds only"):
        SharedSystem(system_tokens=10**6).build(tokenizer, _docs(text_file))


def test_doc_qa_asks_different_questions_about_one_document(tokenizer, text_file):
    wl = DocQA(n_sessions=6, doc_tokens=200).build(tokenizer, _docs(text_file))
    toks = [s.tokens for s in wl.sessions]
    assert len({t.tobytes() for t in toks}) == 6
    assert all(np.array_equal(t[:200], toks[0][:200]) for t in toks)
    assert wl.stats(1)["share_rate"] > 0.7


def test_multiturn_turns_extend_the_previous_prompt(tokenizer, text_file):
    b = MultiTurn(n_conversations=3, n_turns=3, user_tokens=20, reply_tokens=25)
    wl = b.build(tokenizer, _docs(text_file))
    assert len(wl.sessions) == 9
    by_conv = {}
    for s in wl.sessions:  # arrival order is turn by turn
        by_conv.setdefault(s.group, []).append(s.tokens)
    for turns in by_conv.values():
        assert all(_prefix(a, b) and len(a) < len(b) for a, b in zip(turns, turns[1:]))


def _task_dir(tmp_path, n=12):
    task = {"name": "tiny", "description": "Pick the bigger number.",
            "examples": [{"input": f"{i} or {i + 5}?", "target_scores": {str(i): 0, str(i + 5): 1}} for i in range(n)]}
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "task.json").write_text(json.dumps(task))
    return tmp_path


def _sentences(n_docs=6, n_sentences=60, seed=0):
    """Documents of capitalised sentences, so that passages start at sentence starts."""
    words = "nation shall endure people prosper under liberty and the law with justice order commerce peace".split()
    rng = np.random.default_rng(seed)
    return [" ".join(" ".join(words[i] for i in rng.integers(len(words), size=rng.integers(6, 16))).capitalize() + "."
                     for _ in range(n_sentences)) for _ in range(n_docs)]


@pytest.fixture()
def offline(monkeypatch):
    """No BIG-bench files and no downloads: fetching them or running a subprocess fails the test."""
    import subprocess

    from kvbench.inputs import assets

    def refuse(*a, **k):
        raise AssertionError("the default few-shot workload must not fetch anything")

    monkeypatch.setattr(assets, "ensure_bigbench", refuse)
    monkeypatch.setattr(subprocess, "run", refuse)


def test_fewshot_default_cuts_its_tasks_from_the_text(tokenizer, offline):
    docs = _sentences()
    wl = make_workload(compose(["workload=fewshot", "workload.n_sessions=8"]).workload).build(tokenizer, docs)
    assert [s.group for s in wl.sessions] == ["next_word", "fill_blank"] * 4
    toks = [s.tokens for s in wl.sessions]
    assert len({t.tobytes() for t in toks}) == 8  # every prompt asks a different example
    for name in ("next_word", "fill_blank"):
        task = text_task(name, docs, 3 + 4, 48, np.random.default_rng([0, zlib.crc32(name.encode())]))
        exs = task["examples"]
        shots = "".join(f"\nQ: {e['input']}\nA: {e['target']}\n" for e in exs[:3])
        shared = np.concatenate([encode(tokenizer, task["description"] + "\n"), encode(tokenizer, shots)])
        mine = [t for s, t in zip(wl.sessions, toks) if s.group == name]
        assert all(np.array_equal(t[: len(shared)], shared) for t in mine)  # instruction and exemplars shared
        assert len({t[len(shared) :].tobytes() for t in mine}) == 4  # ... and nothing after them
        assert bytes(mine[0][len(shared) :].astype(np.uint8)).decode() == f"\nQ: {exs[3]['input']}\nA:"
        for e in exs:  # every answer is the text's own word
            whole = e["input"].replace("____", e["target"]) if name == "fill_blank" else e["input"] + " " + e["target"]
            assert any(whole in d for d in docs), e
            assert name == "next_word" or e["input"].count("____") == 1
    st = wl.stats(1)
    assert st["share_rate"] > 0.5
    again = FewShot(n_sessions=8).build(tokenizer, docs)
    assert [s.tokens.tobytes() for s in again.sessions] == [t.tobytes() for t in toks]
    other = FewShot(n_sessions=8, seed=1).build(tokenizer, docs)
    assert [s.tokens.tobytes() for s in other.sessions] != [t.tobytes() for t in toks]
    with pytest.raises(ValueError, match="yields only"):
        FewShot(n_sessions=400).build(tokenizer, docs[:1])


def test_fewshot_source_errors_say_what_to_do():
    with pytest.raises(ValueError, match="bigbench 1.0.0 sdist.*workload.task_dir=DIR"):
        make_workload(compose(["workload=fewshot", "workload.source=bigbench"]).workload)
    with pytest.raises(ValueError, match="source='nope'.*choose from \\['text', 'bigbench'\\]"):
        FewShot(source="nope")
    with pytest.raises(ValueError, match="not built-in tasks; choose from \\['fill_blank', 'next_word'\\]"):
        FewShot(tasks=["goal_inference"])
    with pytest.raises(ValueError, match="task_dir is read only with source=bigbench"):
        FewShot(task_dir="/tmp")


def test_fewshot_shares_instruction_and_exemplars(tokenizer, text_file, tmp_path):
    wl = FewShot(n_sessions=4, source="bigbench", tasks=["tiny"], k_shot=3, task_dir=str(_task_dir(tmp_path))).build(tokenizer, [])
    toks = [s.tokens for s in wl.sessions]
    text = "Pick the bigger number.\n" + "".join(f"\nQ: {i} or {i + 5}?\n  choice: {i}\n  choice: {i + 5}\nA: {i + 5}\n" for i in range(3))
    shared = encode(tokenizer, text)
    assert all(np.array_equal(t[: len(shared)], shared) for t in toks)
    assert bytes(toks[0][len(shared):].astype(np.uint8)).decode() == "\nQ: 3 or 8?\n  choice: 3\n  choice: 8\nA:"
    with pytest.raises(ValueError, match="available: \\['tiny'\\]"):
        FewShot(source="bigbench", tasks=["nope"], task_dir=str(tmp_path)).build(tokenizer, [])
    with pytest.raises(ValueError, match="12 examples"):
        FewShot(n_sessions=20, source="bigbench", tasks=["tiny"], task_dir=str(tmp_path)).build(tokenizer, [])


def test_mixed_reaches_the_target_share_rate(tokenizer, text_file, tmp_path):
    docs, tasks = _docs(text_file), str(_task_dir(tmp_path, n=40))
    small = {"n_sessions": 12, "unrelated_tokens": 120,
             "family_params": {"fewshot": {"source": "bigbench", "task_dir": tasks, "tasks": ["tiny"]}}}
    rates = []
    for target in (0.0, 0.3, 0.5):
        wl = Mixed(target_share_rate=target, families=["shared_system", "fewshot", "doc_qa"], **small).build(tokenizer, docs)
        st = wl.stats(1)
        assert st["sessions"] == 12
        assert abs(st["share_rate"] - target) < 0.1, (target, st["share_rate"])
        rates.append(st["share_rate"])
    assert rates == sorted(rates)
    with pytest.raises(ValueError, match="at most"):
        Mixed(target_share_rate=0.99, families=["shared_system"], n_sessions=12, unrelated_tokens=120).build(tokenizer, docs)
    with pytest.raises(ValueError, match="family_params: 'nope' is not a family"):
        Mixed(families=["doc_qa"], family_params={"nope": {}})
    Mixed(families=["doc_qa"], family_params={"fewshot": {"source": "text"}})  # unused, as after a families override


def test_mixed_default_builds_offline_from_the_text(tokenizer, offline):
    wl = make_workload(compose(["workload=mixed", "workload.n_sessions=12", "workload.unrelated_tokens=100"]).workload)
    assert wl.family_params == {"fewshot": {"source": "text"}}
    built = wl.build(tokenizer, _sentences(n_docs=8))
    assert len(built.sessions) == 12 and "fewshot" in {s.family for s in built.sessions}


def test_mixed_is_deterministic_and_keeps_turn_order(tokenizer, text_file):
    kw = {"n_sessions": 12, "target_share_rate": 0.4, "families": ["multiturn", "doc_qa"], "unrelated_tokens": 100}
    a = Mixed(**kw).build(tokenizer, _docs(text_file))
    b = Mixed(**kw).build(tokenizer, _docs(text_file))
    assert [s.tokens.tobytes() for s in a.sessions] == [s.tokens.tobytes() for s in b.sessions]
    turns = {}
    for s in a.sessions:
        if s.family == "multiturn":
            turns.setdefault(s.group, []).append(s.tokens)
    assert all(_prefix(x, y) for t in turns.values() for x, y in zip(t, t[1:]))


class ChatMLTokenizer:
    """Byte tokenizer with a ChatML template: enough to test template splitting."""

    chat_template = "chatml"
    bos_token_id = None

    def __call__(self, text, add_special_tokens=True):
        return type("Enc", (), {"input_ids": list(text.encode())})()

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def test_chat_pieces_render_the_template_and_keep_turn_prefixes():
    tok = ChatMLTokenizer()
    msgs = [("user", "hi"), ("assistant", "hello"), ("user", "more")]
    full = chat_tokens(tok, msgs)
    assert bytes(full.astype(np.uint8)).decode() == tok.apply_chat_template(
        [{"role": r, "content": c} for r, c in msgs], add_generation_prompt=True)
    assert _prefix(chat_tokens(tok, msgs[:1]), full)
    ids = chat_tokens(tok, [("user", np.array([104, 105]))])  # token contents pass through untouched
    assert _prefix(np.array(list(b"<|im_start|>user\nhi")), ids)


def _write_trace(path):
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 5, "input_length": 1400, "output_length": 10, "hash_ids": [0, 1, 3]},
        {"timestamp": 9, "input_length": 700, "output_length": 10, "hash_ids": [0, 4]},
        {"timestamp": 9, "input_length": 300, "output_length": 10, "hash_ids": [5]},
        {"timestamp": 12, "input_length": 1536, "output_length": 10, "hash_ids": [0, 1, 2]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_hash_trace_statistics_and_ideal_hit_rate(tmp_path):
    wl = read_hash_trace(_write_trace(tmp_path / "mooncake_trace.jsonl"))
    assert wl.id_tokens == 512 and wl.prompt_tokens == [1500, 1400, 700, 300, 1536]
    st = wl.stats(block_size=1)
    # shared: 0, 2 blocks (1024), 1 block (512), 0, all of the last prompt (1536)
    assert st["shared_prefix_tokens"] == 1024 + 512 + 1536
    assert st["ideal_hit_rate"] == pytest.approx(3072 / 5436)
    rep = trace_report(tmp_path / "mooncake_trace.jsonl", budgets=[1024])
    assert rep["sharing"]["ideal_hit_rate"] == st["ideal_hit_rate"]
    assert {r["policy"] for r in rep["replay"]} == {"lru", "plt"}
    assert all(r["memory_held_max_tokens"] <= 1024 and r["hit_rate"] <= st["ideal_hit_rate"] for r in rep["replay"])


def test_hash_trace_block_size_and_errors(tmp_path):
    assert infer_block_tokens(tmp_path / "qwen_traceA_blksz_16.jsonl") == 16
    assert infer_block_tokens(tmp_path / "mooncake_trace.jsonl") == 512
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [1, 2]}\n{"input_length": 5}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2 has no 'hash_ids'"):
        read_hash_trace(bad)
    with pytest.raises(FileNotFoundError):
        read_hash_trace(tmp_path / "missing.jsonl")
