"""End-to-end latency: the measurement loop on the tiny model, and the CLI on the real one."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from compressors.exact.identity import Identity
from compressors.quantizers.kivi import KIVI
from kvbench.core.config import CONFIG_DIR
from kvbench.core.timing import PeakRSS
from kvbench.inputs.models import ModelHandle
from kvbench.measure.baselines import TransformersQuantized, quantized_cache_nbytes, transformers_quantized
from kvbench.measure.latency import Memory, format_latency, latency_ratios, measure_latency
from kvbench.store.results import cell_key

# the baseline's backend: installed by the test set-up (`make test` installs the `hqq` extra)
needs_hqq = pytest.mark.skipif(importlib.util.find_spec("hqq") is None,
                               reason="hqq is not installed (pip install -e '.[hqq]'); make test installs it")


@pytest.fixture()
def latency_cfg(tmp_path, text_file, monkeypatch):
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path / "home"))

    def make(*overrides: str):
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = hydra_compose("latency", overrides=["model=hf", "model.path=unused", "dataset=text", f"dataset.path={text_file}",
                                                      "latency.contexts=[48,96]", "latency.decode_tokens=5", "latency.rounds=2",
                                                      *overrides])
        OmegaConf.set_struct(cfg, False)
        return cfg

    return make


@pytest.fixture()
def own_handle(tokenizer):
    from conftest import tiny_llama

    # a model of its own: the latency run casts it to its compute dtype
    return ModelHandle.from_loaded(tiny_llama(seed=5), tokenizer, OmegaConf.create({"name": "hf", "source": "hf", "path": "unused"}))


def test_identity_decodes_the_same_tokens_as_the_plain_cache(latency_cfg, own_handle):
    summary, rows = measure_latency(latency_cfg("cache.residual=8", "cache.chunk=16"), Identity(), own_handle)
    assert [(r["context"], r["cache"]) for r in rows] == [(48, "dynamic"), (48, "compressed"), (96, "dynamic"), (96, "compressed")]
    assert all(r["tokens_match_dynamic"] == 1.0 for r in rows)
    # the model computes in float32 on the CPU; every cache, the plain one too, holds the 16-bit cache dtype
    assert summary["model_dtype"] == "float32" and summary["rounds"] == 2
    assert {r["dtype"] for r in rows} == {"float16"}
    assert all(r["rounds"] == 2 and len(r["tokens_per_s_rounds"]) == 2 and r["tokens_per_s_iqr"] >= 0 for r in rows)
    comp = rows[-1]
    # 96 prompt + 5 fed tokens: coded down to 8..23 window tokens, the rest as identity bitstreams (16 bit + frame)
    assert comp["cache_compressed_tokens"] + comp["cache_window_tokens"] == 101
    # identity holds the 16-bit tensors parsed from its segments: what the plain cache holds; its bitstreams add a frame
    assert comp["bytes_held"] == comp["cache_nbytes"] == rows[-2]["bytes_held"] < comp["cache_segment_bytes"] + 2 * 2 * 2 * comp["cache_window_tokens"] * 16 * 2
    assert comp["compress_s"] > 0 and comp["decode_decompress_s"] > 0
    for r in rows:
        assert r["prefill_s"] > 0 and r["decode_p95_ms"] >= r["decode_median_ms"] > 0 and r["tokens_per_s"] > 0
    assert set(summary["ratios"]) == {"48", "96"} and "compressed / dynamic" in format_latency(summary)


def test_kivi_holds_fewer_bytes(latency_cfg, own_handle):
    summary, _ = measure_latency(latency_cfg("cache.residual=0", "cache.chunk=16", "latency.decode_tokens=2"),
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


def hqq_bytes(n_quantized: int, n_residual: int, *, layers: int, heads: int, head_dim: int, nbits: int, group: int,
              elem: int = 2) -> int:
    """Bytes of an HQQ QuantizedCache by hand: per layer and K/V, packed codes, a scale and a zero per group, and
    the 16-bit residual tokens."""
    values = heads * n_quantized * head_dim
    per_kind = values * nbits // 8 + 2 * (values // group) * elem + heads * n_residual * head_dim * elem
    return layers * 2 * per_kind


@needs_hqq
def test_quantized_cache_baseline_rows(latency_cfg, own_handle):
    summary, rows = measure_latency(latency_cfg("cache.residual=8", "cache.chunk=16",
                                                "latency.baselines=[transformers_quantized]"),
                                    KIVI(bits=2, group_size=16), own_handle)
    assert [(r["context"], r["cache"]) for r in rows] == [(T, c) for T in (48, 96)
                                                          for c in ("dynamic", "compressed", "transformers_quantized")]
    base = {r["context"]: r for r in rows if r["cache"] == "transformers_quantized"}
    plain = {r["context"]: r for r in rows if r["cache"] == "dynamic"}
    comp = {r["context"]: r for r in rows if r["cache"] == "compressed"}
    for T, b in base.items():
        # the compressor's bits, one group per token and head (head_dim 16), the compressed cache's residual
        assert (b["nbits"], b["q_group_size"], b["residual_length"]) == (2, 16, 8)
        assert "HQQ 2-bit" in b["label"] and "per token" in b["note"]
        assert 0.0 <= b["tokens_match_dynamic"] <= 1.0 and b["decode_median_ms"] > 0 and b["prefill_s"] > 0
        # 5 decoded tokens stay below the residual length of 8: the prompt quantized, the 5 new tokens in 16 bit
        assert b["bytes_held"] == hqq_bytes(T, 5, layers=2, heads=2, head_dim=16, nbits=2, group=16)
        assert b["bytes_held"] < plain[T]["bytes_held"]
        r = summary["ratios"][str(T)]["transformers_quantized"]
        assert r["vs_dynamic"]["bytes_held"] == b["bytes_held"] / plain[T]["bytes_held"]
        assert r["compressed_vs_baseline"]["decode_median"] == comp[T]["decode_median_ms"] / b["decode_median_ms"]
        assert r["compressed_vs_baseline"]["bytes_held"] == comp[T]["bytes_held"] / b["bytes_held"]
    assert summary["baselines"]["transformers_quantized"]["nbits"] == 2
    text = format_latency(summary)
    assert "compressed / transformers_quantized" in text and "transformers_quantized / dynamic" in text


@needs_hqq
def test_quantized_cache_bytes_equal_a_hand_sum(own_handle):
    model = own_handle.model.to(torch.float16)
    cache = TransformersQuantized(nbits=4, q_group_size=8, residual_length=4).make(model.config)
    ids = torch.arange(40).unsqueeze(0) % 128  # (1, 40)
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True)
        for _ in range(6):  # the 4th token flushes the residual into the quantized part; 2 remain in 16 bit
            out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    by_hand = 0
    for layer in cache.layers:
        for codes, meta in (layer._quantized_keys, layer._quantized_values):
            by_hand += codes.nbytes + meta["scale"].nbytes + meta["zero"].nbytes
        by_hand += layer.keys.nbytes + layer.values.nbytes
    assert cache.layers[0].keys.shape[-2] == 2
    assert quantized_cache_nbytes(cache) == by_hand == hqq_bytes(44, 2, layers=2, heads=2, head_dim=16, nbits=4, group=8)


@needs_hqq
def test_quantized_cache_settings_follow_the_run(own_handle):
    config = own_handle.model.config
    kivi = transformers_quantized({}, KIVI(bits=3), None, config)
    assert (kivi.nbits, kivi.q_group_size, kivi.residual_length) == (3, 16, 128)  # KIVI's own residual
    ident = transformers_quantized({"residual_length": None}, Identity(), 32, config)
    assert (ident.nbits, ident.residual_length) == (4, 32)
    assert transformers_quantized({"nbits": 8, "q_group_size": 4}, KIVI(bits=2), 0, config).nbits == 8
    with pytest.raises(ValueError, match=r"nbits to one of \[1, 2, 3, 4, 8\]"):
        transformers_quantized({}, KIVI(bits=5), None, config)
    with pytest.raises(ValueError, match="must divide head_dim=16"):
        transformers_quantized({"q_group_size": 6}, KIVI(bits=2), None, config)


def test_unknown_baseline_names_the_allowed_ones(latency_cfg, own_handle):
    with pytest.raises(ValueError, match=r"latency.baselines='kvpress' is not allowed.*transformers_quantized"):
        measure_latency(latency_cfg("latency.baselines=[kvpress]"), Identity(), own_handle)


def test_missing_hqq_says_how_to_install_it(latency_cfg, own_handle, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr("kvbench.measure.baselines.importlib.util.find_spec",
                        lambda name, *a: None if name == "hqq" else find_spec(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r"pip install -e '\.\[hqq\]'"):
        measure_latency(latency_cfg("latency.baselines=[transformers_quantized]"), Identity(), own_handle)


def test_ratios_against_a_baseline():
    base = {"prefill_s": 2.0, "compress_s": 0.0, "decode_median_ms": 10.0, "decode_p95_ms": 20.0, "tokens_per_s": 100.0,
            "bytes_held": 1000, "peak_mem_delta_bytes": 50}
    comp = {**base, "compress_s": 1.0, "decode_median_ms": 30.0, "tokens_per_s": 25.0, "bytes_held": 250}
    quant = {**base, "decode_median_ms": 20.0, "tokens_per_s": 50.0, "bytes_held": 500}
    r = latency_ratios([{"context": 8, "cache": "dynamic", **base}, {"context": 8, "cache": "compressed", **comp},
                        {"context": 8, "cache": "transformers_quantized", **quant}])["8"]
    assert r["decode_median"] == 3.0 and r["bytes_held"] == 0.25  # compressed over dynamic, as before
    q = r["transformers_quantized"]
    assert q["vs_dynamic"]["decode_median"] == 2.0 and q["vs_dynamic"]["bytes_held"] == 0.5
    assert q["compressed_vs_baseline"]["decode_median"] == 1.5 and q["compressed_vs_baseline"]["tokens_per_s"] == 0.5
    assert q["compressed_vs_baseline"]["prefill_plus_compress"] == 1.5


def test_no_baselines_keep_the_cell_key(latency_cfg):
    """Runs filed before latency.baselines existed keep their keys while no baseline is asked for."""
    cfg = OmegaConf.to_container(latency_cfg(), resolve=True)
    before = {**cfg, "latency": {k: v for k, v in cfg["latency"].items() if k not in ("baselines", "quantized_cache")}}
    assert cell_key(cfg) == cell_key(before)
    asked = OmegaConf.to_container(latency_cfg("latency.baselines=[transformers_quantized]"), resolve=True)
    assert cell_key(asked) != cell_key(cfg)


MB = 1024 * 1024


def _resident(nbytes: int):
    """``nbytes`` of fresh, touched memory: an anonymous mapping is new pages from the kernel whatever the allocator
    holds on to (a tensor may reuse pages a freed one left resident, and then no resident-set reading can see it)."""
    import mmap

    import numpy as np

    buf = mmap.mmap(-1, nbytes)
    np.frombuffer(buf, dtype=np.uint8)[:] = 1
    return buf


@pytest.mark.parametrize("kernel_mark", [True, False], ids=["vmhwm", "no-vmhwm"])
def test_memory_peak_sees_an_allocation(kernel_mark, monkeypatch):
    if not kernel_mark:  # a sandbox whose /proc/self/status has no usable high-water mark
        monkeypatch.setattr("kvbench.core.timing._status_bytes", lambda field: 0)
    mem = Memory("cpu")
    mem.start()
    x = _resident(256 * MB)
    peak, delta = mem.peak()
    x.close()
    # the closing sample sees whatever is still alive, so neither a refused VmHWM reset nor the sampling interval
    # can hide it
    assert delta >= 200 * MB
    assert peak >= 256 * MB  # the whole resident set, x included


def test_memory_peak_sees_an_allocation_freed_inside_the_block():
    rss = PeakRSS()
    rss.start()
    x = _resident(256 * MB)
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
