"""The scale page's data: scripts/bench_scale.py's output filed as one run of kind ``scale`` per model and length,
read back by the report, and the growth fitted to it (wall time quadratic, peak memory linear in the context) and
the longest context a model reaches on the measuring machine."""

from __future__ import annotations

import importlib.util
import json
import math
from types import SimpleNamespace

import pytest

from kvbench.report.collect import collect
from kvbench.report.sections.scale_section import fits, reach, scale
from kvbench.store.paths import repo_root

LENGTHS = (1024, 2048, 4096, 8192)
COMPRESSORS = ["kivi:bits=2", "snapkv:keep=0.5"]


def _script():
    spec = importlib.util.spec_from_file_location("bench_scale_script", repo_root() / "scripts" / "bench_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wall(T: int) -> float:
    """A step's seconds, known coefficients: 2 s fixed, 3 s per 1k tokens, 0.5 s per (1k tokens)^2."""
    t = T / 1000
    return 2 + 3 * t + 0.5 * t * t


def peak(T: int) -> float:
    return 1.5 + 0.25 * T / 1000


def output(sha: str = "0123456789abcdef0123456789abcdef01234567") -> dict:
    rows = []
    for T in LENGTHS:
        rows.append({"model": "tiny", "context": T, "step": "capture", "compressor": None, "wall_s": wall(T),
                     "rss_before_gb": 0.5, "step_peak_rss_gb": peak(T), "peak_rss_gb": peak(T), "estimate_gb": 1.0,
                     "torch_threads": 2})
        for c in COMPRESSORS:
            for step in ("encode", "decode", "score"):
                rows.append({"model": "tiny", "context": T, "step": step, "compressor": c, "wall_s": 1.0 + T / 1e4,
                             "rss_before_gb": 0.4, "step_peak_rss_gb": 0.8, "peak_rss_gb": 0.8, "torch_threads": 2})
    meta = {"machine": "a test machine", "cpus": 2, "git_sha": sha, "created": "2026-01-01T00:00:00+0000",
            "load_average_start": [0.1, 0.1, 0.1], "load_average_end": [0.2, 0.2, 0.2], "command": ["x"],
            "lengths": list(LENGTHS), "models": ["tiny"], "compressors": COMPRESSORS, "dataset": "sotu",
            "n_sequences": 1, "n_calib": 1, "eval_len": 512}
    return {"meta": meta, "rows": rows, "skipped": []}


@pytest.fixture
def filed(tmp_path, monkeypatch):
    """The output filed as runs, on a model whose config declares 32,768 positions, on a 24 GB machine."""
    script = _script()
    monkeypatch.setattr("kvbench.inputs.models.ModelHandle",
                        lambda cfg: SimpleNamespace(config=SimpleNamespace(max_position_embeddings=32768)))
    monkeypatch.setattr("kvbench.core.machine.machine", lambda: "a test machine")
    monkeypatch.setattr(script, "memory_gb", lambda: 24.0)
    monkeypatch.setattr("kvbench.core.config.compose", lambda o: SimpleNamespace(model=None))
    out = tmp_path / "scale.json"
    out.write_text(json.dumps(output()))
    return script.file_runs([out], tmp_path / "sweep")


def test_each_model_and_length_is_one_run_with_a_row_per_step(filed):
    assert len(filed) == len(LENGTHS)
    summary = json.loads((filed[0] / "scale.json").read_text())
    assert summary["kind"] == "scale" and summary["git_sha"].startswith("0123456")  # the measuring commit, kept
    assert summary["position_limit"] == 32768 and summary["machine_memory_gb"] == 24.0
    got = collect([filed[0].parent])
    assert len(got.scale) == len(LENGTHS) * (1 + 3 * len(COMPRESSORS))
    assert set(got.scale["step"]) == {"capture", "encode", "decode", "score"}


def test_the_fits_recover_the_growth_and_the_reach_where_the_memory_line_meets_the_machine(filed):
    d = collect([filed[0].parent]).scale
    f = fits(d).set_index(["step", "compressor"], drop=False)
    cap = f[f["step"] == "capture"].iloc[0]
    assert (cap["wall_fixed_s"], cap["wall_s_per_1k"], cap["wall_s_per_1k_sq"]) == pytest.approx((2, 3, 0.5))
    assert cap["wall_fit_max_rel_err"] == pytest.approx(0, abs=1e-9)
    top = max(LENGTHS) / 1000
    assert cap["quadratic_share_at_max"] == pytest.approx(0.5 * top ** 2 / wall(max(LENGTHS)))
    assert (cap["rss_fixed_gb"], cap["rss_gb_per_1k"]) == pytest.approx((1.5, 0.25))
    r = reach(d).iloc[0]
    assert r["context_max"] == max(LENGTHS) and r["peak_at_max_gb"] == pytest.approx(peak(max(LENGTHS)))
    assert r["reach_extrapolated"] == pytest.approx((24.0 - 1.5) / 0.25 * 1000)  # the highest step peak per length


def test_a_failed_step_is_not_filed(tmp_path):
    broken = output()
    broken["rows"][3] = {**broken["rows"][3], "error": "exit 137; see the step's stderr above"}
    out = tmp_path / "scale.json"
    out.write_text(json.dumps(broken))
    with pytest.raises(SystemExit, match="failed step"):
        _script().file_runs([out], tmp_path / "sweep")


def test_the_section_draws_both_figures_and_a_table_per_view(filed):
    tables, figures = scale(collect([filed[0].parent]))
    assert [t.title for t in tables] == ["the longest context each model reaches", "the growth fitted to each step",
                                         "each step against the context"]
    assert {t.stem for t in tables} == {"scale"}  # one page block shows them together
    assert all(fig is not None for fig, _ in figures.values())
    assert not any(math.isnan(v) for v in tables[0].frame["reach_extrapolated"])


def test_a_longer_window_held_alone_is_the_reach_but_no_point_on_the_two_window_curves(filed, tmp_path):
    script = _script()
    alone = output()
    alone["meta"] = {**alone["meta"], "lengths": [16384], "compressors": COMPRESSORS[:1], "n_calib": 0}
    alone["rows"] = [{**r, "context": 16384, "wall_s": 999.0, "step_peak_rss_gb": 9.0} for r in alone["rows"][:4]]
    out = tmp_path / "alone.json"
    out.write_text(json.dumps(alone))
    script.file_runs([out], tmp_path / "sweep")
    d = collect([filed[0].parent]).scale
    cap = fits(d)
    two = cap[(cap["step"] == "capture") & (cap["windows_held"] == 2)].iloc[0]
    assert two["lengths"] == len(LENGTHS) and two["wall_s_per_1k_sq"] == pytest.approx(0.5)  # 16384 not in it
    r = reach(d).iloc[0]
    assert (r["context_max"], r["windows_at_max"], r["peak_at_max_gb"]) == (16384, 1, 9.0)
    assert r["reach_extrapolated"] == pytest.approx((24.0 - 1.5) / 0.25 * 1000)
