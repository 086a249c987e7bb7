"""The baseline's per-token NLLs are scored once per trace window in a process, and never shared across traces,
models built in the process or workloads."""

from types import SimpleNamespace

import numpy as np
import torch

from kvbench.measure import run as runner


class _Counting:
    def __init__(self, cfg, built=False):
        self.cfg, self.device, self.calls = cfg, "cpu", 0
        if built:
            self._meta = {"built_in_process": True}

    @property
    def model(self):
        self.calls += 1
        return "model"


def test_a_trace_windows_baseline_is_scored_once_and_only_reused_for_the_same_trace_and_model(monkeypatch):
    monkeypatch.setattr(runner, "_BASE_NLLS", {})
    monkeypatch.setattr(runner, "continuation_nlls", lambda model, kv, cont: np.arange(3.0))
    kv = SimpleNamespace(slice_tokens=lambda a, b: None)
    it = SimpleNamespace(kv=kv, score_from=8, continuation=torch.zeros(4))
    h = _Counting({"name": "smollm2_135m", "path": None})
    for _ in range(3):
        assert runner._base_nlls(h, "/traces/a", 0, it).tolist() == [0, 1, 2]
    assert h.calls == 1
    runner._base_nlls(h, "/traces/b", 0, it)  # another trace
    runner._base_nlls(h, "/traces/a", 1, it)  # another window
    runner._base_nlls(h, None, 0, it)  # a workload's sessions
    runner._base_nlls(h, None, 0, it)
    assert h.calls == 5
    other = _Counting({"name": "gemma3_270m", "path": None})
    runner._base_nlls(other, "/traces/a", 0, it)
    assert other.calls == 1
    built = _Counting({"name": "smollm2_135m", "path": None}, built=True)
    runner._base_nlls(built, "/traces/a", 0, it)
    runner._base_nlls(built, "/traces/a", 0, it)
    assert built.calls == 2


def test_a_bit_exact_decode_reuses_the_baselines_nlls_and_a_lossy_one_is_scored(tiny_cfg, tiny_handle, monkeypatch):
    from kvbench.core.config import make_compressor

    scored = []
    real = runner.continuation_nlls
    monkeypatch.setattr(runner, "continuation_nlls", lambda model, kv, cont: scored.append(kv) or real(model, kv, cont))
    monkeypatch.setattr(runner, "_BASE_NLLS", {})
    cfg = tiny_cfg("+compressor=identity")
    exact, _ = runner.measure(cfg, make_compressor(cfg.compressor), tiny_handle)
    windows = exact["n_sequences"]
    # the baseline, once per window and probe (next tokens, recall); the identical decoded caches are not scored again
    assert len(scored) == 2 * windows and exact["nll_compressed_reused"] == windows
    assert exact["nll_compressed"] == exact["nll_base"] and exact["delta_nll"] == 0.0
    assert exact["delta_nll_recall"] == 0.0 and exact["delta_nll_recall_ci"] == [0.0, 0.0]
    scored.clear()
    cfg = tiny_cfg("+compressor=kivi", "compressor.residual=0")  # no 16-bit window: every token quantized
    lossy, _ = runner.measure(cfg, make_compressor(cfg.compressor), tiny_handle)
    assert lossy["nll_compressed_reused"] == 0 and len(scored) >= windows  # every decoded cache scored
    assert lossy["nll_base"] == exact["nll_base"] and lossy["delta_nll"] != 0.0


def test_an_exact_cache_forced_through_the_compressed_path_scores_exactly_the_baseline(tiny_cfg, tiny_handle, monkeypatch):
    """With the baseline's NLLs not reused, the identity's decoded cache is scored by the same code path as any lossy
    cache: a difference between how the baseline and a decoded cache are scored would show here as a delta_nll."""
    from kvbench.core.config import make_compressor

    scored = []
    real = runner.continuation_nlls
    monkeypatch.setattr(runner, "continuation_nlls", lambda model, kv, cont: scored.append(kv) or real(model, kv, cont))
    monkeypatch.setattr(runner, "_BASE_NLLS", {})
    cfg = tiny_cfg("+compressor=identity", "metrics.reuse_exact_nll=false")
    forced, _ = runner.measure(cfg, make_compressor(cfg.compressor), tiny_handle)
    windows = forced["n_sequences"]
    assert forced["nll_compressed_reused"] == 0 and len(scored) == 4 * windows  # baseline and decoded, both probes
    assert forced["delta_nll"] == 0.0 and forced["delta_nll_ci"] == [0.0, 0.0]
    assert forced["delta_nll_recall"] == 0.0
