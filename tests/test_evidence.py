"""Committed evidence: a study's runs exported as summaries and per-token NLLs only, read back as the report reads
runs, and refused when they mix code versions or come from a dirty tree."""

import json

import numpy as np
import pytest
from evidence_cases import per_vector_cells, write_run

from kvbench.report.evidence import MANIFEST, MixedCodeVersions, export, load, one_code_version, study_runs
from kvbench.store import results


@pytest.fixture(scope="module")
def cells():
    return per_vector_cells()


def test_export_copies_each_runs_summary_and_nlls_and_nothing_else(tmp_path, cells):
    runs = [write_run(tmp_path, c, i) for i, c in enumerate(cells[:2])]
    (runs[0] / "trace.safetensors").write_bytes(b"\0" * 1000)  # what a run dir may hold beside its summary
    out = export("per_vector", runs, tmp_path, overrides=["dataset.seq_len=1024"], wall_min=12.0, host="a machine")
    assert out == tmp_path / "evidence" / "per_vector"
    for r in runs:
        assert sorted(p.name for p in (out / r.name).iterdir()) == ["nll.npz", "summary.json"]
        assert (out / r.name / "summary.json").read_bytes() == (r / "summary.json").read_bytes()  # as written
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest == {"study": "per_vector", "runs": sorted(r.name for r in runs), "commit": "aaaaaaa",
                        "code_versions": {"a" * 40: 2}, "allow_mixed": False, "overrides": ["dataset.seq_len=1024"],
                        "machine": "a machine", "wall_min": 12.0}
    # exporting again replaces the study's evidence: a run no longer published leaves it
    export("per_vector", runs[1:], tmp_path)
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, runs[1].name])


def test_evidence_reads_back_as_the_runs_do(tmp_path, cells):
    from kvbench.report.collect import collect

    runs = [write_run(tmp_path, c, i) for i, c in enumerate(cells)]
    ev = load("per_vector", export("per_vector", runs, tmp_path).parent.parent)
    direct = collect([tmp_path / "runs"]).table
    cols = ["cell_key", "bits_per_element", "delta_nll", "delta_nll_ci_text", "cfg.compressor.variant"]
    assert ev.got.table[cols].equals(direct[cols])
    assert ev.commit == "aaaaaaa" and ev.runs == len(cells) and ev.date == "2026-01-04"
    # the per-token NLLs behind each delta NLL
    for r in runs:
        pairs = results.read_nll(ev.path / r.name)
        summary = json.loads((r / "summary.json").read_text())
        base, comp = np.concatenate([b for b, _ in pairs]), np.concatenate([c for _, c in pairs])
        assert len(pairs) == 2 and base.dtype == np.float32
        assert float(comp.mean() - base.mean()) == pytest.approx(summary["delta_nll"], abs=1e-6)


def test_a_study_publishes_the_newest_run_of_each_of_its_cells(tmp_path, cells):
    from kvbench.sweep.presets import Preset
    from kvbench.sweep.presets import cells as preset_cells

    old = write_run(tmp_path, cells[0], 0, sha="b" * 40, created="2025-12-01T00:00:00")
    new = write_run(tmp_path, cells[0], 1)
    other = write_run(tmp_path, cells[1], 2)
    decoy = preset_cells([Preset("run", "per_vector_turboquant")], ["dataset.seq_len=512"])[0]  # not a cell of it
    write_run(tmp_path, decoy, 3)
    assert study_runs("per_vector", [tmp_path / "runs"]) == sorted([new, other], key=lambda p: p.name)
    assert old not in study_runs("per_vector", [tmp_path / "runs"])


def test_runs_of_several_code_versions_or_a_dirty_tree_are_refused_unless_allowed(tmp_path, cells):
    a = write_run(tmp_path, cells[0], 0, sha="a" * 40)
    b = write_run(tmp_path, cells[1], 1, sha="b" * 40)
    dirty = write_run(tmp_path, cells[2], 2, sha="c" * 40 + "-dirty")
    with pytest.raises(MixedCodeVersions, match=r"several code versions.*aaaaaaa \(1 run: .*bbbbbbb \(1 run"):
        export("per_vector", [a, b], tmp_path)
    with pytest.raises(MixedCodeVersions, match=r"dirty or unknown code version for one published study: ccccccc-dirty"):
        export("per_vector", [dirty], tmp_path)
    assert not (tmp_path / "evidence" / "per_vector").exists()  # nothing was published
    out = export("per_vector", [a, b, dirty], tmp_path, allow_mixed=True)
    ev = load("per_vector", tmp_path)
    assert ev.commit == "mixed: aaaaaaa (1 runs), bbbbbbb (1 runs), ccccccc-dirty (1 runs)"
    # evidence edited into mixing versions after a strict export is refused when read
    export("per_vector", [a], tmp_path)
    (out / b.name).mkdir()
    (out / b.name / "summary.json").write_bytes((b / "summary.json").read_bytes())
    with pytest.raises(MixedCodeVersions):
        load("per_vector", tmp_path)
    assert one_code_version({"d" * 40: ["r1", "r2"]}) == "ddddddd"
    with pytest.raises(MixedCodeVersions, match="unknown"):
        one_code_version({"": ["r1"]})


def test_a_borrowed_reference_cell_keeps_its_own_code_version_and_the_page_names_it(tmp_path):
    from kvbench.report.pages import _provenance
    from kvbench.report.sections import section
    from kvbench.sweep.presets import cells as preset_cells

    presets = {p.name: p for p in section("eviction").presets}
    own = write_run(tmp_path, preset_cells([presets["eviction"]])[0], 0, sha="a" * 40)
    lent = write_run(tmp_path, preset_cells([presets["frontier_kivi"]])[0], 1, sha="b" * 40)
    out = export("eviction", [own, lent], tmp_path)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["commit"] == "aaaaaaa" and manifest["borrowed"] == {"runs": [lent.name], "commit": "bbbbbbb"}
    ev = load("eviction", tmp_path)
    assert (ev.commit, ev.lent_commit) == ("aaaaaaa", "bbbbbbb")
    text = _provenance(ev, tmp_path / "page.md")
    assert "at commit `aaaaaaa` up to" in text
    assert text.endswith("; its 1 reference run borrowed from another study's evidence at commit `bbbbbbb`")
    # the study's own cells still share one version, and the borrowed ones theirs
    other = write_run(tmp_path, preset_cells([presets["eviction"]])[1], 2, sha="c" * 40)
    with pytest.raises(MixedCodeVersions, match="several code versions"):
        export("eviction", [own, other, lent], tmp_path)
    # a study that borrows nothing checks every run as its own
    assert export("per_vector", [own], tmp_path) and "borrowed" not in json.loads(
        (tmp_path / "evidence" / "per_vector" / MANIFEST).read_text())


def test_per_token_nlls_pair_window_by_window(tmp_path):
    base = [np.arange(3, dtype=np.float64), np.ones(2)]
    results.write_nll(tmp_path / "nll.npz", base, [b + 1 for b in base])
    got = results.read_nll(tmp_path)
    assert [len(b) for b, _ in got] == [3, 2] and all(c.dtype == np.float32 for _, c in got)
    assert np.array_equal(got[0][1], np.arange(1, 4, dtype=np.float32))
    with pytest.raises(ValueError, match="do not pair"):
        results.write_nll(tmp_path / "bad.npz", base, [np.ones(3)])
    assert results.read_nll(tmp_path / "nowhere") == []


def test_a_measurement_hands_its_per_token_nlls_to_the_run_directory_not_the_summary(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "git_sha", lambda: "e" * 40)
    cfg = {"paths": {"results": str(tmp_path)}, "model": {"name": "m"}}
    nll = ([np.ones(4)], [np.full(4, 1.5)])
    out = results.reuse_or_measure("run", cfg, "x", None, lambda: ({"delta_nll": 0.5, results.NLL_KEY: nll}, []),
                                   resume=False)
    assert results.NLL_KEY not in out.summary
    assert results.NLL_KEY not in json.loads((out.path / "summary.json").read_text())
    (base, comp), = results.read_nll(out.path)
    assert float((comp - base).mean()) == 0.5


def test_a_tiny_model_run_publishes_the_per_token_nlls_behind_its_delta_nll(tiny_cfg, tiny_handle, tmp_path,
                                                                            monkeypatch):
    from kvbench.report import refs
    from kvbench.sweep.cells import run_cell

    monkeypatch.setattr(results, "git_sha", lambda: "f" * 40)  # a clean commit, whatever the checkout's state
    cfg = tiny_cfg("+compressor=kivi", "compressor.bits=2", "compressor.residual=0", "compressor.group_size=16")
    out = run_cell("run", cfg, tiny_handle, resume=False)
    pairs = results.read_nll(out.path)
    assert len(pairs) == cfg.dataset.n_sequences and all(len(b) == cfg.dataset.eval_len for b, _ in pairs)
    base, comp = np.concatenate([b for b, _ in pairs]), np.concatenate([c for _, c in pairs])
    assert float(base.mean()) == pytest.approx(out.summary["nll_base"], rel=1e-5)
    assert float((comp - base).mean()) == pytest.approx(out.summary["delta_nll"], abs=1e-5)
    ev = load("tiny", export("tiny", [out.path], tmp_path / "published").parent.parent)
    shown, errors = refs.render("{{ tiny: compressor=kivi compressor.bits=2 | delta_nll }}", lambda s: ev.got)
    assert errors == [] and shown == f"{out.summary['delta_nll']:+.4f}"
