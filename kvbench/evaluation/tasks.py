"""The offline task definitions: lm-eval task configs (YAML shipped in ``task_defs/``) bound to local data files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvbench.assets import BIGBENCH_TASKS
from kvbench.evaluation import data

TASK_DEFS = Path(__file__).resolve().parent / "task_defs"
TASKS = (*BIGBENCH_TASKS, "passkey", "sotu_lastword")


def task_config(template: str, name: str, path: Path) -> dict[str, Any]:
    """The shipped YAML ``template`` as an lm-eval task config named ``name``, reading its test split from ``path``."""
    spec = yaml.safe_load((TASK_DEFS / f"{template}.yaml").read_text())
    return {"task": name, **spec, "dataset_kwargs": {"data_files": {"test": str(path)}}}


def passkey_name(length: int) -> str:
    return f"passkey_{length // 1024}k" if length % 1024 == 0 else f"passkey_{length}"


def task_specs(names: list[str], cfg: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """lm-eval task configs (dicts) for the task names in ``names``; builds the data files on first use."""
    unknown = sorted(set(names) - set(TASKS))
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; available: {list(TASKS)}")
    if not names:
        raise ValueError(f"no tasks chosen; set tasks=[...] with names from {list(TASKS)}")
    specs = []
    for name in names:
        if name in BIGBENCH_TASKS:
            specs.append(task_config("bigbench", name, data.bigbench_data(name, int(cfg.bigbench.pool), int(cfg.seed))))
        elif name == "passkey":
            pk = cfg.passkey
            for length in pk.lengths:
                path = data.passkey_data(tokenizer, int(length), [float(d) for d in pk.depths], int(pk.per_depth), int(cfg.seed))
                spec = task_config("passkey", passkey_name(int(length)), path)
                spec["generation_kwargs"] = {**spec["generation_kwargs"], "max_gen_toks": int(pk.max_gen_toks)}
                specs.append(spec)
        else:
            lw = cfg.lastword
            specs.append(task_config("sotu_lastword", name, data.lastword_data(tokenizer, int(lw.n), int(lw.context_tokens), int(cfg.seed))))
    return specs
