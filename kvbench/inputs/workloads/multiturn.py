"""``multiturn``: conversations whose turn-t prompt contains every earlier turn."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbench.inputs.workloads.base import Session, Workload, WorkloadBuilder
from kvbench.inputs.workloads.text import FOLLOW_UPS, USER_ASKS, cat, chat_tokens, encode, passages


@dataclass
class MultiTurn(WorkloadBuilder):
    """``n_conversations`` chats of ``n_turns`` turns, one session per turn: turn t's prompt is the chat
    template over user and assistant messages 1..t-1 and user message t. Messages are consecutive stretches of
    one passage of the run's text (``user_tokens`` per user message after a short request line,
    ``reply_tokens`` per assistant reply), standing in for a conversation about that text. Sessions arrive
    turn by turn across conversations, as concurrent chats do."""

    n_conversations: int = 6
    n_turns: int = 4
    user_tokens: int = 48
    reply_tokens: int = 64

    name = "multiturn"

    def __post_init__(self) -> None:
        self._check(n_conversations=(1, 1 << 20), n_turns=(1, 1 << 10), user_tokens=(1, 1 << 20),
                    reply_tokens=(1, 1 << 20))

    @property
    def n_sessions(self) -> int:
        return self.n_conversations * self.n_turns

    def build(self, tokenizer: Any, docs: list[str]) -> Workload:
        u, r = self.user_tokens, self.reply_tokens
        stretches = passages(docs, tokenizer, self.n_conversations, self.n_turns * (u + r), self.seed)
        convs = []
        for c, text in enumerate(stretches):
            msgs = []
            for t in range(self.n_turns):
                at = t * (u + r)
                ask = USER_ASKS[c % len(USER_ASKS)] if t == 0 else FOLLOW_UPS[(c + t) % len(FOLLOW_UPS)]
                msgs.append(("user", cat([encode(tokenizer, ask + "\n\n"), text[at : at + u]])))
                msgs.append(("assistant", text[at + u : at + u + r]))
            convs.append(msgs)
        sessions = [
            Session(chat_tokens(tokenizer, convs[c][: 2 * t + 1]), self.name, f"conv{c}")
            for t in range(self.n_turns)
            for c in range(self.n_conversations)
        ]
        return Workload(self.name, sessions, {**self.describe(), "n_sessions": self.n_sessions})
