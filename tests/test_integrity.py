"""Inputs later verdicts rest on cannot lie: a cached trace, a cached fitted state and a finished run's table and
per-token NLLs each carry a content hash written when made and checked when read. A flipped bit, a cut or an empty
file is one line naming the file and what rebuilds it, before anything is measured on it; a finished run that fails
its hashes is not reused as finished. A trace that must be captured into a read-only KVBENCH_HOME is one line too.

Everything runs on conftest's tiny random Llama and a small local text file: seconds per test.
"""

from __future__ import annotations

import errno
import json
import os
import shlex

import numpy as np
import pytest

from kvbench.inputs.capture import capture, default_trace_dir, load_or_capture, load_trace
from kvbench.store import results
from kvbench.store.integrity import IntegrityError, read_sealed_json, seal


def flip(path, offset: int | None = None, count: int = 1) -> None:
    """Flip the lowest bit of ``count`` bytes of ``path`` from ``offset`` (default: the middle of the file)."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    for i in range(at, min(at + count, len(data))):
        data[i] ^= 1
    path.write_bytes(bytes(data))


def damage(path, how: str) -> None:
    if how == "bit":
        flip(path)
    elif how == "4096 bits":
        flip(path, offset=len(path.read_bytes()) // 4, count=4096)
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    else:
        raise ValueError(how)


def one_line(msg: str) -> str:
    assert "\n" not in msg.strip(), msg
    return msg


# --- traces --------------------------------------------------------------------------------------------------------


@pytest.fixture()
def cached_trace(tiny_cfg, tiny_handle):
    cfg = tiny_cfg("+compressor=identity", "metrics.nll=false")
    trace = load_or_capture(cfg, tiny_handle)
    assert trace.path == default_trace_dir(cfg) and trace.manifest["files"]
    return cfg, trace


@pytest.mark.parametrize("how", ["bit", "4096 bits", "truncated", "empty"])
def test_a_damaged_trace_window_names_the_file_and_the_capture_command(cached_trace, tiny_handle, how):
    cfg, trace = cached_trace
    window = trace.path / "seq_001.safetensors"
    damage(window, how)
    with pytest.raises(IntegrityError) as got:
        load_or_capture(cfg, tiny_handle)
    msg = one_line(str(got.value))
    assert str(window) in msg and "fails its content hash" in msg and "python -m kvbench capture " in msg


def test_the_named_capture_command_rebuilds_the_same_trace(cached_trace, tiny_handle):
    """The command in the message, composed as the CLI would, captures into the damaged trace's own folder, and
    the trace it writes loads again."""
    from kvbench.core.config import compose

    cfg, trace = cached_trace
    flip(trace.path / "seq_000.safetensors")
    with pytest.raises(IntegrityError) as got:
        load_or_capture(cfg, tiny_handle)
    command = str(got.value).split("`")[1]
    words = shlex.split(command)
    assert words[:4] == ["python", "-m", "kvbench", "capture"]
    again = compose(words[4:], config_name="run")
    assert default_trace_dir(again) == trace.path
    rebuilt = capture(again, tiny_handle, trace.path, progress=False)
    assert load_or_capture(cfg, tiny_handle).manifest["files"] == rebuilt.manifest["files"]


@pytest.mark.parametrize("how", ["truncated", "value", "bit"])
def test_a_damaged_manifest_names_itself(cached_trace, tiny_handle, how):
    cfg, trace = cached_trace
    mf = trace.path / "manifest.json"
    if how == "value":  # still valid JSON: only its seal can tell
        body = json.loads(mf.read_text())
        body["dataset"]["seq_len"] = 63
        mf.write_text(json.dumps(body, indent=2))
    elif how == "bit":
        text = mf.read_text()
        at = text.index('"seq_len": 64') + len('"seq_len": 6')
        flip(mf, offset=at)  # 64 -> 65
    else:
        damage(mf, how)
    with pytest.raises(IntegrityError) as got:
        load_or_capture(cfg, tiny_handle)
    msg = one_line(str(got.value))
    assert msg.startswith(str(mf)) and "python -m kvbench capture " in msg
    assert ("not readable JSON" if how == "truncated" else "fails its content hash") in msg


def test_the_cli_turns_a_damaged_cached_trace_into_one_line_and_measures_nothing(cached_trace, monkeypatch, capsys):
    """Through ``python -m kvbench run``'s entry point: exit 2, one line naming the file; no run is written."""
    from kvbench.cli import cell

    cfg, trace = cached_trace
    flip(trace.path / "seq_000.safetensors", count=4096)
    with pytest.raises(SystemExit) as exit_:
        cell("run", cfg)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: ") and "seq_000.safetensors" in err and "python -m kvbench capture" in err
    assert not list((trace.path.parent.parent.parent / "results").rglob("summary.json"))


def test_a_trace_written_without_hashes_must_be_captured_again(cached_trace, tiny_cfg, tiny_handle):
    cfg, trace = cached_trace
    mf = trace.path / "manifest.json"
    old = {k: v for k, v in json.loads(mf.read_text()).items() if k not in ("files", "sha256", "capture_command")}
    mf.write_text(json.dumps({**old, "format_version": 1}))
    with pytest.raises(IntegrityError, match="trace format 1, whose files carry no content hashes") as got:
        load_or_capture(tiny_cfg("+compressor=identity", f"trace={trace.path}"), tiny_handle)
    assert str(mf) in one_line(str(got.value)) and "python -m kvbench capture" in str(got.value)


def test_an_unlisted_window_file_is_refused(cached_trace, tiny_handle):
    cfg, trace = cached_trace
    mf = trace.path / "manifest.json"
    body = read_sealed_json(mf, "")
    del body["files"]["seq_002.safetensors"]
    mf.write_text(json.dumps(seal(body)))  # a sound manifest that lists no hash for a window
    with pytest.raises(IntegrityError, match="seq_002.safetensors has no recorded content hash"):
        load_trace(trace.path)


def _refuse(monkeypatch, root, code: int) -> None:
    """Make the OS refuse creating files or folders under ``root`` with ``code``, as a read-only mount does."""
    real_open, real_mkdir = os.open, os.mkdir
    inside = lambda path: str(path).startswith(str(root))  # noqa: E731

    def refused(path):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(os, "open", lambda path, flags, *a, **k: refused(path) if inside(path) and flags & (
        os.O_WRONLY | os.O_RDWR | os.O_CREAT) else real_open(path, flags, *a, **k))
    monkeypatch.setattr(os, "mkdir", lambda path, *a, **k: refused(path) if inside(path) else real_mkdir(path, *a, **k))


def test_a_read_only_home_that_must_take_a_trace_is_one_line_before_any_work(tiny_cfg, tiny_checkpoint, tmp_path,
                                                                           monkeypatch, capsys):
    from kvbench.cli import cell

    # a real checkpoint directory: the config is read (and its model.path checked) before the trace folder is
    cfg = tiny_cfg("+compressor=identity", "metrics.nll=false", f"model.path={tiny_checkpoint[0]}")
    home = tmp_path / "home"
    loaded = []
    monkeypatch.setattr("kvbench.inputs.models.ModelHandle._load", lambda self: loaded.append(1) or pytest.fail("loaded"))
    _refuse(monkeypatch, home, errno.EROFS)
    with pytest.raises(SystemExit) as exit_:
        cell("run", cfg)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"trace folder {home / 'traces'} cannot take a capture: it is on a read-only file system" in err
    assert "must be written to a writable folder" in err and "KVBENCH_HOME=DIR" in err and loaded == []
    assert not list((tmp_path / "results").rglob("summary.json"))


# --- fitted codec state --------------------------------------------------------------------------------------------


@pytest.fixture()
def fitted(random_kv, tmp_path):
    from compressors.predictive.delta import Delta
    from kvbench.core.codec import prepare

    calib = [random_kv(seed=3)]
    cache = tmp_path / "codecs" / "delta-0123.state"
    first = prepare(Delta(predictor="linear"), lambda: calib, cache=cache)
    assert cache.exists() and not first.cached
    return lambda: prepare(Delta(predictor="linear"), lambda: calib, cache=cache), cache


@pytest.mark.parametrize("how", ["bit", "truncated", "empty"])
def test_a_damaged_fitted_state_names_the_file_and_deleting_it_refits(fitted, how):
    again, cache = fitted
    good = cache.read_bytes()
    damage(cache, how)
    with pytest.raises(IntegrityError) as got:
        again()
    msg = one_line(str(got.value))
    assert msg.startswith(str(cache)) and f"delete {cache}" in msg and "fits the codec again" in msg
    cache.unlink()
    refit = again()
    assert not refit.cached and refit.state == good and again().cached


def test_damaged_fit_stats_beside_a_state_name_their_file(fitted):
    again, cache = fitted
    side = cache.with_suffix(".stats.json")
    stats = json.loads(side.read_text())
    side.write_text(json.dumps({**stats, "fit_rounds": 3}))  # valid JSON, a figure the fit never reported
    with pytest.raises(IntegrityError, match="fails its content hash") as got:
        again()
    assert str(side) in one_line(str(got.value))
    side.unlink()
    with pytest.raises(IntegrityError, match="is missing beside its fitted state"):
        again()


def test_a_read_only_home_keeps_no_fitted_state_and_the_run_goes_on(random_kv, tmp_path, monkeypatch, capsys):
    """The state cache saves later runs a fit; a folder that cannot take it costs a warning, not the run."""
    from compressors.predictive.delta import Delta
    from kvbench.core.codec import prepare

    cache = tmp_path / "home" / "codecs" / "delta-0123.state"
    _refuse(monkeypatch, tmp_path / "home", errno.EROFS)
    got = prepare(Delta(predictor="linear"), lambda: [random_kv(seed=3)], cache=cache)
    assert got.state and not got.cached and not cache.exists()
    assert f"warning: fitted state not kept in {cache.parent}: it is on a read-only file system" in capsys.readouterr().err


def test_a_runs_cached_fitted_state_is_checked_on_the_next_run(tiny_cfg, tiny_handle, monkeypatch):
    """The state a run caches under KVBENCH_HOME/codecs, damaged, stops the next run that would load it."""
    from kvbench.core import codec
    from kvbench.store.paths import home
    from kvbench.sweep.cells import run_cell

    monkeypatch.setattr(codec, "git_sha", lambda: "c" * 40)  # a clean commit, whatever the checkout's state
    cfg = tiny_cfg("+compressor=delta", "compressor.predictor=linear", "metrics.nll=false")
    run_cell("run", cfg, tiny_handle, resume=False)
    state, = (home() / "codecs").glob("*.state")
    flip(state)
    with pytest.raises(IntegrityError) as got:
        run_cell("run", cfg, tiny_handle, resume=False)
    assert str(state) in one_line(str(got.value))


# --- finished runs -------------------------------------------------------------------------------------------------


def _measure(calls: list):
    def measure():
        calls.append(1)
        return {"delta_nll": 0.5, results.NLL_KEY: ([np.ones(4), np.zeros(3)], [np.full(4, 1.5), np.full(3, 0.5)])}, \
            [{"layer": 0, "kind": "k"}]

    return measure


@pytest.fixture()
def finished_run(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "git_sha", lambda: "e" * 40)
    cfg = {"paths": {"results": str(tmp_path / "results")}, "model": {"name": "m"}}
    calls: list = []
    out = results.reuse_or_measure("run", cfg, "x", None, _measure(calls))
    assert calls == [1] and set(out.summary[results.FILE_HASHES]) == {"rows.parquet", results.NLL_FILE}
    assert json.loads((out.path / "summary.json").read_text()) == out.summary
    return cfg, out, calls


@pytest.mark.parametrize("how", ["bit", "truncated", "empty"])
def test_damaged_per_token_nlls_are_refused_by_name(finished_run, how):
    _, out, _ = finished_run
    f = out.path / results.NLL_FILE
    damage(f, how)
    with pytest.raises(IntegrityError) as got:
        results.read_nll(out.path)
    msg = one_line(str(got.value))
    assert msg.startswith(str(f)) and "metrics.resume=false" in msg


@pytest.mark.parametrize("name,how", [("nll.npz", "bit"), ("nll.npz", "empty"), ("nll.npz", "deleted"),
                                      ("rows.parquet", "bit"), ("rows.parquet", "empty")])
def test_a_finished_run_that_fails_its_hashes_is_measured_again(finished_run, capsys, name, how):
    cfg, out, calls = finished_run
    f = out.path / name
    f.unlink() if how == "deleted" else damage(f, how)
    assert results.finished(out.path.parent.parent, "run", out.summary["cell_key"]) == []
    again = results.reuse_or_measure("run", cfg, "x", None, _measure(calls))
    assert not again.reused and calls == [1, 1] and again.path == out.path  # the damaged directory is replaced
    assert f"warning: not reusing run {out.path.name}: {f}" in capsys.readouterr().err
    assert len(results.read_nll(again.path)) == 2
    assert results.reuse_or_measure("run", cfg, "x", None, _measure(calls)).reused and calls == [1, 1]


def test_evidence_copies_keep_their_check(finished_run, tmp_path):
    """A run published as evidence keeps its summary as written, so its NLLs are still checked there; a summary
    written before hashes were recorded is read as it is."""
    _, out, _ = finished_run
    ev = tmp_path / "evidence" / "study" / out.path.name
    ev.mkdir(parents=True)
    for name in ("summary.json", results.NLL_FILE):
        (ev / name).write_bytes((out.path / name).read_bytes())
    assert len(results.read_nll(ev)) == 2
    flip(ev / results.NLL_FILE)
    with pytest.raises(IntegrityError, match="fails its content hash"):
        results.read_nll(ev)
    summary = json.loads((ev / "summary.json").read_text())
    del summary[results.FILE_HASHES]
    (ev / "summary.json").write_text(json.dumps(summary))
    (ev / results.NLL_FILE).write_bytes((out.path / results.NLL_FILE).read_bytes())
    assert len(results.read_nll(ev)) == 2


def test_a_tiny_model_run_with_damaged_nlls_is_measured_again(tiny_cfg, tiny_handle, monkeypatch, capsys):
    """The next ``run`` of the same cell on the tiny model does not reuse a run whose nll.npz lost a bit."""
    from kvbench.sweep.cells import run_cell

    monkeypatch.setattr(results, "git_sha", lambda: "f" * 40)
    cfg = tiny_cfg("+compressor=identity")
    first = run_cell("run", cfg, tiny_handle)
    flip(first.path / results.NLL_FILE)
    again = run_cell("run", cfg, tiny_handle)
    assert not again.reused and f"{first.path / results.NLL_FILE} fails its content hash" in capsys.readouterr().err
    assert again.summary["delta_nll"] == first.summary["delta_nll"] and run_cell("run", cfg, tiny_handle).reused
