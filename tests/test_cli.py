"""The command line as a user types it: the command table behind ``python -m kvbench``, and the commands on the real
packaged model (subprocesses: each loads the model once)."""

import json
import os
import subprocess
import sys

import pytest

SMALL = ["dataset.n_sequences=1", "dataset.n_calib=0", "dataset.seq_len=128", "dataset.eval_len=16"]


def _kvbench(*args, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "kvbench", *args], capture_output=True, text=True, env=env, timeout=600)


def test_help_lists_every_command_of_the_table_once_in_its_order(capsys):
    from kvbench.__main__ import main
    from kvbench.sweep.commands import COMMANDS

    assert main(["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "usage: python -m kvbench {run,capture,assets,eval,latency,restore,stepcost,capacity,report,bound} ..."
    assert [ln.split()[0] for ln in lines[2:]] == list(COMMANDS)
    assert main(["bogus"]) == 2 and "unknown subcommand 'bogus'" in capsys.readouterr().err


def test_every_kind_of_run_is_measured_by_the_command_of_its_name_and_every_named_function_exists():
    from kvbench.core.config import CONFIG_DIR
    from kvbench.store.results import KINDS
    from kvbench.sweep.commands import COMMANDS, MEASURING, function

    # the fuzz tests' tallies and the scale benchmark's steps are filed as runs by the script that measures them, not
    # by a command; capacity runs by a command that measures nothing (it reads committed evidence)
    by_script = {"reliability": "scripts/reliability.py", "scale": "scripts/bench_scale.py",
                 "capacity": "kvbench/report/capacity.py"}
    assert {name: c.kind for name, c in MEASURING.items()} == {k: v for k, v in KINDS.items() if k not in by_script}
    assert all((CONFIG_DIR.parent / script).is_file() for script in by_script.values())
    for c in COMMANDS.values():
        if c.measure is not None:  # one cell through the Hydra config of its name
            assert c.config == c.name and c.format and c.kind and c.main is None, c
        else:  # its own body: on the composed config (capture) or on its argv
            assert c.main and c.format is None and c.kind is None, c
        assert c.config is None or (CONFIG_DIR / f"{c.config}.yaml").is_file(), c
        assert all(callable(function(ref)) for ref in (c.main, c.measure, c.format) if ref), c


@pytest.mark.parametrize(("argv", "want"), [
    # a sweep over compressors composes each one per cell: a fixed field becomes a per-cell sweep of its one value
    (["-m", "+compressor=turboquant,kvquant", "compressor.bits=4"],
     ["-m", "+compressor=turboquant,kvquant", "++compressor.bits=choice(4)"]),
    (["-m", "+compressor=glob(kivi*)", "compressor.bits=[3]", "dataset.seq_len=64"],
     ["-m", "+compressor=glob(kivi*)", "++compressor.bits=choice([3])", "dataset.seq_len=64"]),
    # a swept field is applied per cell already; so is every field of a sweep over one compressor's settings
    (["-m", "+compressor=kvquant,aquakv", "compressor.bits=2,3", "compressor.pre_rope=false"],
     ["-m", "+compressor=kvquant,aquakv", "compressor.bits=2,3", "++compressor.pre_rope=choice(false)"]),
    (["-m", "+compressor=kivi", "compressor.bits=2,3", "compressor.residual=0"],
     ["-m", "+compressor=kivi", "compressor.bits=2,3", "compressor.residual=0"]),
    (["+compressor=kivi", "compressor.bits=3", "+compressor.residual=0", "--cfg", "job"],
     ["+compressor=kivi", "compressor.bits=3", "+compressor.residual=0", "--cfg", "job"]),
    # a plugin of one's own in place of the class: every compressor's config names its class
    (["-m", "+compressor=identity", "compressor._target_=faultplug.Faulty"],
     ["-m", "+compressor=identity", "compressor._target_=faultplug.Faulty"]),
], ids=["sweep-fixed", "glob", "sweep-swept", "one-compressor", "one-run", "plugin-class"])
def test_compressor_field_overrides_apply_to_the_compressor_each_cell_selects(argv, want):
    from kvbench.sweep.overrides import per_cell

    assert per_cell(argv) == want


@pytest.mark.parametrize(("argv", "error"), [
    (["-m", "+compressor=kivi,turboquant,kvquant", "compressor.residual=0"],
     "compressor.residual=0 cannot apply to every cell: turboquant, kvquant have no field 'residual' (turboquant's "
     "fields are ['bits', 'entropy_coding', 'norm_bits', 'rotation', 'seed', 'variant']); kivi has it: sweep the "
     "compressors without it in a run of their own"),
    (["+compressor=turboquant", "compressor.residual=0"],
     "compressor.residual=0 cannot apply to this run: turboquant has no field 'residual' (turboquant's fields are "
     "['bits', 'entropy_coding', 'norm_bits', 'rotation', 'seed', 'variant'])"),
], ids=["sweep", "one"])
def test_a_compressor_field_that_cannot_apply_names_the_compressor_without_it(argv, error, capsys, tmp_path,
                                                                              monkeypatch):
    from kvbench.__main__ import main

    monkeypatch.setenv("KVBENCH_RESULTS", str(tmp_path / "results"))
    assert main(["run", *argv]) == 2
    assert capsys.readouterr().err == f"error: {error}\n"
    assert not (tmp_path / "results").exists()  # no sweep folder, no cell


@pytest.mark.integration
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


@pytest.mark.integration
def test_user_errors_exit_2_with_the_allowed_values():
    bad = _kvbench("run", "+compressor=kivi", "compressor.bits=9")
    assert bad.returncode == 2 and "1 <= bits <= 8" in bad.stderr
    none = _kvbench("run")
    assert none.returncode == 2 and "+compressor=NAME" in none.stderr and "kivi" in none.stderr
