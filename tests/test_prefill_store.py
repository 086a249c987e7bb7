"""paths.prefills: each evaluation example's 16-bit context prefill and the baseline's answer kept across processes;
a later cell loads them and gets exactly what computing them gives, and a damaged entry is an error naming it."""

from __future__ import annotations

import pytest
import torch
from conftest import ByteTokenizer
from lm_eval.api.instance import Instance
from omegaconf import OmegaConf

from compressors.quantizers.kivi import KIVI
from kvbench.inputs.models import ModelHandle
from kvbench.measure.evaluation import lm as lm_module
from kvbench.measure.evaluation.lm import CompressedKVLM
from kvbench.measure.evaluation.prefill_store import PrefillStore
from kvbench.store.integrity import IntegrityError

GEN = Instance("generate_until", {"query": " Again?"}, ("once upon a time, a cat sat Again?", {"until": ["\n"], "max_gen_toks": 6}), 0)
LL = Instance("loglikelihood", {}, ("the cat sat on the", " mat"), 0)


@pytest.fixture()
def named(tiny_model):
    h = ModelHandle.from_loaded(tiny_model, ByteTokenizer(), OmegaConf.create({"name": "tiny", "source": "hf", "path": "x"}))
    h._meta = {}  # as a packaged model's: its weights have a name, so its prefills may be kept
    return h


def _layers(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 2, 5, 4, generator=g), torch.randn(1, 2, 5, 4, generator=g)) for _ in range(3)]


def test_a_stored_prefill_comes_back_as_the_cache_dtype_keeps_it_and_an_answer_as_it_was(tmp_path):
    store = PrefillStore(tmp_path, torch.float16)
    assert store.kv([1, 2, 3]) is None and store.answer(("gen", 1)) == (False, None)
    layers = _layers()
    store.put_kv([1, 2, 3], layers)
    got = store.kv([1, 2, 3])
    assert len(got) == 3 and store.kv([1, 2, 4]) is None
    for (k, v), (k2, v2) in zip(layers, got):
        assert k2.dtype == torch.float32 and torch.equal(k2, k.half().float()) and torch.equal(v2, v.half().float())
    store.put_answer(("ll", (1, 2), 3), (-1.5, True))
    store.put_answer(("gen", (1, 2), 4), "forty two")
    assert store.answer(("ll", (1, 2), 3)) == (True, (-1.5, True))
    assert store.answer(("gen", (1, 2), 4)) == (True, "forty two")


def test_a_damaged_or_misplaced_entry_is_an_error_naming_the_file(tmp_path):
    store = PrefillStore(tmp_path, torch.float16)
    store.put_kv([1, 2, 3], _layers())
    (f,) = tmp_path.glob("kv-*.safetensors")
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x10  # a flipped bit in the last tensor
    f.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=rf"{f.name} fails its content hash.*delete the file"):
        store.kv([1, 2, 3])
    store.put_kv([7, 8], _layers(1))
    (other,) = set(tmp_path.glob("kv-*.safetensors")) - {f}
    other.replace(f)  # another context's prefill under this context's name
    with pytest.raises(IntegrityError, match="holds the prefill of another context"):
        store.kv([1, 2, 3])
    store.put_answer(("gen", 1), "yes")
    (a,) = tmp_path.glob("answer-*.json")
    a.write_text(a.read_text().replace('"yes"', '"no"'))
    with pytest.raises(IntegrityError, match=rf"{a.name} fails its content hash"):
        store.answer(("gen", 1))


def test_a_later_cell_loads_the_prefill_and_the_baseline_and_gets_what_computing_them_gives(named, tmp_path,
                                                                                            monkeypatch):
    def cell(store):
        monkeypatch.setattr(lm_module, "BASELINES", {})  # a new process: nothing kept in memory
        lm = CompressedKVLM(named, KIVI(bits=2, group_size=16), residual=0, progress=False, store=store)
        calls = []
        real = named.model.forward

        def forward(*a, **k):  # the tokens of every forward pass
            calls.append(k.get("input_ids", a[0] if a else None))
            return real(*a, **k)

        monkeypatch.setattr(named.model, "forward", forward)
        out = (lm.generate_until([GEN]), lm.loglikelihood([LL]), lm.replay().generate_until([GEN]),
               lm.replay().loglikelihood([LL]))
        monkeypatch.setattr(named.model, "forward", real)
        return out, lm.accounting["stored_prefills"], max(int(c.shape[1]) for c in calls if c is not None)

    fresh, stored_before, _ = cell(None)
    store = PrefillStore(tmp_path, torch.float16)
    first, stored_first, longest_first = cell(store)
    later, stored_later, longest_later = cell(store)
    assert fresh == first == later  # compressed answers, scores and the baseline's, to the last bit
    assert stored_before == stored_first == 0 and stored_later == 2  # both contexts came from the store
    # the later cell never fed a context through the model: its longest forward pass is a question or an answer
    assert longest_later < longest_first
    assert len(list(tmp_path.glob("answer-*.json"))) == 2


def test_a_model_built_in_the_process_keeps_nothing(tiny_model, tmp_path):
    built = ModelHandle.from_loaded(tiny_model, ByteTokenizer(), OmegaConf.create({"name": "tiny"}))
    lm = CompressedKVLM(built, KIVI(bits=2, group_size=16), residual=0, progress=False,
                        store=PrefillStore(tmp_path, torch.float16))
    assert lm.store is None
    lm.generate_until([GEN])
    assert not list(tmp_path.iterdir())


def test_the_eval_config_keeps_prefills_under_kvbench_home_unless_told_otherwise(named, tmp_path, monkeypatch):
    from kvbench.core.config import compose
    from kvbench.measure.evaluation.evaluate import prefill_store

    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    auto = prefill_store(compose(["+compressor=kivi"], "eval"), named)
    assert auto.folder.parent == tmp_path / "prefills" and auto.folder.name.startswith("tiny-")
    assert prefill_store(compose(["+compressor=kivi", "paths.prefills=null"], "eval"), named) is None
    there = prefill_store(compose(["+compressor=kivi", f"paths.prefills={tmp_path / 'p'}"], "eval"), named)
    assert there.folder.parent == tmp_path / "p"
    # another cache dtype is another store: the prefill is kept in the dtype the caches hold
    other = prefill_store(compose(["+compressor=kivi", "dtype=bfloat16"], "eval"), named)
    assert other.folder != auto.folder
