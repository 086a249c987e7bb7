"""``shared_system``: chat sessions that share one system prompt and differ in the user message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbench.inputs.workloads.base import Session, Workload, WorkloadBuilder
from kvbench.inputs.workloads.text import SYSTEM_PROMPT, USER_ASKS, cat, chat_tokens, encode, first_tokens, passages


@dataclass
class SharedSystem(WorkloadBuilder):
    """``n_sessions`` prompts rendered with the model's chat template: the same system prompt (its first
    ``system_tokens`` tokens), then a user message of a request line and a ``user_tokens``-token passage of the
    run's text. The prefix shared is the template, the system prompt and, for equal request lines, that line."""

    n_sessions: int = 24
    system_tokens: int = 192
    user_tokens: int = 96

    name = "shared_system"

    def __post_init__(self) -> None:
        self._check(n_sessions=(1, 1 << 20), system_tokens=(1, 1 << 20), user_tokens=(1, 1 << 20))

    def build(self, tokenizer: Any, docs: list[str]) -> Workload:
        system = first_tokens(tokenizer, SYSTEM_PROMPT, self.system_tokens, "shared_system.system_tokens: the system prompt")
        sessions = []
        for i, text in enumerate(passages(docs, tokenizer, self.n_sessions, self.user_tokens, self.seed)):
            ask = encode(tokenizer, USER_ASKS[i % len(USER_ASKS)] + "\n\n")
            toks = chat_tokens(tokenizer, [("system", system), ("user", cat([ask, text]))])
            sessions.append(Session(toks, self.name, "system"))
        return Workload(self.name, sessions, self.describe())
