"""The default eval needs nothing the package registry does not serve: its tasks are built from the packaged text;
BIG-bench is an opt-in group read from a local copy of its task files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.core.config import compose
from kvbench.inputs.assets import BIGBENCH_TASKS
from kvbench.measure.evaluation import task_data as data
from kvbench.measure.evaluation.tasks import expand
from kvbench.store.paths import repo_root


def readme_eval() -> str:
    """The eval command README.md shows with the default tasks (its first ``python -m kvbench eval`` line that sets
    nothing but the compressor)."""
    for line in (repo_root() / "README.md").read_text().splitlines():
        words = line.split("#")[0].split()
        if words[:4] == ["python", "-m", "kvbench", "eval"] and len(words) == 5 and words[4].startswith("+compressor="):
            return " ".join(words)
    raise AssertionError("README.md shows no plain `python -m kvbench eval +compressor=NAME` command")


def test_the_default_tasks_need_no_download():
    tasks = expand(list(compose([], config_name="eval").tasks))
    assert tasks and not set(tasks) & set(BIGBENCH_TASKS)
    assert readme_eval().startswith("python -m kvbench eval +compressor=")


def test_bigbench_is_an_opt_in_group_read_from_a_local_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    assert expand(["bigbench", "passkey", "implicatures"]) == [*BIGBENCH_TASKS, "passkey"]
    with pytest.raises(data.TaskDataError, match=r"BIG-bench task 'vitaminc' is not available: the package registry "
                                                 r"no longer serves .*put its task.json at "
                                                 r".*data/bigbench/vitaminc/task.json .*vitaminc_fact_verification"):
        data.bigbench_data("vitaminc", 10, 0)
    local = tmp_path / "data" / "bigbench" / "vitaminc" / "task.json"
    local.parent.mkdir(parents=True)
    examples = [{"input": f"Claim {i}.", "target_scores": {"True": int(i % 2 == 0), "False": int(i % 2 == 1)}}
                for i in range(5)]
    local.write_text(json.dumps({"examples": examples}))
    rows = [json.loads(line) for line in data.bigbench_data("vitaminc", 3, 0).read_text().splitlines()]
    assert len(rows) == 3 and all(r["choices"] == ["True", "False"] for r in rows)


def _assets_home() -> Path:
    return Path(os.environ.get("KVBENCH_HOME", Path.home() / ".cache" / "kvbench")).expanduser()


@pytest.mark.integration
@pytest.mark.parametrize("command", [readme_eval(), "python -m kvbench eval +compressor=identity"])
def test_the_readme_eval_runs_on_a_fresh_home_without_downloading(command, tmp_path):
    """``make assets`` then the README's eval command, on an empty KVBENCH_HOME: the packaged model and text are
    linked in from the installed assets (or installed by the project's own installer), and every other download
    route (pip, npm, the model hub) is closed."""
    home = tmp_path / "home"
    src = _assets_home()
    env = {**os.environ, "KVBENCH_HOME": str(home), "KVBENCH_RESULTS": str(tmp_path / "results"),
           "PIP_NO_INDEX": "1", "npm_config_offline": "true", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    for part in ("models/smollm2_135m", "data/sotu"):
        if (src / part / "kvbench_asset.json").exists():
            (home / part).parent.mkdir(parents=True, exist_ok=True)
            (home / part).symlink_to(src / part, target_is_directory=True)
    if not (home / "models" / "smollm2_135m").exists() or not (home / "data" / "sotu").exists():
        env_assets = {k: v for k, v in env.items() if k not in ("PIP_NO_INDEX", "npm_config_offline")}
        subprocess.run([sys.executable, "-m", "kvbench", "assets", "--model", "smollm2_135m", "--data", "sotu"],
                       env=env_assets, check=True, cwd=repo_root())
    argv = command.split()
    proc = subprocess.run([sys.executable, *argv[1:]], env=env, cwd=repo_root(), capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (summary_path,) = (tmp_path / "results").rglob("eval.json")
    s = json.loads(summary_path.read_text())
    assert s["compressor"] == argv[-1].removeprefix("+compressor=") and s["n_examples"] > 0
    assert not any(t in BIGBENCH_TASKS for t in s["tasks"]) and all(t.startswith("ruler_") for t in s["tasks"])
    if s["compressor"] == "identity":  # the 16-bit path through the compressed cache answers as the baseline does
        assert all(t["diff"] == 0 for t in s["tasks"].values())
    assert not (home / "data" / "bigbench").exists()
