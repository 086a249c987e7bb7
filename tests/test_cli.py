"""The command line as a user types it, on the real packaged model (subprocesses: each loads the model once)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

SMALL = ["dataset.n_sequences=1", "dataset.n_calib=0", "dataset.seq_len=128", "dataset.eval_len=16"]


def _kvbench(*args, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "kvbench", *args], capture_output=True, text=True, env=env, timeout=600)


def test_capture_then_run_on_the_stored_trace(tmp_path):
    trace = tmp_path / "trace"
    cap = _kvbench("capture", *SMALL, f"trace={trace}")
    assert cap.returncode == 0, cap.stderr
    assert (trace / "manifest.json").exists()
    manifest = json.loads((trace / "manifest.json").read_text())
    assert manifest["model"]["n_layers"] == 30 and manifest["model"]["n_kv_heads"] == 3
    run = _kvbench("run", "+compressor=kivi", "compressor.bits=3", f"trace={trace}", *SMALL, "metrics.nll=false",
                   env_extra={"KVBENCH_RESULTS": str(tmp_path / "res")})
    assert run.returncode == 0, run.stderr
    (summary_path,) = (tmp_path / "res" / "runs").glob("kivi-*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["compressor"] == "kivi" and summary["n_tokens"] == 128
    assert "compression ratio" in run.stdout
    again = _kvbench("run", "+compressor=kivi", "compressor.bits=3", f"trace={trace}", *SMALL, "metrics.nll=false",
                     env_extra={"KVBENCH_RESULTS": str(tmp_path / "res")})
    assert "reusing finished run" in again.stdout


def test_user_errors_exit_2_with_the_allowed_values():
    bad = _kvbench("run", "+compressor=kivi", "compressor.bits=9")
    assert bad.returncode == 2 and "1 <= bits <= 8" in bad.stderr
    none = _kvbench("run")
    assert none.returncode == 2 and "+compressor=NAME" in none.stderr and "kivi" in none.stderr
