"""Hydra multirun through the joblib and submitit_local launchers, resumption, trace reuse, and the report.

The CLI runs in subprocesses, so the model is a tiny random Llama saved as a Hugging Face checkpoint with an
offline word-level tokenizer (conftest's ``tiny_checkpoint``), and the text a small local file. KVBENCH_HOME and KVBENCH_RESULTS live in tmp.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from kvbench.core.config import available, compose

pytestmark = pytest.mark.slow

GRID = ["+compressor=kivi,turboquant", "compressor.bits=2,3,4"]  # two compressors that share a field
N_CELLS = 6


def _setup(tmp_path: Path, tiny_checkpoint) -> tuple[list[str], dict, Path]:
    ckpt, corpus = tiny_checkpoint
    args = ["model=hf", f"model.path={ckpt}", "dataset=text", f"dataset.path={corpus}", "dataset.seq_len=48",
            "dataset.eval_len=8", "dataset.n_sequences=2", "dataset.n_calib=1",
            "metrics.resume=true"]  # any code version: a commit landing between the two sweeps must not matter
    env = {**os.environ, "KVBENCH_HOME": str(tmp_path / "home"), "KVBENCH_RESULTS": str(tmp_path / "results"),
           "OMP_NUM_THREADS": "1"}
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return args, env, cwd


def _kvbench(args: list[str], env: dict, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "kvbench", *args], env=env, cwd=cwd, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    return p


def _summaries(results: Path) -> dict[Path, tuple[int, int, bytes]]:
    """Each finished run's summary with the inode of its directory and its modification time: a rewrite goes
    through a new staged directory, so it changes the inode whatever the clock says."""
    return {p: (p.parent.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted((results / "runs").glob("*/summary.json"))}


def _hidden(runs: Path) -> list[Path]:
    """Hidden entries in runs/ other than the cells' lock files: a killed run's staging directory."""
    return [p for p in runs.iterdir() if p.name.startswith(".") and p.name != ".locks"]


def _launcher_logs(results: Path, besides: frozenset = frozenset()) -> str:
    """The submitit job logs under the sweep folders, leaving out the files named in ``besides``."""
    return "".join(p.read_text() for p in sorted((results / "sweeps").rglob("*_log.out")) if p not in besides)


@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])
def test_multirun_runs_every_cell_once_and_resumes(tmp_path, tiny_checkpoint, launcher, capsys):
    args, env, cwd = _setup(tmp_path, tiny_checkpoint)
    cmd = ["run", "-m", *GRID, f"hydra/launcher={launcher}", *args]
    if launcher == "joblib":
        cmd.append("hydra.launcher.n_jobs=2")
    results = tmp_path / "results"

    first = _kvbench(cmd, env, cwd)
    done = _summaries(results)
    assert len(done) == N_CELLS, first.stdout[-2000:]
    cells = [json.loads(b) for *_, b in done.values()]
    grid = {(c["compressor"], c["compressor_params"]["bits"]) for c in cells}
    assert grid == {(name, b) for name in ("kivi", "turboquant") for b in (2, 3, 4)}
    # one (model, dataset) trace: captured by exactly one cell, under the lock, reused by the other five
    traces = [p for p in (tmp_path / "home" / "traces").iterdir() if not p.name.startswith(".")]
    assert len(traces) == 1
    assert sum(c["trace_captured"] for c in cells) == 1
    assert {c["trace"] for c in cells} == {str(traces[0])}
    # nothing half-written or left in the working directory; the sweep dir records the sweep
    assert not _hidden(results / "runs")
    assert list(cwd.iterdir()) == []
    assert len(list((results / "sweeps").glob("*/multirun.yaml"))) == 1
    logs_before = frozenset((results / "sweeps").rglob("*_log.out"))

    second = _kvbench(cmd, env, cwd)
    assert _summaries(results) == done, "the second invocation rewrote a finished cell"
    # the sweep folder is named by the second a sweep starts: two invocations may share it, so the second one's
    # job logs are the files the first did not leave
    out = second.stdout if launcher == "joblib" else _launcher_logs(results, logs_before)
    assert out.count("reusing finished run") == N_CELLS
    assert 1 <= len(list((results / "sweeps").glob("*/multirun.yaml"))) <= 2
    assert list(cwd.iterdir()) == []

    if launcher == "joblib":
        from kvbench.__main__ import main

        assert main(["report", str(results / "runs"), "--out", str(tmp_path / "report")]) == 0
        _check_report(tmp_path / "report", N_CELLS, capsys.readouterr().out)


def _check_report(out: Path, n_rows: int, stdout: str) -> None:
    for name in ("runs.csv", "runs.md", "runs.tex", "best_at_1pct_nll.md", "best_at_1pct_nll.tex"):
        assert (out / name).stat().st_size > 0, name
    for fig in ("rate_distortion", "context_length", "throughput_vs_ratio"):
        for ext in ("png", "pdf"):
            assert (out / "figures" / f"{fig}.{ext}").stat().st_size > 1000, (fig, ext)
    assert len(pd.read_csv(out / "runs.csv")) == n_rows
    md = (out / "runs.md").read_text().splitlines()
    assert len(md) == 2 + n_rows and md[0].startswith("| model")
    tex = (out / "runs.tex").read_text()
    assert tex.count(r"\\") == 1 + n_rows and r"\toprule" in tex
    assert f"{n_rows} runs" in stdout and "prefix_sharing: nothing to plot" in stdout


def test_killed_cell_leaves_no_summary_and_is_skipped_by_report(tmp_path):
    """SIGKILL inside results.write: the final run dir never appears, the report lists the leftovers and goes on."""
    runs = tmp_path / "runs"
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from kvbench.store.results import write

        class Stall:  # serialised last: the kill lands while the staged directory is half written
            def __str__(self):
                print("writing", flush=True)
                time.sleep(60)

        summary = {{"compressor": "kivi", "bits_per_element": 4.0, "stall": Stall()}}
        write(Path({str(runs / "kivi-abc")!r}), "run", summary, [{{"layer": 0, "kind": "k"}}], {{}})
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert not (runs / "kivi-abc").exists()
    leftovers = [d for d in runs.iterdir() if d.name.startswith(".kivi-abc.")]
    assert len(leftovers) == 1 and not (leftovers[0] / "summary.json").exists()

    from kvbench.report.build import write_report
    from kvbench.report.collect import collect

    good = runs / "kivi-good"
    good.mkdir()
    (good / "summary.json").write_text(json.dumps({"compressor": "kivi", "model": "m", "dataset": "d",
                                                   "bits_per_element": 4.0, "compression_ratio": 4.0}))
    (runs / "broken").mkdir()
    (runs / "broken" / "summary.json").write_text('{"compressor": "ki')
    (runs / "partial").mkdir()
    (runs / "partial" / "rows.parquet").write_bytes(b"")
    (runs / "foreign").mkdir()
    (runs / "foreign" / "summary.json").write_text("[1, 2]")
    got = collect([runs, tmp_path / "missing"])
    assert list(got.table["run_id"]) == ["kivi-good"]
    reasons = {Path(p).name: why for p, why in got.skipped}
    assert set(reasons) == {leftovers[0].name, "broken", "partial", "foreign", "missing"}
    assert "killed" in reasons[leftovers[0].name] and "unreadable" in reasons["broken"]
    res = write_report([runs], tmp_path / "report")
    assert res["rows"] == 1 and (tmp_path / "report" / "skipped.txt").read_text().count("\n") == 4
    # one run with no NLL and no timing: tables are written, figures with nothing to plot are skipped
    assert "rate_distortion" in res["empty"] and "prefix_sharing" in res["empty"]


@pytest.mark.parametrize("name", available("experiment"))
def test_experiment_presets_compose_and_their_first_cell_builds(name):
    """Each preset composes, sets only what it lists, and its sweep axes are valid overrides."""
    from omegaconf import OmegaConf

    from kvbench.core.config import make_compressor

    raw = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[1] / "configs" / "experiment" / f"{name}.yaml"))
    params = raw.get("hydra", {}).get("sweeper", {}).get("params", {})
    assert raw and (params or set(raw) - {"hydra", "defaults"}), f"experiment {name} changes nothing"
    from hydra.core.override_parser.overrides_parser import OverridesParser

    # the first value of each axis as Hydra reads the sweep (a value may be a dict with commas inside)
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    first = [f"{k}={next(iter(o.sweep_string_iterator())) if o.is_sweep_override() else o.value()}"
             for k, o in zip(params, parsed)]
    cfg = compose([f"+experiment={name}", *first])
    base = compose([])
    changed = {k for k in OmegaConf.to_container(cfg) if OmegaConf.select(cfg, k) != OmegaConf.select(base, k)}
    groups = {next(iter(d)).split()[-1].strip("/") for d in raw.get("defaults", []) if isinstance(d, dict)}
    listed = (set(raw) - {"defaults", "hydra"}) | groups | {k.lstrip("+").split(".")[0] for k in params}
    assert changed <= listed, f"{name} changes {changed - listed} that it does not list"
    if cfg.get("compressor") is not None:
        make_compressor(cfg.compressor)


def test_a_failing_cell_does_not_stop_the_sweep(tmp_path, tiny_checkpoint):
    args, env, cwd = _setup(tmp_path, tiny_checkpoint)
    p = subprocess.run([sys.executable, "-m", "kvbench", "run", "-m", "+compressor=kivi", "compressor.bits=9,2",
                        "compressor.residual=0", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "kivi.bits=9 is out of range" in p.stderr
    assert "[sweep cell #0] +compressor=kivi compressor.bits=9" in p.stderr and "[sweep cell #1]" in p.stderr
    cells = [json.loads(s.read_text()) for s in (tmp_path / "results" / "runs").glob("*/summary.json")]
    assert [c["compressor_params"]["bits"] for c in cells] == [2]


def test_a_sweep_over_compressors_applies_a_shared_fixed_field_to_every_cell(tmp_path, tiny_checkpoint):
    """``-m +compressor=turboquant,kvquant compressor.bits=4``: Hydra composes such a sweep without the compressor,
    which only each cell selects, and used to refuse the fixed field, advising ``+compressor.bits=4``."""
    args, env, cwd = _setup(tmp_path, tiny_checkpoint)
    p = _kvbench(["run", "-m", "+compressor=turboquant,kvquant", "compressor.bits=4", *args, "metrics.nll=false"],
                 env, cwd)
    cells = sorted((json.loads(s.read_text()) for s in (tmp_path / "results" / "runs").glob("*/summary.json")),
                   key=lambda c: c["compressor"])
    assert [(c["compressor"], c["compressor_params"]["bits"]) for c in cells] == [("kvquant", 4), ("turboquant", 4)]
    assert p.stderr.count("[sweep cell #") == 2
    # the same cell as the run that names one compressor: a sweep finds it finished
    from kvbench.sweep.cells import compose_cell, key_of

    single = key_of(compose_cell("run", ["+compressor=kvquant", "compressor.bits=4", *args, "metrics.nll=false"]))
    assert single == cells[0]["cell_key"]


def test_slurm_launcher_config(tmp_path, monkeypatch):
    """hydra/launcher=slurm is submitit's SLURM launcher with kvbench-sized resources, logging under results."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from kvbench.core.config import CONFIG_DIR

    monkeypatch.setenv("KVBENCH_RESULTS", str(tmp_path / "res"))
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = hydra_compose("run", ["hydra/launcher=slurm", "hydra.launcher.partition=cpu"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["_target_"].endswith("submitit_launcher.SlurmLauncher")
    assert launcher["partition"] == "cpu" and launcher["cpus_per_task"] == 8 and launcher["timeout_min"] == 120
    assert launcher["submitit_folder"].startswith(str(tmp_path / "res" / "sweeps"))
