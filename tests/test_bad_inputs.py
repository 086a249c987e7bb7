"""Inputs that used to be ignored or clamped without a word: each is refused with a one-line error naming what is
allowed, or recorded as it was applied."""

import re
from pathlib import Path

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


# ---------------------------------------------------------------------------------------------- config fields

#: (override, the error line): each refused when the config is read, before a model, a trace or a results folder
BAD_FIELDS = [
    ("dataset.seq_len=0", "dataset.seq_len=0 must be a whole number of at least 2 (prefix tokens whose KV is "
                          "compressed)"),
    ("dataset.n_sequences=-1", "dataset.n_sequences=-1 must be a whole number of at least 1 (evaluated windows)"),
    ("dataset.eval_len=-5", "dataset.eval_len=-5 must be a whole number of at least 1 (held-out continuation tokens "
                            "scored after the prefix)"),
    ("dataset.n_calib=-1", "dataset.n_calib=-1 must be a whole number of at least 0 (calibration windows)"),
    ("dataset.seed=-3", "dataset.seed=-3 must be a whole number of at least 0"),
    ("dataset.field=", "dataset.field='' is not allowed; name the .jsonl field holding each document's text"),
    ("dataset.split=val", "dataset.split='val' is not allowed; choose one of ['test', 'dev']"),
    ("dataset=text", "dataset.path is not set; dataset=text reads a local file: dataset=text dataset.path=FILE (.txt: "
                     "one document; .jsonl: one document per line)"),
    ("dataset.path=/tmp/notes.txt", "dataset.path=/tmp/notes.txt is only read with dataset=text; dataset=sotu loads "
                                    "its own text: drop dataset.path, or use dataset=text dataset.path=/tmp/notes.txt"),
    ("device=cuda", "device='cuda' is not allowed: torch sees no CUDA device on this machine; choose one of ['cpu']"),
    ("device=tpu", "device='tpu' is not allowed; choose one of ['cpu']"),
    ("dtype=float32", "dtype='float32' is not allowed; the cache baseline is 16-bit: ['bfloat16', 'float16']"),
    ("seed=-1", "seed=-1 must be a whole number of at least 0"),
    ("model=hf", "model.path is not set; model=hf reads a local Hugging Face checkpoint directory: model=hf "
                 "model.path=DIR"),
    ("model.name=llama", f"model.name='llama' is not a packaged model; choose one of {sorted(MODELS)}, "
                         "or use model=hf model.path=DIR for a local checkpoint"),
    ("model.source=hub", "model.source='hub' is not allowed; choose one of ['packaged', 'hf']"),
    ("model.dtype=int8", "model.dtype='int8' is not allowed; choose one of ['float32', 'bfloat16', 'float16']"),
    ("model.attn_implementation=flash", "model.attn_implementation='flash' is not allowed; choose one of ['sdpa', "
                                        "'eager']"),
    ("capture.pre_rope=maybe", "capture.pre_rope='maybe' is not allowed; choose true or false"),
    ("metrics.nll=yes", "metrics.nll='yes' is not allowed; choose true or false"),
    ("metrics.resume=sometimes", "metrics.resume='sometimes' is not allowed; choose one of [true, code, false]"),
    ("metrics.ci_block=0", "metrics.ci_block=0 must be a whole number of at least 1"),
    ("metrics.recall_tokens=-1", "metrics.recall_tokens=-1 must be a whole number of at least 0"),
    ("metrics.recall_from=1.5", "metrics.recall_from=1.5 is out of range; allowed: 0 <= recall_from < 1 (where in the "
                                "prefix the repeated passage starts, as a fraction of its length)"),
    ("metrics.fit_draws=0", "metrics.fit_draws=0 must be an integer in [1, 64] (1: fit once on the run's own "
                            "calibration windows)"),
    ("rate.amortize_tokens=0", "rate.amortize_tokens=0 must be a whole number of at least 1 (tokens one fitted codec "
                               "serves)"),
]


@pytest.fixture()
def no_gpu(monkeypatch, tmp_path):
    """A machine where torch sees no CUDA device, with an empty results root and kvbench home: whatever is written
    there shows."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("KVBENCH_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path / "home"))
    return tmp_path


def _cli(*argv: str) -> int:
    from kvbench.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    return exit_.value.code


@pytest.mark.parametrize(("override", "error"), BAD_FIELDS, ids=[o for o, _ in BAD_FIELDS])
def test_a_bad_field_is_one_line_naming_what_is_allowed_before_any_work(no_gpu, capsys, override, error):
    # metrics.nll=false: device=cuda used to complete on the CPU this way, its summary saying cuda
    assert _cli("run", "+compressor=kivi", "metrics.nll=false", override) == 2
    assert capsys.readouterr().err == f"error: {error}\n"
    assert sorted(p.name for p in no_gpu.iterdir()) == [], "something was written before the config was checked"


def test_capture_reads_its_config_as_run_does(no_gpu, capsys):
    assert _cli("capture", "dataset.n_sequences=-1") == 2
    assert capsys.readouterr().err == ("error: dataset.n_sequences=-1 must be a whole number of at least 1 (evaluated "
                                       "windows)\n")
    assert not (no_gpu / "home").exists()


def test_a_cuda_run_on_a_stored_trace_is_refused_though_it_would_not_load_the_model(tiny_cfg, tiny_handle, monkeypatch):
    """A run on a stored trace without NLL never loads the model, so nothing used to ask whether the GPU was there:
    its coding ran on the CPU and the summary said cuda."""
    from kvbench.inputs.capture import load_or_capture
    from kvbench.sweep.cells import run_cell

    trace = load_or_capture(tiny_cfg(), tiny_handle)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = tiny_cfg("+compressor=kivi", f"trace={trace.path}", "metrics.nll=false", "device=cuda")
    with pytest.raises(ValueError, match=r"^device='cuda' is not allowed: torch sees no CUDA device on this machine"):
        run_cell("run", cfg, handle=tiny_handle)
    assert not Path(cfg.paths.results).exists()
    s = run_cell("run", tiny_cfg("+compressor=kivi", f"trace={trace.path}", "metrics.nll=false"), handle=tiny_handle)
    assert s.summary["device"] == "cpu"


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
