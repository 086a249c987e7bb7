"""Paired intervals for task loss: coverage of the truth, width against theory, correlated tokens, verdicts."""

import math

import numpy as np
import pytest

from kvbench.measure.metrics.intervals import (
    block_bootstrap_ci,
    document_bootstrap_ci,
    minimum_detectable_effect,
    verdict,
)


def test_iid_interval_matches_the_normal_theory():
    rng = np.random.default_rng(0)
    windows = [rng.normal(0.05, 1.0, 512) for _ in range(4)]  # 2,048 independent tokens
    low, high = block_bootstrap_ci(windows, block=32, resamples=4000)
    pooled = np.concatenate(windows)
    half = 1.959964 * pooled.std(ddof=1) / math.sqrt(pooled.size)
    assert low < pooled.mean() < high
    assert (high - low) / 2 == pytest.approx(half, rel=0.1)


def test_block_correlated_tokens_widen_the_interval():
    # a shared offset per 32-token block: 64 effective draws, not 2,048
    rng = np.random.default_rng(1)
    windows = [np.repeat(rng.normal(0, 1, 16), 32) + rng.normal(0, 0.1, 512) for _ in range(4)]
    blocked = block_bootstrap_ci(windows, block=32)
    token_wise = block_bootstrap_ci(windows, block=1)
    assert (blocked[1] - blocked[0]) > 4 * (token_wise[1] - token_wise[0])


def test_coverage_is_near_nominal():
    rng = np.random.default_rng(2)
    hits = 0
    for _ in range(200):
        windows = [rng.laplace(0.02, 0.5, 256) for _ in range(4)]
        low, high = block_bootstrap_ci(windows, block=16, resamples=500, seed=int(rng.integers(1 << 30)))
        hits += low <= 0.02 <= high
    assert 0.9 <= hits / 200 <= 0.99


def test_identical_sides_give_a_zero_interval_and_blocks_never_cross_windows():
    assert block_bootstrap_ci([np.zeros(100), np.zeros(37)], block=32) == [0.0, 0.0]
    # a window shorter than a block is one unit of its own size
    low, high = block_bootstrap_ci([np.ones(5), np.zeros(5)], block=32, resamples=500)
    assert 0.0 <= low <= high <= 1.0


def test_too_few_units_give_nan_and_bad_settings_are_refused():
    assert all(math.isnan(x) for x in block_bootstrap_ci([np.ones(10)], block=32))
    with pytest.raises(ValueError, match="block >= 1"):
        block_bootstrap_ci([np.ones(10)], block=0)


def test_verdicts_are_decided_on_the_interval():
    assert verdict([0.001, 0.02], 0.03) == "within"
    assert verdict([0.031, 0.05], 0.03) == "not within"
    assert verdict([0.02, 0.04], 0.03) == "unresolved"
    assert verdict([math.nan, math.nan], 0.03) == "unresolved"


def test_minimum_detectable_effect_is_2_8_standard_errors():
    rng = np.random.default_rng(3)
    windows = [rng.normal(0, 1.0, 512) for _ in range(4)]
    se = np.concatenate(windows).std(ddof=1) / math.sqrt(2048)
    assert minimum_detectable_effect(windows, block=32, resamples=4000) == pytest.approx(2.8016 * se, rel=0.12)


def test_run_summary_has_the_interval_around_delta_nll(tiny_cfg, tiny_handle):
    from kvbench.core.config import make_compressor
    from kvbench.measure.run import measure

    cfg = tiny_cfg("+compressor=kivi", "compressor.residual=0", "compressor.bits=2", "dataset.eval_len=48")
    s, _ = measure(cfg, make_compressor(cfg.compressor), tiny_handle)
    low, high = s["delta_nll_ci"]
    assert low <= s["delta_nll"] <= high and low < high
    assert s["eval_tokens"] == 2 * 48 and s["nll_base_ci"][0] <= s["nll_base"] <= s["nll_base_ci"][1]
    assert s["delta_nll_verdict_1pct"] in ("within", "not within", "unresolved")
    assert s["delta_nll_mde"] == pytest.approx(2.8016 * (high - low) / (2 * 1.95996), rel=1e-4)
    assert s["eval_documents"] == [0, 0] and s["eval_documents_n"] == 1  # both windows come from the one text file
    line = 0.01 * s["nll_base"]
    assert s["delta_nll_ci_half_width_rel"] == pytest.approx((high - low) / 2 / line)
    # a model built in the process keeps no baseline between cells: every window's and every probe's is scored
    assert s["nll_base_spans_scored"] == 2 + len(s["_nll_per_token"][2][0]) and s["measure_s"] > 0
    exact = tiny_cfg("+compressor=identity", "dataset.eval_len=48")
    e, _ = measure(exact, make_compressor(exact.compressor), tiny_handle)
    assert e["delta_nll"] == 0.0 and e["delta_nll_ci"] == [0.0, 0.0] and e["delta_nll_verdict_1pct"] == "within"


def test_an_unresolved_verdict_says_how_many_documents_its_spread_would_need():
    from kvbench.measure.metrics.paired_loss import decidability

    # half-width 0.02 around 0.025 against a line at 0.03 on 4 documents: to clear the line by its 0.005 gap the
    # half-width must shrink 4-fold, so 16 times the documents
    got = decidability(0.025, [0.005, 0.045], 0.03, 4)
    assert got == {"delta_nll_ci_half_width_rel": pytest.approx(2 / 3), "delta_nll_documents_needed": 64}
    assert "delta_nll_documents_needed" not in decidability(0.01, [0.0, 0.02], 0.03, 4)  # decided: within
    assert decidability(0.03, [0.01, 0.05], 0.03, 4)["delta_nll_documents_needed"] is None  # on the line
    from kvbench.measure.run import _delta_text

    printed = _delta_text({"delta_nll": 0.025, "delta_nll_ci": [0.005, 0.045], "delta_nll_verdict_1pct": "unresolved",
                           "eval_documents_n": 4, **got})
    assert printed.endswith("(unresolved 1% of base; 4 documents; about 64 would decide)")


def test_documents_are_a_level_of_the_resampling():
    # each document shifts all its tokens by its own offset: the text varies between documents, and only an
    # interval that draws documents sees that variation
    rng = np.random.default_rng(4)
    offsets = rng.normal(0, 0.05, 8)
    windows = [off + rng.normal(0, 0.5, 256) for off in offsets for _ in range(2)]  # two windows per document
    docs = np.repeat(np.arange(8), 2)
    two_level = document_bootstrap_ci(windows, docs, block=32)
    blocks_only = block_bootstrap_ci(windows, block=32)
    assert (two_level[1] - two_level[0]) > 1.5 * (blocks_only[1] - blocks_only[0])
    # one document: the block bootstrap of it; every window its own document by default
    assert document_bootstrap_ci(windows, np.zeros(16, dtype=int), block=32) == blocks_only
    assert document_bootstrap_ci(windows, block=32) == document_bootstrap_ci(windows, np.arange(16), block=32)
    with pytest.raises(ValueError, match="one document per window"):
        document_bootstrap_ci(windows, docs[:3])


def test_two_level_interval_covers_the_mean_over_documents():
    # documents drawn from a population with a between-document spread; the truth is the population mean
    rng = np.random.default_rng(6)
    hits = blocks_hits = 0
    for i in range(200):
        windows = [rng.normal(0.02 + rng.normal(0, 0.05), 0.4, 128) for _ in range(12)]
        low, high = document_bootstrap_ci(windows, block=16, resamples=500, seed=i)
        hits += low <= 0.02 <= high
        low, high = block_bootstrap_ci(windows, block=16, resamples=500, seed=i)
        blocks_hits += low <= 0.02 <= high
    assert hits / 200 >= 0.92 and blocks_hits / 200 < 0.85  # blocks alone miss the between-document spread


def test_windows_are_assigned_the_documents_their_capture_recorded():
    from kvbench.measure.run import window_documents

    assert window_documents({"documents": [7, 3, 3, 9]}, 3) == [7, 3, 3]
    # a trace that records none (another tool's): every window a document of its own
    assert window_documents({}, 2) == [0, 1] and window_documents({"documents": [4]}, 2) == [0, 1]


def test_draw_windows_names_the_document_of_every_window(tmp_path):
    import torch
    from conftest import letter_corpus

    from kvbench.inputs.data import draw_windows, sample_windows

    class Chars:
        bos_token_id = None

        def __call__(self, text, add_special_tokens=False):
            return type("Enc", (), {"input_ids": [ord(c) for c in text]})()

    _, docs = letter_corpus(tmp_path, 5)
    for n in (3, 5, 8):  # fewer, as many and more windows than documents
        windows, of = draw_windows(docs, Chars(), n, 30, seed=1)
        assert len(of) == n and torch.equal(windows, sample_windows(docs, Chars(), n, 30, seed=1))
        for w, d in zip(windows, of):
            assert "".join(map(chr, w.tolist())) in docs[d]


def test_the_recall_probe_repeats_an_early_passage():
    import torch

    from kvbench.measure.run import recall_probe

    tokens = torch.arange(100)
    assert recall_probe(tokens, 0.1, 16).tolist() == list(range(10, 27))  # the cue and 16 scored tokens
    assert recall_probe(tokens, 0.0, 8)[0] == 1  # never the first token (BOS, or an attention sink)
    assert recall_probe(tokens, 0.95, 64).tolist() == list(range(95, 100))  # cut at the prefix's end
    assert recall_probe(tokens, 0.1, 0) is None and recall_probe(None, 0.1, 8) is None
    assert recall_probe(tokens[:3], 0.5, 8) is None


def test_run_summary_has_the_recall_probe(tiny_cfg, tiny_handle):
    from kvbench.core.config import make_compressor
    from kvbench.measure.run import measure

    cfg = tiny_cfg("+compressor=streaming_llm", "compressor.keep=0.5", "metrics.recall_tokens=24")
    s, _ = measure(cfg, make_compressor(cfg.compressor), tiny_handle)
    low, high = s["delta_nll_recall_ci"]
    assert s["recall_tokens"] == 2 * 24 and low <= s["delta_nll_recall"] <= high
    assert s["delta_nll_recall"] != 0.0  # the copied passage sits in the evicted middle of the prefix
    off = tiny_cfg("+compressor=identity", "metrics.recall_tokens=0")
    o, _ = measure(off, make_compressor(off.compressor), tiny_handle)
    assert o["recall_tokens"] == 0 and math.isnan(o["delta_nll_recall"])
