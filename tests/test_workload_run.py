"""`run` in workload mode: every session captured on its own, coded as a set (trie, pipeline) or one by one."""

import json
import os
import subprocess
import sys

import pytest

from kvbench.core.config import make_compressor
from kvbench.measure.run import measure
from kvbench.store.results import reuse_or_measure

SMALL = ["workload=shared_system", "workload.n_sessions=4", "workload.system_tokens=80", "workload.user_tokens=30"]
CONTRACT = ["compressor", "model", "dataset", "n_tokens", "n_elements", "total_bits", "bits_per_element", "bits_per_token",
            "compression_ratio", "bound_bits_per_token", "lossless", "encode_s", "decode_s", "rel_mse_k", "rel_mse_v",
            "nll_base", "nll_compressed", "delta_nll", "git_sha", "config"]


def test_trie_run_writes_the_summary_with_sharing_statistics(tiny_cfg, tiny_handle):
    from omegaconf import OmegaConf

    cfg = tiny_cfg("+compressor=trie", *SMALL)
    comp = make_compressor(cfg.compressor)
    summary, rows = measure(cfg, comp, tiny_handle)
    assert summary["lossless"] is True and summary["delta_nll"] == 0.0 and summary["rel_mse_k"] == 0.0
    assert summary["workload"] == "shared_system" and summary["n_sequences"] == 4
    sharing = summary["sharing"]
    assert sharing["sessions"] == 4 and sharing["tokens"] == summary["n_tokens"] and sharing["share_rate"] > 0.3
    # every session's KV beyond its whole shared blocks is stored once, at 16 bits: the bits follow the statistics
    per_token = summary["n_elements"] // summary["n_tokens"] // 2  # L * H * D
    assert summary["bits_by_part"]["k"] == 16 * per_token * (sharing["tokens"] - sharing["ideal_hit_tokens"])
    assert summary["prefix_cache"]["hit_rate"] == sharing["ideal_hit_rate"]
    assert summary["compression_ratio"] == pytest.approx(16 * summary["n_elements"] / summary["total_bits"])
    kv = summary["shared_prefix_kv"]
    assert kv["pairs"] == 3 and kv["identical_pairs"] == 3 and kv["max_abs_diff"] == 0.0
    assert summary["bound_dedup_bits_per_token"] < summary["bound_bits_per_token"]
    assert summary["sessions_captured"] == 4 and len(rows) == 2 * 2
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    out = reuse_or_measure("run", cfg_dict, comp.name, comp.describe(), lambda: (summary, rows), resume=False)
    loaded = json.loads((out.path / "summary.json").read_text())
    assert not [k for k in CONTRACT if k not in loaded] and loaded["config"]["workload"]["n_sessions"] == 4
    again, _ = measure(cfg, make_compressor(cfg.compressor), tiny_handle)
    assert again["sessions_captured"] == 0 and again["total_bits"] == summary["total_bits"]


def test_pipeline_and_its_inner_alone_on_the_same_sessions(tiny_cfg, tiny_handle):
    alone_cfg = tiny_cfg("+compressor=kivi", "compressor.residual=0", "compressor.group_size=16", *SMALL)
    alone, _ = measure(alone_cfg, make_compressor(alone_cfg.compressor), tiny_handle)
    pipe_cfg = tiny_cfg("+compressor=pipeline", "compressor.inner={name:kivi,residual:0,group_size:16}", *SMALL)
    pipe, _ = measure(pipe_cfg, make_compressor(pipe_cfg.compressor), tiny_handle)
    assert alone["n_tokens"] == pipe["n_tokens"] and not pipe["lossless"]
    assert pipe["total_bits"] < 0.8 * alone["total_bits"]
    assert any(k.startswith("inner/") for k in pipe["bits_by_part"])
    # the shared prefix decodes from one stored copy: the distortion is that copy's, not a new one
    assert pipe["rel_mse_k"] == pytest.approx(alone["rel_mse_k"], rel=0.5)


@pytest.mark.integration
def test_trie_on_shared_system_with_smollm2(tmp_path):
    env = {**os.environ, "KVBENCH_RESULTS": str(tmp_path)}
    args = ["+compressor=trie", "workload=shared_system", "workload.n_sessions=6", "workload.system_tokens=128",
            "workload.user_tokens=48"]
    run = subprocess.run([sys.executable, "-m", "kvbench", "run", *args], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (path,) = (tmp_path / "runs").glob("trie-*/summary.json")
    s = json.loads(path.read_text())
    assert s["lossless"] is True and s["model"] == "smollm2_135m" and s["n_sequences"] == 6
    # the KV of the shared system prompt from six independent prefills was compared; CPU kernels may round it
    # differently for different prompt lengths (by one fp16 step at most), never by more
    kv = s["shared_prefix_kv"]
    assert kv["pairs"] == 5 and kv["tokens_compared"] >= 5 * 128 and kv["max_abs_diff"] < 0.05
    assert s["sharing"]["share_rate"] > 0.5 and s["compression_ratio"] > 1.5
    assert s["delta_nll"] == 0.0


def test_shared_prefix_kv_reports_where_two_prefills_differ():
    import torch

    from kvbench.core.kv import KVSequence
    from kvbench.measure.sessions import CapturedSession, shared_prefix_kv

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 1, 40, 8, generator=g).half(), torch.randn(2, 1, 40, 8, generator=g).half()
    toks = torch.arange(40)
    a = CapturedSession(KVSequence(k, v, toks), torch.zeros(39), "x")
    b_k = k[:, :, :30].clone()
    b_k[1, 0, 12, 0] += 0.5  # the second prefill rounds token 12 of layer 1 differently
    b = CapturedSession(KVSequence(b_k, v[:, :, :30].clone(), toks[:30]), torch.zeros(29), "x")
    c = CapturedSession(KVSequence(k[:, :, :20].clone(), v[:, :, :20].clone(), toks[:20]), torch.zeros(19), "x")
    got = shared_prefix_kv([a, b, c])
    assert got["pairs"] == 2 and got["identical_pairs"] == 1 and got["tokens_compared"] == 30 + 20
    assert got["max_abs_diff"] == pytest.approx(0.5, abs=1e-3) and got["tokens_after_first_difference"] == 30 - 12
    (ex,) = got["differing_pairs"]
    assert ex == {"session": 1, "tokens": 30, "earlier": 0, "earlier_tokens": 40, "shared": 30, "first_difference": 12,
                  "max_abs_diff": got["max_abs_diff"]}
