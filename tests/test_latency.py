"""End-to-end latency: the measurement loop on the tiny model, and the CLI on the real one."""

from __future__ import annotations

import json
import time

import pytest
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from compressors.identity import Identity
from compressors.kivi import KIVI
from kvbench.config import CONFIG_DIR
from kvbench.latency import Memory, format_latency, latency_ratios, measure_latency
from kvbench.models import ModelHandle
from kvbench.timing import PeakRSS


@pytest.fixture()
def latency_cfg(tmp_path, text_file, monkeypatch):
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path / "home"))

    def make(*overrides: str):
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = hydra_compose("latency", overrides=["model=hf", "model.path=unused", "dataset=text", f"dataset.path={text_file}",
                                                      "latency.contexts=[48,96]", "latency.decode_tokens=5", *overrides])
        OmegaConf.set_struct(cfg, False)
        return cfg

    return make


@pytest.fixture()
def own_handle(tokenizer):
    from conftest import tiny_llama

    # a model of its own: the latency run casts it to the cache dtype
    return ModelHandle.from_loaded(tiny_llama(seed=5), tokenizer, OmegaConf.create({"name": "hf", "source": "hf", "path": "unused"}))


def test_identity_decodes_the_same_tokens_as_the_plain_cache(latency_cfg, own_handle):
    summary, rows = measure_latency(latency_cfg("latency.residual=8", "latency.chunk=16"), Identity(), own_handle)
    assert [(r["context"], r["cache"]) for r in rows] == [(48, "dynamic"), (48, "compressed"), (96, "dynamic"), (96, "compressed")]
    assert all(r["tokens_match_dynamic"] == 1.0 for r in rows)
    assert summary["model_dtype"] == "float16"
    comp = rows[-1]
    # 96 prompt + 5 fed tokens: coded down to 8..23 window tokens, the rest as identity bitstreams (16 bit + frame)
    assert comp["cache_compressed_tokens"] + comp["cache_window_tokens"] == 101
    assert comp["bytes_held"] == comp["cache_nbytes"] > rows[-2]["bytes_held"]
    assert comp["compress_s"] > 0 and comp["decode_decompress_s"] > 0
    for r in rows:
        assert r["prefill_s"] > 0 and r["decode_p95_ms"] >= r["decode_median_ms"] > 0 and r["tokens_per_s"] > 0
    assert set(summary["ratios"]) == {"48", "96"} and "compressed / dynamic" in format_latency(summary)


def test_kivi_holds_fewer_bytes(latency_cfg, own_handle):
    summary, _ = measure_latency(latency_cfg("latency.residual=0", "latency.chunk=16", "latency.decode_tokens=2"),
                                 KIVI(bits=2, group_size=16), own_handle)
    assert summary["ratios"]["96"]["bytes_held"] < 0.5
    assert summary["cache"]["residual"] == 0


def test_ratios_are_compressed_over_dynamic():
    base = {"prefill_s": 2.0, "compress_s": 0.0, "decode_median_ms": 10.0, "decode_p95_ms": 20.0, "tokens_per_s": 100.0,
            "bytes_held": 1000, "peak_mem_delta_bytes": 50}
    comp = {**base, "compress_s": 1.0, "decode_median_ms": 30.0, "tokens_per_s": 25.0, "bytes_held": 250}
    r = latency_ratios([{"context": 8, "cache": "dynamic", **base}, {"context": 8, "cache": "compressed", **comp}])["8"]
    assert r["bytes_held"] == 0.25 and r["tokens_per_s"] == 0.25 and r["decode_median"] == 3.0
    assert r["prefill_plus_compress"] == 1.5


MB = 1024 * 1024


@pytest.mark.parametrize("kernel_mark", [True, False], ids=["vmhwm", "no-vmhwm"])
def test_memory_peak_sees_an_allocation(kernel_mark, monkeypatch):
    if not kernel_mark:  # a sandbox whose /proc/self/status has no usable high-water mark
        monkeypatch.setattr("kvbench.timing._status_bytes", lambda field: 0)
    mem = Memory("cpu")
    mem.start()
    x = torch.ones(256 * MB // 4)  # touched, so resident
    peak, delta = mem.peak()
    del x
    # the closing sample sees whatever is still alive, so neither a refused VmHWM reset nor the sampling interval
    # can hide it
    assert delta >= 200 * MB
    assert peak >= 256 * MB  # the whole resident set, x included


def test_memory_peak_sees_an_allocation_freed_inside_the_block():
    rss = PeakRSS()
    rss.start()
    x = torch.ones(256 * MB // 4)
    # samples counts readings already folded into the peak; the second one after this point began after x existed
    seen = rss.samples
    deadline = time.monotonic() + 60
    while rss.samples < seen + 2:
        if time.monotonic() > deadline:
            pytest.fail("the sampling thread took no sample in a minute")
        time.sleep(0.001)
    del x
    peak = rss.stop()
    assert peak - rss.base >= 200 * MB


def test_memory_stops_its_sampler_when_the_run_raises():
    with pytest.raises(RuntimeError), Memory("cpu") as mem:
        raise RuntimeError
    assert mem._rss._thread is None


def test_bad_contexts_are_refused(latency_cfg, own_handle):
    with pytest.raises(ValueError, match="latency.contexts"):
        measure_latency(latency_cfg("latency.contexts=[]"), Identity(), own_handle)


@pytest.mark.integration
def test_latency_cli_on_smollm2(tmp_path):
    from kvbench.__main__ import main

    assert main(["latency", "+compressor=kivi", "latency.contexts=[256]", "latency.decode_tokens=4", f"paths.results={tmp_path}"]) == 0
    (f,) = tmp_path.glob("runs/latency-kivi-*/latency.json")
    s = json.loads(f.read_text())
    assert [r["cache"] for r in s["rows"]] == ["dynamic", "compressed"]
    # KIVI keeps its 128-token window in 16 bit and codes the other 128 tokens at ~3 bits per value
    assert 0.4 < s["ratios"]["256"]["bytes_held"] < 0.75
