"""``fewshot``: BIG-bench few-shot prompts — a shared instruction and k exemplars, then a different question."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.inputs.workloads.base import Session, Workload, WorkloadBuilder
from kvbench.inputs.workloads.text import cat, encode

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
    """``n_sessions`` few-shot prompts spread over BIG-bench ``tasks``: each task's prompts share its
    instruction (``task_prefix``, else its description) and its first ``k_shot`` examples with answers; every
    prompt then asks a different later example of the task. ``task_dir`` holds ``TASK/task.json`` files; null
    takes the tasks from the ``bigbench`` sdist (``kvbench.inputs.assets.ensure_bigbench``). No chat template: this is
    the base-model few-shot format of BIG-bench."""

    n_sessions: int = 24
    tasks: list = field(default_factory=lambda: ["goal_inference", "step_inference"])
    k_shot: int = 3
    task_dir: str | None = None

    name = "fewshot"

    def __post_init__(self) -> None:
        self._check(n_sessions=(1, 1 << 20), k_shot=(0, 1 << 10))
        self.tasks = [self.tasks] if isinstance(self.tasks, str) else list(self.tasks)
        if not self.tasks:
            raise ValueError("fewshot.tasks is empty; name at least one BIG-bench task")

    def _root(self) -> Path:
        if self.task_dir:
            return Path(str(self.task_dir)).expanduser()
        from kvbench.inputs.assets import ensure_bigbench

        return ensure_bigbench()

    def build(self, tokenizer: Any, docs: list[str]) -> Workload:
        root = self._root()
        per_task = -(-self.n_sessions // len(self.tasks))
        shared, questions = [], []
        for name in self.tasks:
            path = root / name / "task.json"
            if not path.exists():
                have = sorted(p.parent.name for p in root.glob("*/task.json"))
                raise ValueError(f"fewshot.tasks: no task {name!r} under {root}; available: {have}")
            task = load_task(path)
            exs = task["examples"]
            if len(exs) < self.k_shot + per_task:
                raise ValueError(f"fewshot: task {name} has {len(exs)} examples; k_shot={self.k_shot} plus "
                                 f"{per_task} questions need {self.k_shot + per_task}")
            head = task.get("task_prefix") or task.get("description", "")
            shots = "".join(render(task, ex, True) + "\n" for ex in exs[: self.k_shot])
            shared.append(cat([encode(tokenizer, head + "\n"), encode(tokenizer, shots)]))
            questions.append([encode(tokenizer, render(task, ex, False)) for ex in exs[self.k_shot : self.k_shot + per_task]])
        sessions = []
        for i in range(self.n_sessions):
            t, j = i % len(self.tasks), i // len(self.tasks)
            sessions.append(Session(cat([shared[t], questions[t][j]]), self.name, self.tasks[t]))
        return Workload(self.name, sessions, self.describe())
