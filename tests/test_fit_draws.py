"""metrics.fit_draws: a fitted coder refitted on further calibration draws, disjoint from each other and from every
test, calibration and dev window; the run files the spread of its ΔNLL over the draws."""

import pytest
from conftest import letter_corpus
from omegaconf import OmegaConf

from kvbench.core.config import make_compressor
from kvbench.inputs.capture import load_or_capture
from kvbench.measure.fit_draws import calibration_draws, fit_draws, spread
from kvbench.measure.run import measure
from kvbench.store.results import cell_key

COMMON = ["dataset.seq_len=40", "dataset.eval_len=8", "dataset.n_sequences=2", "dataset.n_calib=2",
          "metrics.ci_resamples=50"]


@pytest.fixture()
def corpus(tmp_path):
    """Twenty-four documents of distinct random letters (the roles take every fourth window: three draws of two
    calibration windows reach window 24): a window's text is found in exactly one of them."""
    return letter_corpus(tmp_path, 24)


def _document(tokens, docs) -> int:
    text = "".join(chr(int(t)) for t in tokens)
    found = [i for i, d in enumerate(docs) if text in d]
    assert len(found) == 1  # every window is a piece of one document
    return found[0]


def test_calibration_draws_are_disjoint_from_each_other_and_from_test_calibration_and_dev(tiny_cfg, tiny_handle,
                                                                                        corpus):
    path, docs = corpus
    cfg = tiny_cfg(f"dataset.path={path}", *COMMON)
    draws = calibration_draws(cfg.dataset, tiny_handle.tokenizer, 4)
    assert len(draws) == 3 and all(d.shape == (2, 49) for d in draws)
    taken = {}
    for split in ("test", "dev"):
        trace = load_or_capture(tiny_cfg(f"dataset.path={path}", *COMMON, f"dataset.split={split}"), tiny_handle)
        for s in trace.sequences:
            taken.setdefault(f"{split} {s.role}", set()).add(_document(s.kv.tokens, docs))
    assert taken["test calib"] == taken["dev calib"]  # draw 0: the trace's own calibration windows
    seen = set().union(*taken.values())
    for k, windows in enumerate(draws, start=1):
        mine = {_document(w[:40], docs) for w in windows}
        assert len(mine) == 2 and not mine & seen, f"draw {k} reuses a document of an earlier window"
        seen |= mine


def test_a_text_that_cuts_its_windows_otherwise_for_a_longer_draw_is_refused(tiny_cfg, tiny_handle):
    cfg = tiny_cfg(*COMMON)  # one document: more windows are cut from it at other offsets
    with pytest.raises(ValueError, match=r"cuts its windows differently .* could overlap the test and dev splits' windows"):
        calibration_draws(cfg.dataset, tiny_handle.tokenizer, 3)


def test_two_draws_write_the_spread_of_delta_nll_and_the_recall_probes(tiny_cfg, tiny_handle, corpus):
    path, _ = corpus
    cfg = tiny_cfg("+compressor=aquakv", "compressor.bits=1", "compressor.sinks=0", f"dataset.path={path}", *COMMON,
                   "metrics.fit_draws=2")
    s, _ = measure(cfg, make_compressor(cfg.compressor), tiny_handle)
    assert s["fit_draws"] == 2
    for key in ("delta_nll", "delta_nll_recall"):
        values, sp = s[f"{key}_fit_draws"], s[f"{key}_fit_spread"]
        assert len(values) == 2 and values[0] == s[key]  # draw 0 is the run's own fit, the headline figure
        assert sp["min"] <= sp["median"] <= sp["max"] and sp["min"] == min(values) and sp["max"] == max(values)
    assert s["delta_nll_fit_draws"][1] != s["delta_nll_fit_draws"][0]  # another fit, another codec
    # each draw carries its own interval and verdict, draw 0's the run's; the verdict for every draw says so
    lo, hi = s["delta_nll_ci_fit_draws"][1]
    assert s["delta_nll_ci_fit_draws"][0] == s["delta_nll_ci"] and lo <= s["delta_nll_fit_draws"][1] <= hi
    assert s["delta_nll_ci_fit_draws"][1] != s["delta_nll_ci_fit_draws"][0]
    verdicts = s["delta_nll_verdict_fit_draws"]
    assert verdicts[0] == s["delta_nll_verdict_1pct"] and len(verdicts) == 2
    assert s["delta_nll_verdict_every_draw"] == (verdicts[0] if verdicts[0] == verdicts[1] else "depends on the draw")
    assert len(s["delta_nll_recall_ci_fit_draws"]) == 2


def test_a_coder_that_fits_nothing_and_a_single_draw_write_no_spread(tiny_cfg, tiny_handle, corpus):
    path, _ = corpus
    cfg = tiny_cfg("+compressor=kivi", f"dataset.path={path}", *COMMON, "metrics.fit_draws=3")
    assert "delta_nll_fit_spread" not in measure(cfg, make_compressor(cfg.compressor), tiny_handle)[0]


def test_fit_draws_keeps_the_cell_keys_of_runs_filed_before_it_and_names_what_is_allowed(tiny_cfg):
    cfg = tiny_cfg()
    as_before = OmegaConf.to_container(cfg, resolve=True)
    del as_before["metrics"]["fit_draws"]
    assert cell_key(OmegaConf.to_container(cfg, resolve=True)) == cell_key(as_before)
    assert cell_key(OmegaConf.to_container(tiny_cfg("metrics.fit_draws=3"), resolve=True)) != cell_key(as_before)
    with pytest.raises(ValueError, match=r"metrics.fit_draws=0 must be an integer in \[1, 64\]"):
        fit_draws(tiny_cfg("metrics.fit_draws=0").metrics)
    assert spread([3.0, float("nan"), 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0}
