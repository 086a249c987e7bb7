"""Every kind of run records what it was measured on and under: ``torch_threads``, ``load_average_1min`` and
``machine`` (tiny model, smallest settings of each command)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ByteTokenizer
from omegaconf import OmegaConf

from kvbench.core.machine import conditions, machine
from kvbench.sweep.cells import run_cell

FIELDS = ("torch_threads", "load_average_1min", "machine")


def test_conditions_name_the_threads_the_load_and_the_machine():
    got = conditions()
    assert got["torch_threads"] == torch.get_num_threads() and got["machine"] == machine()
    assert "CPU cores" in got["machine"] and f"torch {torch.__version__}" in got["machine"]
    assert conditions(3, 0.25) == {"torch_threads": 3, "load_average_1min": 0.25, "machine": machine()}


@pytest.mark.parametrize("kind, overrides", [
    ("run", ("+compressor=identity", "metrics.nll=false")),
    ("latency", ("+compressor=identity", "latency.contexts=[32]", "latency.decode_tokens=2", "latency.rounds=1")),
    ("restore", ("+compressor=identity", "restore.contexts=[32]", "restore.repeats=1", "restore.threads=1")),
    ("stepcost", ("+compressor=recompute", "compressor.threads=1", "stepcost.tokens=12", "stepcost.repeats=1")),
])
def test_every_kind_of_run_records_its_conditions(kind, overrides, tiny_cfg, tiny_model, tokenizer):
    from kvbench.inputs.models import ModelHandle
    from kvbench.store.results import kind_of

    handle = ModelHandle.from_loaded(tiny_model, tokenizer, OmegaConf.create({"name": "hf", "source": "hf",
                                                                              "path": "unused"}))
    out = run_cell(kind, tiny_cfg(*overrides, config_name=kind), handle, resume=False)
    written = json.loads((out.path / kind_of(kind).summary).read_text())
    assert all(k in written for k in FIELDS), sorted(set(FIELDS) - set(written))
    assert written["machine"] == machine() and written["load_average_1min"] >= 0
    assert written["torch_threads"] == (1 if kind in ("restore", "stepcost") else torch.get_num_threads())


def test_an_eval_run_records_its_conditions(tiny_model, tmp_path, monkeypatch):
    from compressors.exact.identity import Identity
    from kvbench.inputs.models import ModelHandle
    from kvbench.measure.evaluation.evaluate import evaluate
    from kvbench.measure.evaluation.tasks import task_config

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    mc = tmp_path / "mc.jsonl"
    mc.write_text("".join(json.dumps({"context": f"Q{i}: is {i} even?\nA:", "choices": ["yes", "no"], "label": i % 2})
                          + "\n" for i in range(2)))
    handle = ModelHandle.from_loaded(tiny_model, ByteTokenizer(), OmegaConf.create({"name": "tiny", "source": "hf",
                                                                                    "path": "x"}))
    cfg = OmegaConf.create({"model": {"name": "tiny"}, "device": "cpu", "dtype": "float16", "seed": 0, "tasks": [],
                            "limit": 2, "bootstrap_iters": 0, "cache": {"residual": 0, "chunk": 128, "mode": "auto"}})
    summary, _ = evaluate(cfg, Identity(), handle, progress=False, specs=[task_config("bigbench", "toy_mc", mc)])
    assert {k: summary[k] for k in FIELDS} == {**conditions(load=summary["load_average_1min"])}
