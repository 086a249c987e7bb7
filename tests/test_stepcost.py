"""``python -m kvbench stepcost``: recompute's stages against a plain decode step, on the tiny model, filed as a run,
published as evidence and quoted by a page reference."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvbench.measure.stepcost import STAGES, format_stepcost, measure_stepcost
from kvbench.sweep.cells import run_cell


@pytest.fixture()
def stepcost_cfg(tiny_cfg):
    return lambda *overrides: tiny_cfg("stepcost.tokens=24", "stepcost.repeats=2", *overrides, config_name="stepcost")


def test_every_stage_is_timed_against_the_plain_step_and_the_ids_decode_exactly(stepcost_cfg, tiny_handle, tmp_path,
                                                                                monkeypatch):
    from kvbench.report import refs
    from kvbench.report.build import write_report
    from kvbench.report.evidence import export, load
    from kvbench.store import results

    monkeypatch.setattr(results, "git_sha", lambda: "f" * 40)  # a clean commit, whatever the checkout's state

    out = run_cell("stepcost", stepcost_cfg("+compressor=recompute", "stepcost.window=1"), tiny_handle, resume=False)
    s = json.loads((out.path / "stepcost.json").read_text())
    assert out.path.name.startswith("stepcost-recompute-") and (out.path / "stepcost.parquet").exists()
    assert s["kind"] == "stepcost" and s["cell_key"] and s["config"]["stepcost"]["tokens"] == 24
    assert s["tokens"] == 24 and s["coded_tokens"] == 23 and s["window"] == 1 and s["ids_exact"] is True
    assert [r["stage"] for r in s["rows"]] == list(STAGES)
    for r in s["rows"]:
        assert math.isfinite(r["s_per_token"]) and r["s_per_token"] > 0, r
        assert r["over_step"] == pytest.approx(r["s_per_token"] / s["step_s_per_token"])
        assert len(r["passes_s_per_token"]) == 2
        assert r["s_per_token_lo"] <= r["s_per_token"] <= r["s_per_token_hi"]
    assert s["decode_prefill_s_per_token"] < s["decode_s_per_token"]
    assert s["row_over_step"] == pytest.approx(s["row_s_per_token"] / s["step_s_per_token"])
    assert "decode_prefill" in format_stepcost(s)

    ev = load("tiny", export("tiny", [out.path], tmp_path / "published").parent.parent)
    shown, errors = refs.render("{{ tiny/stepcost: compressor=recompute stage=row | over_step .3f }}", lambda _: ev.got)
    assert errors == [] and shown == f"{s['row_over_step']:.3f}"
    res = write_report([tmp_path / "results"], tmp_path / "report", formats=("png",), sections=("stepcost",))
    assert res["stepcost"] == len(STAGES) and res["rows"] == 0
    stages = (tmp_path / "report" / "stepcost.md").read_text()
    assert "lowest round" in stages and "x plain decode step" in stages and all(f"| {k} |" in stages for k in STAGES)


def test_only_coders_that_run_the_model_are_timed(stepcost_cfg, tiny_handle):
    from compressors.exact.identity import Identity

    with pytest.raises(ValueError, match="'identity' does not \\(its next_token_model\\(\\) is None\\)"):
        measure_stepcost(stepcost_cfg(), Identity(), tiny_handle)


@pytest.mark.parametrize("override, field", [("stepcost.tokens=1", "tokens"), ("stepcost.repeats=0", "repeats"),
                                             ("stepcost.window=-1", "window"), ("stepcost.tokens=2.5", "tokens"),
                                             ("stepcost.window=2", "window=2 is past")])
def test_bad_settings_are_refused(stepcost_cfg, tiny_handle, override, field):
    from compressors.exact.recompute import Recompute

    with pytest.raises(ValueError, match=f"stepcost.{field}"):
        measure_stepcost(stepcost_cfg(override), Recompute(), tiny_handle)


def test_the_coders_step_is_the_plain_step_and_a_softmax(tiny_model):
    from compressors.exact.identity import Identity
    from compressors.exact.recompute import Recompute

    assert Identity().next_token_model(tiny_model) is None
    a, b = Recompute(threads=2).next_token_model(tiny_model), Recompute(threads=2).next_token_model(tiny_model)
    assert a.threads == 2 and a.cache is not b.cache
    for t in (5, 17, 3):
        logits, probs = a.step(t), b.after(t)  # (V,), (V,) float64
        assert probs.dtype == "float64" and probs.sum() == pytest.approx(1.0)
        assert (torch.softmax(logits.double(), -1).numpy() == probs).all()


def test_rounds_time_every_stage_in_each_round_in_a_seeded_order():
    from kvbench.measure.stepcost import rounds

    calls: list[str] = []
    got = rounds({k: (lambda k=k: calls.append(k)) for k in "abcd"}, n=4, repeats=3, seed=7)
    assert sorted(got) == list("abcd") and all(len(v) == 3 and min(v) >= 0 for v in got.values())
    assert calls[:4] == list("abcd")  # the warm-up round, then three shuffled rounds of every stage
    assert all(sorted(calls[i:i + 4]) == list("abcd") for i in (4, 8, 12)) and len(calls) == 16
    again: list[str] = []
    rounds({k: (lambda k=k: again.append(k)) for k in "abcd"}, n=4, repeats=3, seed=7)
    assert again == calls


def test_every_kind_of_run_has_its_frame_and_reference_table():
    from kvbench.report.collect import FRAMES
    from kvbench.report.refs import TABLES
    from kvbench.store.results import KINDS

    assert set(FRAMES) == set(KINDS)
    assert TABLES == {"runs": "table", "evals": "evals", "latency": "latency", "restore": "restore",
                      "stepcost": "stepcost", "reliability": "reliability", "scale": "scale",
                      "capacity": "capacity"}
