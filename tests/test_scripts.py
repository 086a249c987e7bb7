"""The study scripts find finished runs only through kvbench.results, by cell key: none keeps its own matching."""

from __future__ import annotations

import importlib.util
import re

import pandas as pd
import pytest
from omegaconf import OmegaConf

from kvbench import results
from kvbench.cells import run_cell
from kvbench.config import make_compressor
from kvbench.paths import repo_root

SCRIPTS_DIR = repo_root() / "scripts"
SCRIPTS = sorted(SCRIPTS_DIR.glob("*.py"))
# a run directory's files, named as a path or a string of their own
RUN_FILE = re.compile(r"""[/"'](summary|eval|latency|config)\.json["']""")
RUNS_GLOB = re.compile(r"""glob\(\s*f?["']runs/""")
JSON_OF_FILE = re.compile(r"json\.loads\((.+?)\.read_text\(\)\)")
# what the scripts used to key and match runs with, and the library helpers that are gone
OWN_MATCHING = ("_LATER_FIELDS", "_key", "_matches", "latest_per_config", "finished_runs", "run_dir_for", "write_run",
                "config_hash", "measured_fields", "cli_loop", "workload_runner")


def _script(name: str, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS_DIR))  # as when run as `python scripts/NAME.py`
    spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_no_script_reads_or_matches_runs_itself(path):
    text = path.read_text()
    assert not RUNS_GLOB.search(text), "find runs with kvbench.results.latest/summaries"
    assert not RUN_FILE.search(text), "read runs through kvbench.results, not by their file names"
    for arg in JSON_OF_FILE.findall(text):
        # only a script's own outputs may be read as JSON, and they are named where they are read
        named = re.search(r"""["']([\w.-]+\.json)["']""", arg)
        assert named, f"json.loads of an unnamed file: {arg}"
    for name in OWN_MATCHING:
        assert not re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text), name
    assert "hasattr(comp" not in text, "ask isinstance(comp, SetCompressor)"
    assert ".side_info_bits(" not in text, "the summary's codec_bits"


def test_sequential_finds_every_cell_by_its_cell_key_and_nothing_else(tmp_path, monkeypatch):
    seq = _script("sequential", monkeypatch)
    rows = seq.cells()
    assert any(name == "speculative" for _, name, _ in rows)
    keys = []
    for label, name, ov in rows[1:]:  # the first cell is left without a run
        cfg = seq.cell_config(name, ov, tmp_path)
        cfg_dict = OmegaConf.to_container(cfg, resolve=True)
        key = results.cell_key(cfg_dict, make_compressor(cfg.compressor).describe())
        keys.append(key)
        results.write(results.run_dir(tmp_path, "run", name, key, "1234567abc"), "run",
                      {"cell_key": key, "label": label, "created": "2026-01-01T00:00:00"}, [{"x": 1}], cfg_dict)
    assert len(set(keys)) == len(keys), "two cells of the list are one cell"
    # a run of another cell of the same compressor must not stand in for the missing one
    label, name, ov = rows[0]
    other = seq.cell_config(name, [*ov, "dataset.seq_len=512"], tmp_path)
    other_key = results.cell_key(OmegaConf.to_container(other, resolve=True), make_compressor(other.compressor).describe())
    results.write(results.run_dir(tmp_path, "run", name, other_key, "1234567abc"), "run",
                  {"cell_key": other_key, "label": "decoy", "created": "2026-01-01T00:00:00"}, [], {})
    found = seq.load(rows, tmp_path)
    assert [s["label"] for _, _, s in found] == [r[0] for r in rows[1:]]


def test_a_cell_run_by_run_cell_is_the_one_the_scripts_find(tiny_cfg, tiny_handle, monkeypatch):
    study = _script("study_cells", monkeypatch)
    cell = ("+compressor=kivi", "compressor.residual=0")
    assert study.finished_run("run", tiny_cfg(*cell)) is None
    out = run_cell("run", tiny_cfg(*cell), tiny_handle)
    found = study.finished_run("run", tiny_cfg(*cell))
    assert found["_dir"] == str(out.path) and found["cell_key"] == study.key(tiny_cfg(*cell))
    assert run_cell("run", tiny_cfg(*cell), tiny_handle).reused
    assert study.finished_run("run", tiny_cfg(*cell, "compressor.bits=3")) is None


def test_prefix_sharing_reads_the_newest_workload_run_of_each_cell(tmp_path, monkeypatch):
    ps = _script("prefix_sharing", monkeypatch)
    monkeypatch.setenv("KVBENCH_RESULTS", str(tmp_path))
    for key, created, sha, workload in [("a" * 12, "2026-01-01", "1111111", "mixed"),
                                        ("a" * 12, "2026-02-01", "2222222", "mixed"),
                                        ("b" * 12, "2026-01-01", "1111111", None)]:
        summary = {"cell_key": key, "created": created, "compressor": "trie"}
        if workload:
            summary["workload"] = workload
        results.write(results.run_dir(tmp_path, "run", "trie", key, sha), "run", summary, [], {})
    assert [s["created"] for s in ps.load()] == ["2026-02-01"]


def test_results_readme_keeps_the_newest_run_of_each_cell_in_table_order(monkeypatch):
    rr = _script("results_readme", monkeypatch)
    df = pd.DataFrame({"cell_key": ["a", "b", "a", float("nan"), float("nan")],
                       "created": ["1", "1", "2", "1", "1"], "run_id": ["a1", "b1", "a2", "x", "y"]})
    assert list(rr.newest_run_per_cell(df)["run_id"]) == ["b1", "a2", "x", "y"]
