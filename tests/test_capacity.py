"""``python -m kvbench capacity``: the memory arithmetic on a case worked by hand, the projection's use of the
measured bits and step costs, the bad inputs, the geometry-only configs that no command runs, and results/capacity.md
rebuilt from its evidence (and its rows recomputed from the evidence they name) as ``report --check`` does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest
from omegaconf import OmegaConf

from kvbench.core.config import compose
from kvbench.inputs.assets import Geometry
from kvbench.report import capacity as cap
from kvbench.report.check import check
from kvbench.report.evidence import export
from kvbench.report.pages import register, write_pages
from kvbench.report.rederive import recompute_run
from kvbench.store.paths import repo_root

EVIDENCE = repo_root() / "results" / "evidence"
PAGE = "capacity.md"
MODELS = ("llama31_8b", "qwen3_8b", "qwen25_7b")
#: a Llama-3.1-8B-shaped model with round figures: 32 layers x 8 KV heads x head_dim 128, 8e9 parameters
GEOM = Geometry(32, 8, 128, 8_000_000_000, 131072)


def _points() -> pd.DataFrame:
    """One measured coder as the frontier evidence gives it: 4 stream bits per element, measured at head_dim 64."""
    return pd.DataFrame([{"compressor": "coder", "label": "coder", "model": "small", "run_id": "coder-run",
                          "stream_bits": 4.0, "compressor_params.bits": 4, "exact_tokens": "none", "context_len": 1024,
                          "delta_nll": 0.001, "delta_nll_ci": [0.0, 0.002], "nll_base": 3.0, "eval_documents_n": 16}])


def test_the_arithmetic_of_a_case_worked_by_hand():
    # 80 GB, bf16 weights 8e9 x 2 = 16 GB, reserve 8 GB: 56e9 bytes of KV
    # 16 bits: 2 x 32 x 8 x 128 x 16 / 8 = 131,072 bytes/token -> 427,246 tokens, 104 contexts of 4,096
    # 4 bits: 32,768 bytes/token -> 1,708,984 tokens, 417 contexts of 4,096, 52 of 32,768
    assert GEOM.kv_elements_per_token == 65536
    assert cap.kv_bytes_per_token(GEOM, 16) == 131072 and cap.kv_bytes_per_token(GEOM, 4) == 32768
    steps = pd.DataFrame([{"compressor": "coder", "model": "small", "context": 4096, "run_id": "lat", "ratio": 2.0,
                           "params": "bits=4", "device": "cpu", "model_dtype": "float32"}])
    rows = cap.project(GEOM, 16.0, 80.0, 8.0, [4096, 32768], 3350.0, _points(), steps, {"small": 64})
    got = {(r["label"], r["context"]): r for r in rows}
    base, coder = got[(cap.BASELINE_LABEL, 4096)], got[("coder", 4096)]
    assert (base["kv_tokens"], base["concurrent"], got[(cap.BASELINE_LABEL, 32768)]["concurrent"]) == (427246, 104, 13)
    assert (coder["kv_tokens"], coder["concurrent"], got[("coder", 32768)]["concurrent"]) == (1708984, 417, 52)
    assert coder["capacity_x"] == pytest.approx(1708984 / 427246)
    # a memory-bound step at 417 contexts: (16e9 + 417 x 4,096 x 32,768 bytes) / 3.35e12 B/s, x the step cost 2
    step = (16e9 + 55_968_792_576) / 3.35e12
    assert coder["tokens_per_s_memory"] == pytest.approx(417 / step)
    assert coder["tokens_per_s"] == pytest.approx(417 / (2 * step))
    assert base["tokens_per_s"] == pytest.approx(104 / ((16e9 + 104 * 4096 * 131072) / 3.35e12))
    assert coder["vs_16bit"] == pytest.approx(coder["tokens_per_s"] / base["tokens_per_s"])
    assert coder["step_run"] == "lat" and coder["step_params_match"] and not coder["head_dim_matches"]
    assert (coder["measured_head_dim"], coder["stream_bits_per_element"]) == (64, 4.0)
    # no latency run of the coder: not projected, and the command that would measure it is named
    bare = cap.project(GEOM, 16.0, 80.0, 8.0, [4096], 3350.0, _points(), pd.DataFrame(), {"small": 64})[1]
    assert bare["tokens_per_s"] is None and bare["step_measure"] == "python -m kvbench latency +compressor=coder"
    # past the model's positions nothing fits
    short = Geometry(32, 8, 128, 8_000_000_000, 8192)
    assert cap.project(short, 16.0, 80.0, 8.0, [32768], 3350.0, _points(), steps, {})[0]["concurrent"] == 0


def test_the_committed_evidence_gives_llama_each_frontier_coder_and_kivis_measured_step_cost():
    s = cap.compute(compose(["model=llama31_8b"], config_name="capacity"))
    assert (s["weights_gb"], s["kv_budget_gb"]) == (pytest.approx(16.060522496), pytest.approx(80 - 8 - 16.060522496))
    rows = [r for r in s["rows"] if r["row"] == "projected"]
    frontier = {(r["label"], r["measured_model"]) for r in rows if r["compressor"] != cap.DYNAMIC}
    assert {("fp8", "smollm2_135m"), ("kivi", "gemma3_270m"), ("waterfill", "smollm2_135m")} <= frontier
    kivi = next(r for r in rows if r["label"] == "kivi" and r["measured_model"] == "smollm2_135m" and r["context"] == 4096)
    lat = json.loads(next((EVIDENCE / "latency").glob("latency-kivi-*/latency.json")).read_text())
    ms = {r["cache"]: r["decode_median_ms"] for r in lat["rows"] if r["context"] == 4096}
    assert kivi["step_ratio"] == pytest.approx(ms["compressed"] / ms["dynamic"]) and kivi["step_context"] == 4096
    assert not kivi["step_params_match"]  # the latency run is KIVI 2-bit, the frontier point 4-bit: said, not hidden
    assert {r["setting"] for r in s["rows"] if r["row"] == "published"} == {"turboquant_3bit_nc", "fp8"}


@pytest.mark.parametrize(("overrides", "message"), [
    (["capacity.memory_gb=0"], "capacity.memory_gb=0 is not allowed; give a number above 0"),
    (["capacity.memory_gb=12"], "capacity.memory_gb=12 is not allowed: it must exceed the weights (16.06 GB) plus"),
    (["capacity.weights_gb=-1"], "capacity.weights_gb=-1 is not allowed; give a number above 0"),
    (["capacity.contexts=[4096,0]"], "capacity.contexts=[4096, 0] is not allowed"),
    (["capacity.reserve_fraction=1.5"], "capacity.reserve_fraction=1.5 is not allowed"),
    (["model=smollm2_135m", "model.name=bogus"], "model.name='bogus' (model.source='packaged') has no geometry; "
                                                 "choose model= one of ['gemma3_270m', 'llama31_8b'"),
    (["model=hf"], "model.path is not set"),
], ids=["no-memory", "below-weights", "weights", "contexts", "reserve", "unknown-model", "checkpoint-path"])
def test_a_bad_input_is_one_line_naming_the_field_its_value_and_what_is_allowed(overrides, message, capsys, tmp_path):
    cfg = compose([*overrides, f"paths.results={tmp_path}"], config_name="capacity")
    with pytest.raises(SystemExit) as e:
        cap.main(cfg)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()


def _kvbench(*args: str) -> subprocess.CompletedProcess:
    """The command line as a user types it, in a process of its own."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "kvbench", *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=repo_root())


def test_a_geometry_only_model_is_refused_by_run_and_projected_by_capacity(tmp_path, capsys):
    from kvbench.inputs.models import check_model_cfg

    for m in MODELS:  # every command that runs a model reads its config through this check first
        with pytest.raises(ValueError, match=f"model={m} is geometry only .*model=hf model.path=DIR"):
            check_model_cfg(compose([f"model={m}"], config_name="run").model)
    run = _kvbench("run", "model=llama31_8b", "+compressor=kivi", f"paths.results={tmp_path}")
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "is geometry only" in run.stderr, run.stderr
    cap.main(compose([f"paths.results={tmp_path}"], config_name="capacity"))  # the command's default: Llama-3.1-8B
    out = capsys.readouterr().out
    assert "llama31_8b: 32 layers x 8 KV heads x head_dim 128" in out and "PROJECTION" in out
    assert "not measured: python -m kvbench latency +compressor=fp8" in out
    (summary,) = tmp_path.glob("runs/capacity-llama31_8b-*/capacity.json")
    assert json.loads(summary.read_text())["kind"] == "capacity"


def _publish(root, sha="0123456789abcdef"):
    """The page's capacity runs at code version ``sha``, exported as the evidence of study capacity under ``root``."""
    (root / "evidence" / "pages").mkdir(parents=True, exist_ok=True)
    shutil.copy(EVIDENCE / "pages" / PAGE, root / "evidence" / "pages" / PAGE)
    dirs = []
    for m in MODELS:
        cfg = compose([f"model={m}"], config_name="capacity")
        dirs.append(cap.file_run(cap.compute(cfg), OmegaConf.to_container(cfg, resolve=True), root / "sweeps", sha))
    return export("capacity", dirs, root)


def test_the_page_is_rebuilt_from_the_capacity_evidence_and_passes_the_check(tmp_path):
    root = tmp_path / "results"
    evidence = _publish(root)
    register(PAGE, root, study="capacity", report="report/capacity")
    (built,) = write_pages(root, [PAGE], formats=())
    assert built.errors == [] and built.literals == [], (built.errors, built.literals)
    text = (root / PAGE).read_text()
    assert "at commit `0123456` " in text and "| llama31_8b | fp8 |" in text and "PROJECTION." in text
    (ok,) = check(root, pages=[root / PAGE])
    assert ok.status == "ok", ok.lines
    run = next(evidence.glob("capacity-llama31_8b-*"))
    summary = json.loads((run / "capacity.json").read_text())
    summary["rows"][0]["kv_tokens"] += 1
    (run / "capacity.json").write_text(json.dumps(summary))
    assert check(root, pages=[root / PAGE])[0].status == "differs"


def test_a_capacity_run_is_recomputed_from_the_evidence_it_names(tmp_path):
    root = tmp_path / "results"
    for study in ("frontier", "latency"):
        shutil.copytree(EVIDENCE / study, root / "evidence" / study)
    run = next(_publish(root).glob("capacity-llama31_8b-*"))
    assert cap.recompute(run) == ([], [])
    summary = json.loads((run / "capacity.json").read_text())
    summary["rows"][3]["stream_bits_per_element"] = 2.0
    (run / "capacity.json").write_text(json.dumps(summary))
    problems, _ = cap.recompute(run)
    assert len(problems) == 1 and "stream_bits_per_element" in problems[0] and "2.0 in the run" in problems[0], problems
    # report --check recomputes each run of the evidence this way (kvbench.report.rederive), and names the row
    assert recompute_run(run) == (problems, [])
    # the committed runs agree with the committed evidence they name
    for committed in sorted((EVIDENCE / "capacity").glob("capacity-*")):
        assert cap.recompute(committed) == ([], []), committed.name
