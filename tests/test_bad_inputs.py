"""Inputs that used to be ignored or clamped without a word: each is refused with a one-line error naming what is
allowed, or recorded as it was applied."""

import re

import pytest
import torch
from conftest import tiny_windows
from omegaconf import OmegaConf

from compressors.eviction.evict import protected_kept, select
from compressors.eviction.h2o import H2O
from compressors.eviction.snapkv import SnapKV
from compressors.eviction.streaming_llm import StreamingLLM
from compressors.transform.waterfill import Waterfill
from kvbench.core.config import compose
from kvbench.core.kv import Context
from kvbench.inputs.assets import MODELS
from kvbench.inputs.models import ModelHandle, resolve_model_dir

# ---------------------------------------------------------------------------------------------- model.path


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_path_given_with_a_packaged_model_is_refused(model, tmp_path):
    cfg = compose([f"model={model}", f"model.path={tmp_path}"], config_name="run")
    with pytest.raises(ValueError, match=r"model\.path=.* is only read with model=hf .*packaged models: "
                                         + re.escape(str(sorted(MODELS)))):
        ModelHandle(cfg.model)
    with pytest.raises(ValueError, match="only read with model=hf"):
        resolve_model_dir(cfg.model)


def test_a_path_is_read_with_model_hf(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cfg = compose(["model=hf", f"model.path={tmp_path}"], config_name="run")
    assert resolve_model_dir(cfg.model) == tmp_path
    ModelHandle(OmegaConf.create({"name": "smollm2_135m", "source": "packaged", "path": None}))  # no path: fine


# ---------------------------------------------------------------------------------------------- always kept


@pytest.mark.parametrize(("comp", "T", "text"), [
    (SnapKV(keep=0.5, window=100000), 256, "128 last"),  # the window is cut to what the budget keeps
    (SnapKV(keep=0.5, window=64), 256, "64 last"),
    (StreamingLLM(keep=0.01, sinks=4), 256, "2 sinks"),  # 2 kept in all: no room for the 4 sinks, none for recent
    (StreamingLLM(keep=0.5, sinks=4), 256, "4 sinks + 124 recent"),
    (H2O(keep=0.5, recent=1.0), 100, "50 recent"),
])
def test_always_kept_says_what_was_kept(comp, T, text):
    assert comp.always_kept(T).text() == text


@pytest.mark.parametrize(("sinks", "window", "T", "k"), [(0, 100000, 256, 128), (4, 100000, 256, 128),
                                                          (300, 0, 256, 100), (4, 10, 256, 5), (2, 3, 8, 8)])
def test_protected_tokens_are_the_ones_select_keeps_whatever_the_scores(sinks, window, T, k):
    kept = protected_kept(sinks, window, T, k)
    # scores that rank every protected token lowest: what is kept of the ends is what protection kept
    worst = torch.zeros(1, 1, T)
    worst[..., :sinks] = -1e9
    worst[..., max(0, T - window):] = -1e9
    mask = select(worst, k, sinks, window)[0, 0]
    ends = torch.zeros(T, dtype=torch.bool)
    ends[: kept.sinks] = True
    if kept.recent:
        ends[T - kept.recent :] = True
    assert int(mask.sum()) == k and mask[ends].all()
    assert kept.sinks + kept.recent <= k
    protected_region = torch.zeros(T, dtype=torch.bool)
    protected_region[:sinks] = True
    protected_region[max(0, T - window):] = True
    assert int((mask & protected_region).sum()) == kept.sinks + kept.recent


# ---------------------------------------------------------------------------------------------- waterfill budget


@pytest.fixture(scope="module")
def waterfill_trace():
    model, (a, b, scored) = tiny_windows([96, 96, 64])
    return model, [a, b], scored


def test_a_waterfill_budget_below_the_fixed_cost_names_the_smallest_possible(waterfill_trace):
    model, calib, kv = waterfill_trace
    comp = Waterfill(bits=0.01, obs_window=8)
    comp.fit(calib, config=model.config)
    ctx = Context.for_kv(kv, model, model.config)
    with pytest.raises(ValueError, match=r"waterfill\.bits=0\.01 is below the fixed cost of this 64-token sequence: "
                                         r"4 exact sink token\(s\).* smallest budget possible here is "
                                         r"waterfill\.bits=(\S+) ") as err:
        comp.encode(kv, ctx)
    least = float(str(err.value).split("waterfill.bits=")[-1].split()[0])
    assert least >= 16 * 4 / 64  # the sinks alone: 16 bits for 4 of 64 tokens
    comp.bits = least  # the smallest budget named is accepted
    assert comp.encode(kv, ctx).num_bits >= least * kv.n_elements * 0.999
    comp.bits = least * 0.98
    with pytest.raises(ValueError, match="below the fixed cost"):
        comp.encode(kv, ctx)


# ---------------------------------------------------------------------------------------------- distortion scope


def test_an_evicting_run_reports_distortion_on_kept_and_on_all_tokens_and_labels_each(tiny_cfg, tiny_handle):
    from kvbench.measure.run import format_summary, measure

    cfg = tiny_cfg("+compressor=snapkv", "compressor.window=8", "compressor.keep=0.25", "metrics.nll=false")
    s, _ = measure(cfg, SnapKV(keep=0.25, window=8), tiny_handle)
    assert s["dropped_fraction"] == pytest.approx(0.75)
    assert s["rel_mse_scope"] == "kept tokens only"
    assert s["rel_mse_k"] == 0.0 and s["cosine_k"] == pytest.approx(1.0)  # the kept entries are stored at 16 bits
    # over all tokens an evicted entry is a zero vector: its energy is error and its cosine is 0
    assert 0.2 < s["rel_mse_k_all"] < 1 and 0.2 < s["rel_mse_v_all"] < 1
    assert s["cosine_k_all"] == pytest.approx(0.25, abs=1e-3) and s["cosine_v_all"] == pytest.approx(0.25, abs=1e-3)
    table = format_summary(s | {"nll_base": 0.0, "nll_compressed": 0.0, "delta_nll": 0.0})
    assert "(kept tokens only; 75.0% evicted)" in table and "(all tokens, evicted as zero)" in table


def test_a_run_that_keeps_every_token_measures_all_of_them(tiny_cfg, tiny_handle):
    from kvbench.core.config import make_compressor
    from kvbench.measure.run import format_summary, measure

    cfg = tiny_cfg("+compressor=kivi", "metrics.nll=false")
    s, _ = measure(cfg, make_compressor(cfg.compressor), tiny_handle)
    assert s["rel_mse_scope"] == "all tokens" and s["dropped_fraction"] == 0
    assert s["rel_mse_k_all"] == pytest.approx(s["rel_mse_k"]) and s["cosine_v_all"] == pytest.approx(s["cosine_v"])
    table = format_summary(s | {"nll_base": 0.0, "nll_compressed": 0.0, "delta_nll": 0.0})
    assert "evicted" not in table and "rel MSE  K / V " in table
