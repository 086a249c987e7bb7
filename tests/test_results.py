"""The results layer: one key per cell across results roots and code versions, reuse, atomic writes."""

import json

import pytest
from omegaconf import OmegaConf

from kvbench.core.config import make_compressor
from kvbench.measure.run import measure
from kvbench.store import results


def _cell(cfg, handle):
    comp = make_compressor(cfg.compressor)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    return results.reuse_or_measure("run", cfg_dict, comp.name, comp.describe(), lambda: measure(cfg, comp, handle),
                                    cfg.metrics.resume)


def test_two_roots_same_cell_key_same_bits_config_in_summary(tiny_cfg, tiny_handle, tmp_path):
    a = _cell(tiny_cfg("+compressor=kivi", "compressor.residual=0", f"paths.results={tmp_path / 'a'}"), tiny_handle)
    b = _cell(tiny_cfg("+compressor=kivi", "compressor.residual=0", f"paths.results={tmp_path / 'b'}"), tiny_handle)
    assert not a.reused and not b.reused and a.path.parent.parent != b.path.parent.parent
    sa = json.loads((a.path / "summary.json").read_text())
    sb = json.loads((b.path / "summary.json").read_text())
    assert sa["cell_key"] == sb["cell_key"] and sa["total_bits"] == sb["total_bits"]
    assert sa["config"]["compressor"]["bits"] == 2 and sa["config"]["paths"]["results"] == str(tmp_path / "a")
    assert sa["git_sha"] and sa["cell_key"] in a.path.name


def test_finished_run_is_reused_and_resume_false_measures(tiny_cfg, tiny_handle):
    first = _cell(tiny_cfg("+compressor=identity"), tiny_handle)
    again = _cell(tiny_cfg("+compressor=identity"), tiny_handle)
    assert again.reused and again.path == first.path and again.summary["total_bits"] == first.summary["total_bits"]
    fresh = _cell(tiny_cfg("+compressor=identity", "metrics.resume=false"), tiny_handle)
    assert not fresh.reused and fresh.summary["cell_key"] == first.summary["cell_key"]


def test_cell_key_ignores_output_paths_and_resume_but_not_what_is_measured():
    base = {"model": {"name": "m"}, "dataset": {"seq_len": 64}, "metrics": {"nll": True, "resume": True},
            "paths": {"results": "/a"}}
    moved = {**base, "paths": {"results": "/b"}, "metrics": {"nll": True, "resume": False}}
    other = {**base, "dataset": {"seq_len": 128}}
    assert results.cell_key(base) == results.cell_key(moved) != results.cell_key(other)
    assert results.cell_key(base, {"name": "kivi", "bits": 2}) != results.cell_key(base, {"name": "kivi", "bits": 3})


def test_a_compressor_field_added_later_keys_like_its_default():
    # the key holds the instantiated compressor's fields, so a config that does not name a field keys the same as
    # one that names its default
    a = make_compressor({"_target_": "compressors.dedup.trie.Trie"}).describe()
    b = make_compressor({"_target_": "compressors.dedup.trie.Trie", "verify_kv": True}).describe()
    assert results.cell_key({}, a) == results.cell_key({}, b)


def test_latest_is_newest_and_same_code_filters(tmp_path):
    key = "abc123def456"
    for created, sha in [("2026-01-01T00:00:00", "1111111aaaa"), ("2026-02-01T00:00:00", "2222222bbbb")]:
        path = results.run_dir(tmp_path, "run", "kivi", key, sha)
        results.write(path, "run", {"cell_key": key, "created": created, "git_sha": sha}, [{"x": 1}], {})
    assert results.latest(tmp_path, "run", key)["created"].startswith("2026-02")
    assert results.latest(tmp_path, "run", key, same_code=True) is None  # neither is this checkout's version
    assert results.latest(tmp_path, "run", "000000000000") is None


def test_resume_values_are_checked():
    assert results.resume_mode(True) == "any" and results.resume_mode("code") == "code"
    with pytest.raises(ValueError, match="metrics.resume"):
        results.resume_mode("sometimes")


def test_newest_per_cell_keeps_one_run_per_key():
    runs = [{"cell_key": "a", "created": "1"}, {"cell_key": "b", "created": "1"}, {"cell_key": "a", "created": "2"}]
    assert [r["created"] for r in results.newest_per_cell(runs)] == ["2", "1"]


def test_fitted_state_is_cached_per_calibration_set_and_decodes_the_same(random_kv, tmp_path):
    import torch

    from compressors.predictive.delta import Delta
    from kvbench.core.codec import prepare
    from kvbench.core.kv import Context

    calib = [random_kv(seed=3)]
    kv = random_kv(seed=4)
    cache = tmp_path / "codecs" / "delta.state"
    first = prepare(Delta(predictor="linear"), lambda: calib, cache=cache)
    assert cache.exists() and not first.cached and first.codec_bits > 0

    def no_calibration():
        raise AssertionError("a cached state must not read the calibration windows")

    again = prepare(Delta(predictor="linear"), no_calibration, cache=cache)
    assert again.cached and again.state == first.state and again.fit_s == 0.0
    ctx = Context.for_kv(kv)
    a = first.decoder.decode(first.encoder.encode(kv, ctx), ctx)
    b = again.decoder.decode(again.encoder.encode(kv, ctx), ctx)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_finished_finds_what_run_cell_wrote_and_extra_fields_are_kept(tiny_cfg, tiny_handle):
    from kvbench.sweep.cells import finished, key_of, run_cell

    cfg = tiny_cfg("+compressor=identity", "metrics.nll=false")
    assert finished("run", cfg) is None
    out = run_cell("run", cfg, tiny_handle, extra={"load_average_1min": 0.5})
    got = finished("run", cfg)
    assert got["cell_key"] == key_of(cfg) == out.summary["cell_key"] and got["load_average_1min"] == 0.5


def test_summaries_skip_a_killed_runs_staging_directory(tmp_path):
    results.write(tmp_path / "runs" / "kivi-a", "run", {"cell_key": "a"}, [{"x": 1}], {})
    (tmp_path / "runs" / ".kivi-b.xyz").mkdir(parents=True)
    (tmp_path / "runs" / ".kivi-b.xyz" / "summary.json").write_text('{"cell_key": "b"}')
    assert [s["cell_key"] for s in results.summaries([tmp_path])] == ["a"]
