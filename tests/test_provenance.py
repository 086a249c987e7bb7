"""Which finished work is reused: runs only of the same code version by default (``metrics.resume: code``), traces
only of the same capture code."""

from kvbench.core.config import compose
from kvbench.inputs import capture
from kvbench.store import results


def test_every_measuring_command_reuses_only_runs_of_its_code_version_by_default():
    assert compose(["+compressor=kivi"]).metrics.resume == "code"
    assert compose(["+compressor=kivi"], config_name="eval").metrics.resume == "code"
    for name in ("latency", "restore"):  # timing is never reused
        assert compose(["+compressor=kivi"], config_name=name).metrics.resume is False


def test_a_run_is_measured_again_after_the_code_version_changes(tmp_path, monkeypatch):
    cfg = {"compressor": {"name": "identity"}, "paths": {"results": str(tmp_path)}, "seed": 0}
    measured = []

    def measure():
        measured.append(1)
        return {"value": len(measured)}, [{"row": 0}]

    def at(sha):
        monkeypatch.setattr(results, "git_sha", lambda: sha)
        return results.reuse_or_measure("run", cfg, "identity", {"name": "identity"}, measure, resume="code")

    first = at("a" * 40)
    again = at("a" * 40)
    assert not first.reused and again.reused and again.summary["value"] == 1
    later = at("b" * 40)
    assert not later.reused and later.summary["value"] == 2 and later.summary["git_sha"] == "b" * 40
    # any version: the newest finished run of the cell, whatever code measured it
    assert results.reuse_or_measure("run", cfg, "identity", {"name": "identity"}, measure, resume=True).reused
    assert len(measured) == 2


def test_the_trace_key_names_the_capture_code(monkeypatch):
    cfg = compose(["+compressor=identity"])
    before = capture.trace_key(cfg)
    assert capture.trace_key(cfg) == before
    monkeypatch.setattr(capture, "capture_code_version", lambda: "0" * 16)
    assert capture.trace_key(cfg) != before


def test_the_capture_code_version_reads_the_capture_modules():
    assert len(capture.capture_code_version()) == 16
    assert "kvbench.inputs.capture" in capture.CAPTURE_CODE


def test_the_code_version_is_dirty_for_code_changes_not_for_a_studys_own_outputs(tmp_path, monkeypatch):
    """A study rewrites its committed pages and log under results/ as it runs; that does not make the code it
    measures another version. Any other tracked change does."""
    import subprocess

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=k", "-c", "user.email=k@k", *args], check=True,
                       capture_output=True)

    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "reproduce.log").write_text("old\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "one")
    monkeypatch.setattr(results, "repo_root", lambda: tmp_path)
    sha = results.git_sha()
    assert len(sha) == 40
    (tmp_path / "results" / "reproduce.log").write_text("new\n")
    (tmp_path / "results" / "reproduce.log").unlink()
    assert results.git_sha() == sha
    (tmp_path / "code.py").write_text("x = 2\n")
    assert results.git_sha() == sha + "-dirty"
