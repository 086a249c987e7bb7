"""The harness end to end on a tiny random model: capture, trace reuse, rates, distortion, NLL, output files."""

import json
import math

import pandas as pd
import pytest
import torch

from kvbench.core.config import make_compressor
from kvbench.inputs.capture import capture_window, default_trace_dir, load_or_capture, load_trace
from kvbench.inputs.data import sample_windows
from kvbench.measure.run import measure
from kvbench.store.results import reuse_or_measure


def test_capture_matches_the_models_own_cache(tiny_model):
    from transformers import DynamicCache

    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0))
    got = capture_window(tiny_model, ids, 32, torch.float16, pre_rope=True)
    with torch.no_grad():
        out = tiny_model(ids[:32][None], cache=DynamicCache(), use_cache=True)
    assert got["k"].shape == (2, 2, 32, 16)
    assert torch.equal(got["k"][1], out.cache.layers[1].keys[0].half())
    assert torch.equal(got["v"][0], out.cache.layers[0].values[0].half())
    assert got["logprobs"].shape == (31,) and (got["logprobs"] <= 0).all()
    # pre-RoPE keys differ from the cached ones everywhere but position 0 (rotation by angle 0)
    assert torch.allclose(got["k_pre_rope"][:, :, 0], got["k"][:, :, 0], atol=1e-3)
    assert not torch.allclose(got["k_pre_rope"][:, :, 5:], got["k"][:, :, 5:], atol=1e-2)


def test_sampling_is_deterministic_and_sized(tokenizer, text_file):
    docs = [text_file.read_text()]
    a = sample_windows(docs, tokenizer, 5, 100, seed=3)
    b = sample_windows(docs, tokenizer, 5, 100, seed=3)
    c = sample_windows(docs, tokenizer, 5, 100, seed=4)
    assert a.shape == (5, 100) and torch.equal(a, b) and not torch.equal(a, c)
    with pytest.raises(Exception, match="windows"):
        sample_windows(["short text"], tokenizer, 2, 100, seed=0)


def test_trace_roundtrip_and_reuse(tiny_cfg, tiny_handle):
    cfg = tiny_cfg()
    trace = load_or_capture(cfg, tiny_handle)
    assert trace.path == default_trace_dir(cfg)
    assert [s.role for s in trace.sequences] == ["eval", "eval", "calib"]
    s = trace.eval[0]
    assert s.kv.shape == (2, 2, 64, 16) and s.continuation.numel() == 17 and s.kv.k.dtype == torch.float16
    m = trace.manifest
    assert m["model"]["n_kv_heads"] == 2 and m["dataset"]["seq_len"] == 64 and m["git_sha"]
    again = load_trace(trace.path)
    assert torch.equal(again.eval[1].kv.v, trace.eval[1].kv.v)


def test_identity_is_exact_with_ratio_one_and_zero_delta_nll(tiny_cfg, tiny_handle):
    cfg = tiny_cfg("+compressor=identity")
    summary, rows = measure(cfg, make_compressor(cfg.compressor), tiny_handle)
    assert summary["lossless"] is True
    assert summary["delta_nll"] == 0.0
    assert summary["rel_mse_k"] == 0.0 and summary["rel_mse_v"] == 0.0
    # the ratio is 1.0 up to the frame: header and checksum of a few dozen bytes per sequence
    assert summary["compression_ratio"] == pytest.approx(1.0, abs=2e-3)
    assert summary["compression_ratio"] < 1.0
    assert summary["total_bits"] == summary["n_elements"] * 16 + summary["bits_by_part"]["frame"]
    assert len(rows) == 2 * 2
    # the tiny model's cache: its layers, KV heads and head_dim, read off the trace
    cfg_model = tiny_handle.config
    assert (summary["n_layers"], summary["n_kv_heads"], summary["head_dim"]) == (
        cfg_model.num_hidden_layers, cfg_model.num_key_value_heads, cfg_model.hidden_size // cfg_model.num_attention_heads)
    assert summary["n_elements"] == summary["n_tokens"] * 2 * summary["n_layers"] * summary["n_kv_heads"] * summary["head_dim"]
    assert summary["decode_flops_per_token"] == 0.0  # no model runs to decode
    assert summary["bits_per_element_amortized"] == summary["bits_per_element"]  # nothing fitted to spread
    assert math.isnan(summary["rd_bits_per_element"])  # no finite rate reaches zero error


def test_kivi_summary_rows_and_files(tiny_cfg, tiny_handle):
    cfg = tiny_cfg("+compressor=kivi", "compressor.bits=2", "compressor.residual=0", "compressor.group_size=16")
    comp = make_compressor(cfg.compressor)
    summary, rows = measure(cfg, comp, tiny_handle)
    assert summary["lossless"] is False and summary["rel_mse_k"] > 0
    # 2-bit codes + a 16-bit scale and zero per 16 elements, exactly, plus the frame
    payload = summary["total_bits"] - summary["bits_by_part"]["frame"]
    assert payload / summary["n_elements"] == 2 + 2 * 16 / 16
    assert summary["bits_per_element"] > 4.0
    # a Gaussian coder matched to these windows' covariance would need fewer bits for KIVI's error than KIVI spends
    assert 0 < summary["rd_bits_per_element"] < summary["stream_bits_per_element"]
    assert 0 < summary["rd_bits_per_element_pre_rope"] < summary["stream_bits_per_element"]
    # KIVI weighs K's and V's error alike; K and V free to trade error at the same total need no more bits
    assert summary["rd_key_weight"] == 1.0
    assert 0 < summary["rd_bits_per_element_weighted"] <= summary["rd_bits_per_element_pre_rope"] * (1 + 1e-9)
    assert summary["compression_ratio"] == pytest.approx(16 * summary["n_elements"] / summary["total_bits"])
    assert summary["bits_per_token"] == pytest.approx(summary["total_bits"] / summary["n_tokens"])
    from omegaconf import OmegaConf

    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    run_dir = reuse_or_measure("run", cfg_dict, comp.name, comp.describe(), lambda: (summary, rows), resume=False).path
    loaded = json.loads((run_dir / "summary.json").read_text())
    contract = ["compressor", "model", "dataset", "n_tokens", "n_elements", "total_bits", "bits_per_element",
                "bits_per_token", "compression_ratio", "bound_bits_per_token", "lossless", "encode_s", "decode_s",
                "rel_mse_k", "rel_mse_v", "nll_base", "nll_compressed", "delta_nll", "git_sha", "config"]
    assert not [k for k in contract if k not in loaded]
    assert loaded["config"] == json.loads((run_dir / "config.json").read_text()) and loaded["kind"] == "run"
    df = pd.read_parquet(run_dir / "rows.parquet")
    assert len(df) == 2 * 2 and set(df["kind"]) == {"k", "v"}


def test_a_fitted_coders_weighted_rate_takes_its_key_weight(tiny_cfg, tiny_handle):
    cfg = tiny_cfg("+compressor=kvtc", "compressor.bits=2", "compressor.window=0",
                   "compressor.key_weight=0.3")
    summary, _ = measure(cfg, make_compressor(cfg.compressor), tiny_handle)
    assert summary["rd_key_weight"] == pytest.approx(0.3)
    assert 0 < summary["rd_bits_per_element_weighted"] <= summary["rd_bits_per_element_pre_rope"] * (1 + 1e-9)


def test_trace_dtype_mismatch_is_refused(tiny_cfg, tiny_handle):
    cfg = tiny_cfg("+compressor=identity")
    load_or_capture(cfg, tiny_handle)
    cfg2 = tiny_cfg("+compressor=identity", "dtype=bfloat16", f"trace={default_trace_dir(cfg)}")
    with pytest.raises(ValueError, match="float16"):
        measure(cfg2, make_compressor(cfg2.compressor), tiny_handle)


class _NoModel:
    """A handle whose model must not be touched: runs on a stored trace without the NLL metric."""

    cfg = None
    config = None  # no model installed to read it from
    loaded = False

    @property
    def model(self):
        raise AssertionError("the model was loaded although the trace and metrics did not need it")

    tokenizer = model


def test_stored_trace_runs_without_loading_the_model(tiny_cfg, tiny_handle):
    trace = load_or_capture(tiny_cfg(), tiny_handle)
    cfg = tiny_cfg("+compressor=kivi", "compressor.residual=0", f"trace={trace.path}", "metrics.nll=false")
    summary, _ = measure(cfg, make_compressor(cfg.compressor), _NoModel())
    assert summary["model_loaded"] is False and summary["rel_mse_k"] > 0
    assert summary["delta_nll"] != summary["delta_nll"]  # NaN: not measured, not made up


def test_missing_trace_says_how_to_make_one(tiny_cfg, tmp_path):
    cfg = tiny_cfg("+compressor=kivi", f"trace={tmp_path / 'nowhere'}")
    with pytest.raises(FileNotFoundError, match="kvbench capture"):
        measure(cfg, make_compressor(cfg.compressor), _NoModel())
