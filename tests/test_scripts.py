"""The studies are presets plus report sections: every preset composes for the commands its header names, the
drivers in scripts/ stay thin (no run matching, no figure style, no figure written outside the report's folder),
and a cell a driver runs is the one its section shows."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from kvbench.core.config import CONFIG_DIR, available
from kvbench.report.build import write_report
from kvbench.report.sections import SECTIONS
from kvbench.store.paths import repo_root
from kvbench.sweep.cells import run_cell
from kvbench.sweep.presets import Preset, cells, sweep_params

SCRIPTS_DIR = repo_root() / "scripts"
SCRIPTS = sorted(SCRIPTS_DIR.glob("*.py"))
BENCHMARKS = ("bench_", "byte_planes", "reliability", "needle_keep", "diagnose_")  # measure or check on their own; every other script drives a study
DRIVERS = [p for p in SCRIPTS if not p.name.startswith(BENCHMARKS)]
# a run directory's files, named as a path or a string of their own
RUN_FILE = re.compile(r"""[/"'](summary|eval|latency|config)\.json["']""")
RUNS_GLOB = re.compile(r"""glob\(\s*f?["']runs/""")
JSON_OF_FILE = re.compile(r"json\.loads\((.+?)\.read_text\(\)\)")
# what the scripts used to key and match runs with, and the library helpers that are gone
OWN_MATCHING = ("_LATER_FIELDS", "_key", "_matches", "latest_per_config", "finished_runs", "finished_run",
                "run_dir_for", "write_run", "config_hash", "measured_fields", "cli_loop", "workload_runner", "study_cells")
# the command a preset's header names: python -m kvbench KIND -m +experiment=NAME
DOCUMENTED = re.compile(r"^#\s+python -m kvbench (run|eval|latency) -m \+experiment=(\w+)", re.M)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_no_script_reads_or_matches_runs_itself(path):
    text = path.read_text()
    assert not RUNS_GLOB.search(text), "find runs with kvbench.store.results.latest/summaries"
    assert not RUN_FILE.search(text), "read runs through kvbench.store.results, not by their file names"
    for arg in JSON_OF_FILE.findall(text):
        # only a script's own outputs may be read as JSON, and they are named where they are read
        named = re.search(r"""["']([\w.-]+\.json)["']""", arg)
        assert named, f"json.loads of an unnamed file: {arg}"
    for name in OWN_MATCHING:
        assert not re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text), name
    assert "hasattr(comp" not in text, "ask isinstance(comp, SetCompressor)"
    assert ".side_info_bits(" not in text, "the summary's codec_bits"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_no_script_styles_or_draws_figures(path):
    text = path.read_text()
    assert not re.search(r"^\s*(STYLE|COLORS|MARKERS)\s*=", text, re.M), "one style: kvbench.report.plotting"
    assert "matplotlib" not in text and "savefig" not in text, "figures are report sections (kvbench.report.study_figures)"


def test_figures_are_written_only_by_the_report_into_its_figures_folder():
    writers = [p.name for p in (repo_root() / "kvbench").rglob("*.py") if "savefig(" in p.read_text()]
    assert writers == ["writing.py"]
    assert '"figures"' in (repo_root() / "kvbench" / "report" / "writing.py").read_text()


@pytest.mark.parametrize("path", DRIVERS, ids=lambda p: p.name)
def test_study_drivers_are_thin_and_name_a_report_section(path):
    text = path.read_text()
    assert len(text.splitlines()) <= 40, "a driver runs presets and writes a report section; the rest is library"
    if path.name != "results_readme.py":
        name = re.search(r"""main\(\s*["'](\w+)["']""", text)
        assert name and name.group(1) in SECTIONS, "a driver runs the presets of a report section"
        # its lock, findings page and the rest are its study's (configs/study/NAME.yaml), not the script's
        assert f'**study("{name.group(1)}").options()' in text, "a driver takes its options from its study config"


def test_every_section_preset_is_a_file_whose_header_names_its_command():
    documented = {(kind, name) for p in (CONFIG_DIR / "experiment").glob("*.yaml")
                  for kind, name in DOCUMENTED.findall(p.read_text())}
    for sec in SECTIONS.values():
        for preset in sec.presets:
            assert (preset.kind, preset.name) in documented, f"{preset.name}.yaml names no `{preset.kind} -m` command"


@pytest.mark.parametrize("name", available("experiment"))
def test_every_preset_composes_for_each_command_its_header_names(name):
    path = CONFIG_DIR / "experiment" / f"{name}.yaml"
    commands = [(kind, n) for kind, n in DOCUMENTED.findall(path.read_text()) if n == name]
    assert commands, f"{path.name}: document the command that runs it in its header"
    written = OmegaConf.load(path).hydra.sweeper.params
    for kind, _ in commands:
        preset = Preset(kind, name)
        assert set(sweep_params(preset)) == set(written)
        got = cells([preset])
        assert got and all(c.cfg.get("compressor") is not None for c in got)
        assert len({c.key for c in got}) == len(got), f"two cells of {name} are one cell"


def test_overrides_replace_an_axis_and_leave_out_the_presets_they_do_not_fit():
    left_out = []
    got = cells(SECTIONS["per_vector"].presets, ["compressor.variant=mse", "compressor.bits=3"],
                unfit=lambda p, _: left_out.append(p.name))
    assert [c.overrides[:3] for c in got] == [("+compressor=turboquant", "compressor.variant=mse", "compressor.bits=3")]
    assert left_out == ["per_vector_kivi"]
    with pytest.raises(Exception, match="variant"):
        cells(SECTIONS["per_vector"].presets, ["compressor.variant=mse"])


def test_only_keeps_the_very_cells_of_the_whole_study_and_names_the_cells_when_it_matches_none():
    from kvbench.studies import matching

    every = cells(SECTIONS["frontier"].presets)
    got = matching(every, ["frontier_kivi model=gemma3_270m compressor.bits=2",
                           "frontier_turboquant model=smollm2_135m compressor={bits:3,entropy_coding:True}"])
    assert [c.key for c in got] == [c.key for c in every if c.command in {g.command for g in got}]  # study order
    assert len(got) == 2 and {c.cfg.model.name for c in got} == {"gemma3_270m", "smollm2_135m"}
    assert matching(every, []) == every
    with pytest.raises(SystemExit, match=r"(?s)matches no cell.*\+experiment=frontier_kvtc"):
        matching(every, ["frontier_kivi compressor.bits=3"])


def test_a_section_shows_the_cells_of_a_preset_without_a_model_axis_run_on_another_model():
    import pandas as pd

    from kvbench.report.collect import Collection
    from kvbench.report.sections import select

    (gemma,) = cells([Preset("eval", "ruler")], ["+compressor=kivi", "model=gemma3_270m"])
    (smol,) = cells([Preset("eval", "ruler")], ["+compressor=kivi"])
    evals = pd.DataFrame({"cell_key": [gemma.key, smol.key, "other"], "model": ["gemma3_270m", "smollm2_135m", "x"]})
    got = select(Collection(table=pd.DataFrame(), evals=evals), SECTIONS["ruler"].presets)
    assert list(got.evals["model"]) == ["smollm2_135m", "gemma3_270m"] and set(got.evals["preset"]) == {"ruler"}
    # an override naming the model shows that model's cells alone
    got = select(Collection(table=pd.DataFrame(), evals=evals), SECTIONS["ruler"].presets, ["model=gemma3_270m"])
    assert list(got.evals["model"]) == ["gemma3_270m"]


def test_a_cell_run_by_run_cell_is_the_one_its_section_shows(tmp_path, text_file, tiny_handle, monkeypatch):
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path / "home"))
    tiny = ["model=hf", "model.path=unused", "dataset=text", f"dataset.path={text_file}", "dataset.seq_len=64",
            "dataset.eval_len=16", "dataset.n_sequences=2", "dataset.n_calib=1", "compressor.residual=0",
            "compressor.bits=2"]
    (cell,) = cells(SECTIONS["per_vector"].presets, tiny, tmp_path, unfit=lambda *_: None)
    out = run_cell(cell.kind, cell.cfg, tiny_handle)
    assert out.summary["cell_key"] == cell.key and run_cell(cell.kind, cell.cfg, tiny_handle).reused
    res = write_report([tmp_path / "runs"], tmp_path / "report", ("png",), ["per_vector"], tiny)
    rows = [ln for ln in res["markdown"]["per_vector"].splitlines() if ln.startswith("| kivi")]
    assert len(rows) == 1 and rows[0].startswith("| kivi | 2 | ")
    assert (tmp_path / "report" / "figures" / "per_vector.png").exists()
    assert write_report([tmp_path / "runs"], tmp_path / "other", ("png",), ["per_vector"])["without_runs"] == [
        "per_vector"], "the default cells (1024-token windows) were not run"


def test_cells_of_a_preset_with_a_model_axis_run_in_one_process_on_their_own_models(monkeypatch):
    from kvbench.store.results import Outcome
    from kvbench.sweep import presets as experiments

    seen = []

    def fake_run_cell(kind, cfg, handle, **_):
        seen.append((cfg.model.name, handle.cfg.name, id(handle)))
        return Outcome({}, None, True)

    monkeypatch.setattr(experiments, "run_cell", fake_run_cell)
    monkeypatch.setattr(experiments, "_reusable", lambda *_: True)
    todo = cells([Preset("run", "frontier_delta")]) * 2
    assert experiments.run_in_process(todo) == []
    assert [(m, h) for m, h, _ in seen] == [("smollm2_135m",) * 2, ("gemma3_270m",) * 2] * 2
    assert len({i for *_, i in seen}) == 2, "one handle per model, kept across cells"


def test_a_cell_whose_compressor_cannot_be_built_fails_alone(monkeypatch):
    from kvbench.store.results import Outcome
    from kvbench.sweep import presets as experiments

    def reusable(cell, force):
        if cell.cfg.model.name == "smollm2_135m":
            raise ImportError("a module that does not import")
        return True

    monkeypatch.setattr(experiments, "run_cell", lambda *a, **k: Outcome({}, None, True))
    monkeypatch.setattr(experiments, "_reusable", reusable)
    todo = cells([Preset("run", "frontier_delta")])
    assert experiments.run_in_process(todo) == todo[:1]


@pytest.mark.parametrize(("flags", "locked"), [([], True), (["--no-lock"], False)])
def test_no_lock_measures_a_locked_studys_cells_without_the_benchmark_lock(flags, locked, tmp_path, monkeypatch):
    from kvbench import studies

    seen = []
    monkeypatch.setattr(studies, "run_in_process", lambda todo, force, lock: seen.append(lock) or [])
    argv = [*flags, "--only", "frontier_fp8 model=smollm2_135m", f"paths.results={tmp_path}"]
    assert studies.main("frontier", "frontier", argv, lock=True) == 1  # nothing ran, so no run to publish
    assert seen == [locked]
