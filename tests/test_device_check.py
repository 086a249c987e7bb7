"""scripts/device_check.sh and scripts/bench_device.py: the device's figures against the CPU's, each against its stated
tolerance, the contract suite's outcome read from its report, the coders timed, and the JSON the check writes."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
from types import SimpleNamespace

import pytest
import torch

from kvbench.core.kv import KVSequence
from kvbench.store.paths import repo_root

SCRIPTS = repo_root() / "scripts"


@pytest.fixture(scope="module")
def bd():
    import sys

    sys.path.insert(0, str(SCRIPTS))  # bench_device imports bench_compressors as a sibling script
    try:
        spec = importlib.util.spec_from_file_location("bench_device_script", SCRIPTS / "bench_device.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module


def summary(bits=4.625, dnll=0.07, base=2.95) -> dict:
    return {"bits_per_element": bits, "delta_nll": dnll, "nll_base": base, "device": "x", "model_dtype": "bfloat16"}


def test_a_cell_holds_with_equal_bits_and_nll_changes_within_the_tolerance(bd):
    got = bd.compare_cell("kivi", summary(dnll=0.070), summary(dnll=0.070 + 0.9 * bd.TOLERANCES["delta_nll_abs_nats"]))
    assert got["failed"] == [] and got["bits_per_element_diff"] == 0
    assert got["delta_nll_diff"] == pytest.approx(-0.9 * bd.TOLERANCES["delta_nll_abs_nats"])
    assert got["device"]["model_dtype"] == "bfloat16" and got["overrides"] == ["+compressor=kivi", "compressor.bits=2"]


@pytest.mark.parametrize(("dev", "cpu", "match"), [
    (summary(bits=4.625), summary(bits=4.6250001), "bits/element on the device"),
    (summary(dnll=0.07), summary(dnll=0.085), r"0\.01500 apart \(tolerance 0\.01\)"),
    (summary(dnll=math.nan), summary(dnll=0.07), r"delta_nll \+nan on the device"),
])
def test_a_cell_fails_on_other_bits_or_nll_changes_too_far_apart(bd, dev, cpu, match):
    (failed,) = bd.compare_cell("kvtc", dev, cpu)["failed"]
    assert failed.startswith("kvtc: ") and re.search(match, failed), failed


def trace(seed=0, n=3, T=16, scale=0.0, tokens_shift=0):
    """A trace's sequences as the capture comparison reads them: two evaluated windows and a calibration one, K
    perturbed by ``scale`` (relative), token ids shifted by ``tokens_shift``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        k = torch.randn(2, 2, T, 8, generator=g)
        v = torch.randn(2, 2, T, 8, generator=g)
        ids = torch.arange(T) + i + tokens_shift
        kv = KVSequence((k * (1 + scale)).half(), v.half(), ids)
        out.append(SimpleNamespace(kv=kv, continuation=ids[:4], logprobs=torch.full((T - 1,), -2.0 - scale),
                                   role="eval" if i < 2 else "calib"))
    return out


def test_two_captures_of_the_same_windows_agree(bd):
    got = bd.compare_captures(trace(), trace())
    assert got["failed"] == [] and got["tokens_equal"] and got["rel_mse_k"] == got["rel_mse_v"] == 0
    assert got["bound_bits_per_token_device"] == pytest.approx(2 / math.log(2)) and got["bound_diff"] == 0


def test_a_capture_out_of_tolerance_or_of_other_windows_fails(bd):
    got = bd.compare_captures(trace(scale=0.05), trace())  # K 5% off: relative MSE 0.0025; the bound 0.07 bits off
    assert got["rel_mse_k"] == pytest.approx(0.0025, rel=0.02) and got["rel_mse_v"] == 0
    assert [f.split(" ")[1:4] for f in got["failed"]] == [["relative", "MSE", "of"], ["the", "bound", "differs"]]
    assert not bd.compare_captures(trace(tokens_shift=1), trace())["tokens_equal"]
    assert "not the CPU's token ids" in bd.compare_captures(trace(tokens_shift=1), trace())["failed"][0]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="{e}" failures="{f}"
skipped="1" tests="5" time="3.2"><testcase classname="tests.test_x" name="test_a"/><testcase classname="tests.test_x"
name="test_b">{body}</testcase></testsuite></testsuites>"""


def test_the_contract_suites_outcome_is_read_from_its_report(bd, tmp_path):
    ok = tmp_path / "ok.xml"
    ok.write_text(JUNIT.format(e=0, f=0, body=""))
    got = bd.contract_figures(ok, 0, 3.5)
    assert (got["tests"], got["failures"], got["skipped"], got["failed"], got["wall_s"]) == (5, 0, 1, [], 3.5)
    bad = tmp_path / "bad.xml"
    bad.write_text(JUNIT.format(e=0, f=1, body='<failure message="boom"/>'))
    got = bd.contract_figures(bad, 1, 3.5)
    assert got["failed_tests"] == ["tests.test_x::test_b"] and got["failed"] == [
        "contract suite: 1 failed, 0 errors of 5 (exit status 1)"]
    assert bd.contract_figures(tmp_path / "none.xml", 4, 1.0)["failed"] == ["contract suite: no report (exit status 4)"]


def test_every_per_vector_and_transform_coder_is_timed_and_quick_times_three(bd):
    from kvbench.core.config import available, compressor_class

    full = bd.throughput_coders(quick=False)
    assert full == [n for n in available("compressor") if compressor_class(n).family in ("quantizer", "transform")]
    assert {"kivi", "turboquant", "fp8", "kvquant", "kvtc", "aquakv", "waterfill"} <= set(full)
    assert bd.throughput_coders(quick=True) == sorted(bd.QUICK_CODERS)


def test_a_coder_refusing_device_tensors_is_timed_in_host_memory_and_says_so(bd, random_kv):
    kv = random_kv(L=1, H=1, T=64, D=32)
    # the meta device holds no data: every coder's encoder refuses its tensors, as one calling .numpy() refuses CUDA's
    row = bd.time_coder("kivi", None, [], [kv], "meta", repeats=1, budget_s=0.0)
    assert row["placement"] == "cpu" and row["device_refused"].startswith("TypeError: can't convert meta device type")
    assert row["encode_GBps"] > 0 and row["decode_GBps"] == row["decode_MBps"] / 1e3 and row["decoded_on"] == "cpu"
    here = bd.time_coder("kivi", None, [], [kv], "cpu", repeats=1, budget_s=0.0)
    assert here["placement"] == "cpu" and "device_refused" not in here and here["bits_per_element"] == row[
        "bits_per_element"]


def test_the_check_writes_its_json_with_every_failure_and_fails_on_any(bd, tmp_path):
    cells = [bd.compare_cell("kivi", summary(), summary()), bd.compare_cell("kvtc", summary(bits=2.1), summary())]
    report = {"device": "cpu", "contract": {"failed": []}, "capture": {"failed": []}, "cells": cells,
              "throughput": [{"coder": "kivi", "encode_GBps": 0.3}, {"coder": "fp8", "skipped": "OSError: x"}]}
    out = tmp_path / "results" / "device_check.json"
    assert bd.conclude(report, out, started=0.0) == 1
    written = json.loads(out.read_text())
    assert written["ok"] is False and written["wall_s"] > 0 and [f.split(":")[0] for f in written["failed"]] == [
        "kvtc", "throughput"]
    report.update(cells=cells[:1], throughput=report["throughput"][:1])
    assert bd.conclude(report, out, started=0.0) == 0 and json.loads(out.read_text())["failed"] == []
    report["errors"] = {"cells": "RuntimeError: a step that raised"}  # kept, with what the other steps measured
    assert bd.conclude(report, out, started=0.0) == 1
    assert json.loads(out.read_text())["failed"] == ["cells: RuntimeError: a step that raised"]
    assert [p.name for p in out.parent.iterdir()] == ["device_check.json"]  # written atomically: no stray temporary


@pytest.mark.parametrize(("args", "says"), [(["--device", "gpu"], "--device gpu is not allowed"),
                                            (["--bogus"], "unknown argument --bogus"),
                                            (["--device", "cuda:99"], "device='cuda:99' is not allowed")])
def test_the_shell_script_refuses_a_bad_argument_or_an_unseen_gpu_before_any_work(args, says):
    import os
    import sys

    got = subprocess.run(["bash", str(SCRIPTS / "device_check.sh"), *args], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PY": sys.executable})
    assert got.returncode == 2 and says in got.stderr and "contract suite" not in got.stdout
