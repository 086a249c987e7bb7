"""``fewshot``: few-shot prompts — a shared instruction and k exemplars with answers, then a different question.

The tasks come from the run's text by default (:mod:`kvbench.inputs.workloads.fewshot_text`: nothing to download)
or, with ``source=bigbench``, from a local copy of BIG-bench's task files: the package registry no longer serves
the ``bigbench`` 1.0.0 sdist they shipped in.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.inputs.workloads.base import Session, Workload, WorkloadBuilder
from kvbench.inputs.workloads.fewshot_text import TASKS, text_task
from kvbench.inputs.workloads.text import cat, encode

#: where the tasks come from, and each source's tasks when ``tasks`` is null
DEFAULT_TASKS = {"text": ["next_word", "fill_blank"], "bigbench": ["goal_inference", "step_inference"]}

# BIG-bench's own defaults for JSON tasks (bigbench/api/json_task.py)
_INPUT_PREFIX, _OUTPUT_PREFIX, _CHOICE_PREFIX = "\nQ: ", "\nA: ", "\n  choice: "


def load_task(path: Path) -> dict:
    task = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(task.get("examples"), list) or not task["examples"]:
        raise ValueError(f"{path} is not a BIG-bench JSON task (no 'examples' list)")
    return task


def _answer(ex: dict) -> str:
    if "target_scores" in ex:
        return max(ex["target_scores"].items(), key=lambda kv: kv[1])[0]
    t = ex.get("target", "")
    return t[0] if isinstance(t, list) else str(t)


def render(task: dict, ex: dict, with_answer: bool) -> str:
    """One example in BIG-bench's prompt format: input prefix, input, choices, output prefix[, answer]."""
    text = task.get("example_input_prefix", _INPUT_PREFIX) + ex["input"]
    if "target_scores" in ex and task.get("append_choices_to_input", True):
        text += "".join(task.get("choice_prefix", _CHOICE_PREFIX) + c for c in ex["target_scores"])
    out = task.get("example_output_prefix", _OUTPUT_PREFIX)
    return text + (out + _answer(ex) if with_answer else out.rstrip(" "))


@dataclass
class FewShot(WorkloadBuilder):
    """``n_sessions`` few-shot prompts spread over ``tasks``: each task's prompts share its instruction (BIG-bench's
    ``task_prefix``, else its description) and its first ``k_shot`` examples with answers; every prompt then asks a
    different later example of the task. No chat template: the base-model few-shot format of BIG-bench.

    ``source=text`` (the default) cuts the examples from the run's text with a seed (built-in tasks ``next_word``
    and ``fill_blank``, passages of about ``passage_words`` words); ``source=bigbench`` reads BIG-bench JSON tasks
    from ``task_dir`` (``TASK/task.json``), which it needs: the registry no longer serves the sdist they came in.
    ``tasks`` null takes the source's defaults (:data:`DEFAULT_TASKS`)."""

    n_sessions: int = 24
    source: str = "text"
    tasks: list | None = None
    k_shot: int = 3
    passage_words: int = 48
    task_dir: str | None = None

    name = "fewshot"

    def __post_init__(self) -> None:
        self._check(n_sessions=(1, 1 << 20), k_shot=(0, 1 << 10), passage_words=(2, 1 << 16))
        if self.source not in DEFAULT_TASKS:
            raise ValueError(f"fewshot.source={self.source!r} is not a source; choose from {list(DEFAULT_TASKS)}")
        tasks = DEFAULT_TASKS[self.source] if self.tasks is None else self.tasks
        self.tasks = [tasks] if isinstance(tasks, str) else list(tasks)
        if not self.tasks:
            raise ValueError("fewshot.tasks is empty; name at least one task (or null for the source's defaults)")
        if self.source == "text":
            if self.task_dir:
                raise ValueError("fewshot.task_dir is read only with source=bigbench; set source=bigbench or drop "
                                 "task_dir")
            unknown = [t for t in self.tasks if t not in TASKS]
            if unknown:
                raise ValueError(f"fewshot.tasks: {unknown} are not built-in tasks; choose from {sorted(TASKS)} "
                                 "(or source=bigbench with a task_dir)")
        elif not self.task_dir:
            raise ValueError("fewshot.source=bigbench needs task_dir=DIR, a local copy of BIG-bench's task files "
                             "(DIR/TASK/task.json, as in bigbench/benchmark_tasks of the BIG-bench repository): the "
                             "package registry no longer serves the bigbench 1.0.0 sdist (only 0.0.1); set "
                             "workload.task_dir=DIR (under mixed: family_params.fewshot.task_dir)")

    def _task(self, name: str, n: int, docs: list[str]) -> dict:
        """Task ``name`` as a BIG-bench JSON task with at least ``n`` examples."""
        if self.source == "text":
            rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
            return text_task(name, docs, n, self.passage_words, rng)
        root = Path(str(self.task_dir)).expanduser()
        path = root / name / "task.json"
        if not path.exists():
            have = sorted(p.parent.name for p in root.glob("*/task.json"))
            raise ValueError(f"fewshot.tasks: no task {name!r} under {root}; available: {have}")
        task = load_task(path)
        if len(task["examples"]) < n:
            raise ValueError(f"fewshot: task {name} has {len(task['examples'])} examples; k_shot={self.k_shot} plus "
                             f"{n - self.k_shot} questions need {n}")
        return task

    def build(self, tokenizer: Any, docs: list[str]) -> Workload:
        per_task = -(-self.n_sessions // len(self.tasks))
        shared, questions = [], []
        for name in self.tasks:
            task = self._task(name, self.k_shot + per_task, docs)
            exs = task["examples"]
            head = task.get("task_prefix") or task.get("description", "")
            shots = "".join(render(task, ex, True) + "\n" for ex in exs[: self.k_shot])
            shared.append(cat([encode(tokenizer, head + "\n"), encode(tokenizer, shots)]))
            questions.append([encode(tokenizer, render(task, ex, False)) for ex in exs[self.k_shot : self.k_shot + per_task]])
        sessions = []
        for i in range(self.n_sessions):
            t, j = i % len(self.tasks), i // len(self.tasks)
            sessions.append(Session(cat([shared[t], questions[t][j]]), self.name, self.tasks[t]))
        return Workload(self.name, sessions, self.describe())
