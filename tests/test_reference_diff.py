"""A coder's loss minus a reference cache's (FP8) on the same scored tokens, with the paired interval: the figure
behind "keeps recall no worse than FP8"."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from kvbench.core.config import make_compressor
from kvbench.measure.metrics.reference_diff import NotPaired, paired_difference, reference_verdict
from kvbench.measure.run import measure
from kvbench.store.results import NLL_KEY, write, write_nll

METRICS = OmegaConf.create({"ci_block": 8, "ci_resamples": 300, "ci_seed": 0})


def _run(tmp_path, tiny_cfg, tiny_handle, *overrides):
    cfg = tiny_cfg(*overrides, "dataset.eval_len=32", "metrics.recall_tokens=16")
    s, rows = measure(cfg, make_compressor(cfg.compressor), tiny_handle)
    path = tmp_path / overrides[0].split("=")[1]
    write(path, "run", s, rows, OmegaConf.to_container(cfg, resolve=True), s[NLL_KEY])
    return path, s


def test_the_difference_is_the_two_runs_recall_losses_apart_and_zero_against_itself(tmp_path, tiny_cfg, tiny_handle):
    coder, s = _run(tmp_path, tiny_cfg, tiny_handle, "+compressor=kivi", "compressor.bits=2", "compressor.residual=0")
    ref, r = _run(tmp_path, tiny_cfg, tiny_handle, "+compressor=fp8")
    got = paired_difference(coder, ref, METRICS, s["eval_documents"])
    # the same spans and baseline: the difference of the means is the difference of the two runs' recall losses
    assert got["diff"] == pytest.approx(s["delta_nll_recall"] - r["delta_nll_recall"], abs=1e-6)
    assert got["ci"][0] <= got["diff"] <= got["ci"][1] and got["tokens"] == s["recall_tokens"]
    itself = paired_difference(ref, ref, METRICS, r["eval_documents"])
    assert itself["diff"] == 0.0 and itself["ci"] == [0.0, 0.0] and itself["verdict"] == "no worse"
    nxt = paired_difference(coder, ref, METRICS, s["eval_documents"], probe="")
    assert nxt["diff"] == pytest.approx(s["delta_nll"] - r["delta_nll"], abs=1e-6)


def test_runs_on_other_tokens_are_not_paired(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, shift in ((a, 0.0), (b, 0.5)):
        d.mkdir()
        base = [np.full(8, 1.0 + shift, np.float32)]
        write_nll(d / "nll.npz", base, base, ([np.ones(4, np.float32)], [np.ones(4, np.float32)], [0]))
    with pytest.raises(NotPaired, match="a and b were not scored on the same continuation tokens"):
        paired_difference(a, b, METRICS, None, probe="")


@pytest.mark.parametrize(("ci", "verdict"), [([-0.02, 0.01], "no worse"), ([0.0, 0.03], "unresolved"),
                                             ([0.011, 0.05], "worse"), ([float("nan"), 0.0], "unresolved")])
def test_no_worse_means_the_whole_interval_at_or_below_a_hundredth_of_a_nat(ci, verdict):
    assert reference_verdict(ci) == verdict


def test_the_frontier_page_shows_each_cells_recall_minus_fp8s(tmp_path, tiny_cfg, tiny_handle):
    from kvbench.report.collect import collect
    from kvbench.report.sections.frontier_section import frontier, recall_vs_reference

    coder, s = _run(tmp_path / "runs", tiny_cfg, tiny_handle, "+compressor=kivi", "compressor.bits=2", "compressor.residual=0")
    ref, _ = _run(tmp_path / "runs", tiny_cfg, tiny_handle, "+compressor=fp8")
    exact, _ = _run(tmp_path / "runs", tiny_cfg, tiny_handle, "+compressor=identity")
    got = collect([tmp_path / "runs"])
    d = recall_vs_reference(got.table).set_index("compressor")
    run_metrics = OmegaConf.create({"ci_block": 32, "ci_resamples": 2000, "ci_seed": 0})  # configs/run.yaml's
    want = paired_difference(coder, ref, run_metrics, s["eval_documents"])
    assert d.loc["kivi", "recall_vs_ref"] == pytest.approx(want["diff"])
    assert d.loc["kivi", "recall_vs_ref_verdict"] == want["verdict"] and d.loc["fp8", "recall_vs_ref"] == 0.0
    tables, figures = frontier(got)
    assert any(t.title == "the long-range recall probe, every cell" for t in tables)
    # the recall loss against bits drawn beside the NLL figure, with each cell's interval
    model = got.table["model"].iloc[0]
    fig, why = figures[f"frontier_recall_{model}"]
    assert fig is not None, why
    (ax,) = [a for a in fig.axes if a.get_ylabel().startswith("recall-probe")]
    assert len(ax.get_lines()) >= 3

    ranked = next(t for t in tables if t.title.startswith("fewest stream bits per element whose recall loss"))
    # the reference is never its own answer; a coder is ranked exactly when its recall is shown no worse than FP8's
    shown = set(ranked.frame["compressor"])
    assert "fp8" not in shown and "identity" in shown  # the 16-bit cache loses nothing FP8 keeps
    assert ("kivi" in shown) == (want["verdict"] == "no worse")


def test_committed_evidence_pairs_its_runs_where_the_checkout_holds_them(tmp_path, tiny_cfg, tiny_handle):
    """Evidence names its runs relative to the results root (the same text in any checkout); the paired figure reads
    their files from there, not from the working directory."""
    from kvbench.report.evidence import export, load
    from kvbench.report.sections.frontier_section import recall_vs_reference

    coder, s = _run(tmp_path / "runs", tiny_cfg, tiny_handle, "+compressor=kivi", "compressor.bits=2", "compressor.residual=0")
    ref, _ = _run(tmp_path / "runs", tiny_cfg, tiny_handle, "+compressor=fp8")
    export("frontier", [coder, ref], tmp_path / "results", allow_mixed=True)
    got = load("frontier", tmp_path / "results").got
    assert not Path(got.table["run_dir"].iloc[0]).is_absolute()
    d = recall_vs_reference(got.table, got).set_index("compressor")
    run_metrics = OmegaConf.create({"ci_block": 32, "ci_resamples": 2000, "ci_seed": 0})
    assert d.loc["kivi", "recall_vs_ref"] == pytest.approx(paired_difference(coder, ref, run_metrics, s["eval_documents"])["diff"])
