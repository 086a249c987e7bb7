"""The RULER report section: baseline per task, near-chance tasks flagged and left out of the pooled row."""

import math

import pandas as pd
import pytest

from kvbench.report.collect import Collection
from kvbench.report.sections.ruler_section import ruler_rows, ruler_study


def _evals() -> pd.DataFrame:
    rows = []
    for run, comp, bits, diffs in (("r1", "identity", 16.2, (0.0, 0.0, 0.0)), ("r2", "kivi", 2.9, (-0.2, -0.1, 0.0))):
        for (task, base), diff in zip((("ruler_vt_1k", 0.8), ("ruler_cwe_1k", 0.0), ("ruler_vt_2k", 0.6)), diffs):
            rows.append({"run_id": run, "model": "m", "compressor": comp, "compressor_params.name": comp,
                         "bits_per_element": bits, "task": task, "n": 10, "acc_base": base, "acc_comp": base + diff,
                         "diff": diff, "stderr_diff": 0.1 if diff else 0.0, "ci95_low": diff - 0.196,
                         "ci95_high": diff + 0.196, "mcnemar_p": 1.0})
    rows.append({**rows[0], "task": "passkey_1k"})  # not a RULER task
    return pd.DataFrame(rows)


def test_near_chance_tasks_are_flagged_and_left_out_of_the_pooled_row_of_a_summary_without_its_own():
    d = ruler_rows(_evals())
    assert set(d["task"]) == {"ruler_vt_1k", "ruler_cwe_1k", "ruler_vt_2k", "pooled (clear of chance)"}
    cwe = d[d["task"] == "ruler_cwe_1k"]
    assert cwe["near_chance"].all() and (cwe["family"] == "ruler_cwe").all() and (cwe["length"] == 1024).all()
    pooled = d[(d["task"] == "pooled (clear of chance)") & (d["run_id"] == "r2")].iloc[0]
    assert pooled["n"] == 20 and pooled["diff"] == pytest.approx(-0.1)  # the two vt tasks (-0.2, 0.0), not cwe (-0.1)
    assert pooled["ci95_high"] - pooled["diff"] == pytest.approx(1.96 * math.sqrt(0.5**2 * 0.1**2))
    assert pooled["smallest_significant_diff"] == pytest.approx(6 / 20)


def test_the_pooled_row_carries_its_tasks_length_only_when_they_share_one():
    mixed = ruler_rows(_evals())  # tasks at 1k and 2k: the pooled row is at no single length
    assert mixed[mixed["family"] == "pooled"]["length"].isna().all()
    one = _evals()
    one = ruler_rows(one[one["task"] != "ruler_vt_2k"])
    assert (one[one["family"] == "pooled"]["length"] == 1024).all()


def test_the_pooled_row_is_the_summarys_own_stratified_bootstrap():
    """A summary's ``overall_informative`` (stratified bootstrap, permutation or McNemar p, detectable change) is the
    pooled row as it stands, not a normal interval rebuilt from per-task variances."""
    ev = _evals().assign(**{"overall_informative.n": 20, "overall_informative.diff": -0.1,
                            "overall_informative.ci95_low": -0.25, "overall_informative.ci95_high": 0.0,
                            "overall_informative.p_value": 0.125, "overall_informative.paired_test": "mcnemar_exact",
                            "overall_informative.detectable_diff": 0.31})
    d = ruler_rows(ev)
    pooled = d[(d["task"] == "pooled (clear of chance)") & (d["run_id"] == "r2")].iloc[0]
    assert (pooled["ci95_low"], pooled["ci95_high"], pooled["p_value"]) == (-0.25, 0.0, 0.125)
    assert pooled["detectable_diff"] == 0.31 and pooled["diff_ci_text"] == "[-0.250, +0.000]"
    task = d[(d["task"] == "ruler_vt_1k") & (d["run_id"] == "r2")].iloc[0]
    assert task["p_value"] == 1.0  # a summary that predates p_value: its McNemar p


def test_the_section_writes_the_baseline_table_and_a_figure_per_model():
    tables, figures = ruler_study(Collection(pd.DataFrame(), [], _evals(), pd.DataFrame(), pd.DataFrame()))
    base = tables[0].frame
    assert sorted(base["task"]) == ["ruler_cwe_1k", "ruler_vt_1k", "ruler_vt_2k"]  # one row per model and task
    fig, why = figures["ruler_m"]
    assert fig is not None and why == ""


def _scored(run: str, comp: str, reference: bool, scores: dict[str, list[float]], ids=None) -> list[dict]:
    """A RULER run's task rows as collect() gives them, with each example's score kept (as eval summaries do)."""
    import json

    return [{"run_id": run, "model": "m", "compressor": comp, "compressor_params.name": comp, "bits_per_element": 2.0,
             "compressor_facts.quality_reference": reference, "task": task, "n": len(s), "acc_base": 0.9,
             "acc_comp": sum(s) / len(s), "diff": 0.0, "ci95_low": 0.0, "ci95_high": 0.0, "mcnemar_p": 1.0,
             "doc_ids": json.dumps(ids or list(range(len(s)))), "scores_comp": json.dumps(s)}
            for task, s in scores.items()]


def test_a_cell_is_paired_with_the_reference_cache_example_by_example():
    """coder minus FP8 on the same examples of the tasks clear of chance: a coder that scores as the reference does is
    no worse; one that loses half of every task the reference answers is worse by half; one scored on other examples
    gets no paired figure."""
    from kvbench.report.sections.frontier_ruler_section import versus_reference

    ref = {"ruler_vt_1k": [1.0] * 20, "ruler_fwe_1k": [1.0, 0.0] * 10}
    half = {"ruler_vt_1k": [1.0, 0.0] * 10, "ruler_fwe_1k": [1.0, 0.0] * 5 + [0.0] * 10}
    ev = pd.DataFrame(_scored("fp8", "fp8", True, ref) + _scored("same", "kvtc", False, ref)
                      + _scored("half", "kivi", False, half)
                      + _scored("other", "delta", False, ref, ids=list(range(100, 120))))
    d = ruler_rows(ev)
    tasks, cells = d[d["family"] != "pooled"], d[d["family"] == "pooled"]
    got = versus_reference(tasks, cells).set_index("run_id")
    assert got.loc["same", "ruler_vs_ref"] == 0.0 and got.loc["same", "ruler_vs_ref_verdict"] == "no worse"
    assert got.loc["fp8", "ruler_vs_ref_verdict"] == "no worse"
    assert got.loc["half", "ruler_vs_ref"] == pytest.approx(-0.375)  # (-0.5 - 0.25) / 2, stratified by task
    assert got.loc["half", "ruler_vs_ref_verdict"] == "worse"
    assert pd.isna(got.loc["other", "ruler_vs_ref"])
