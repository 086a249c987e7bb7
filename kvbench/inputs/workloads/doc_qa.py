"""``doc_qa``: many questions about the same long document, as in retrieval-augmented serving."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbench.inputs.workloads.base import Session, Workload, WorkloadBuilder
from kvbench.inputs.workloads.text import QUESTION_TEMPLATES, cat, chat_tokens, encode, keywords


@dataclass
class DocQA(WorkloadBuilder):
    """``n_sessions`` chat prompts over ``n_docs`` documents of the run's text (each cut to its first
    ``doc_tokens`` tokens): the user message is an instruction, the document, then one question. Questions are
    templates filled with the document's most frequent content words, so each is about that document.
    Sessions cycle through the documents; the shared prefix is the template, instruction and document."""

    n_sessions: int = 24
    n_docs: int = 1
    doc_tokens: int = 320

    name = "doc_qa"

    def __post_init__(self) -> None:
        self._check(n_sessions=(1, 1 << 20), n_docs=(1, 1 << 16), doc_tokens=(1, 1 << 20))

    def build(self, tokenizer: Any, docs: list[str]) -> Workload:
        rng = np.random.default_rng(self.seed)
        per_doc = -(-self.n_sessions // self.n_docs)
        chosen: list[tuple[np.ndarray, list[str]]] = []
        for i in rng.permutation(len(docs)):
            ids = encode(tokenizer, docs[i])
            # the questions are about the part of the document that is in the prompt
            words = keywords(docs[i][: self.doc_tokens * 6], -(-per_doc // len(QUESTION_TEMPLATES)))
            if ids.size >= self.doc_tokens and len(words) * len(QUESTION_TEMPLATES) >= per_doc:
                chosen.append((ids[: self.doc_tokens], words))
            if len(chosen) == self.n_docs:
                break
        else:
            raise ValueError(f"doc_qa: the text has only {len(chosen)} documents of {self.doc_tokens}+ tokens with "
                             f"words for {per_doc} questions; lower doc_qa.n_docs, doc_tokens or n_sessions")
        head = encode(tokenizer, "Answer the question about the address below.\n\n")
        sessions = []
        for i in range(self.n_sessions):
            d, j = i % self.n_docs, i // self.n_docs
            doc, words = chosen[d]
            q = QUESTION_TEMPLATES[j % len(QUESTION_TEMPLATES)].format(w=words[j // len(QUESTION_TEMPLATES)])
            user = cat([head, doc, encode(tokenizer, f"\n\nQuestion: {q}")])
            sessions.append(Session(chat_tokens(tokenizer, [("user", user)]), self.name, f"doc{d}"))
        return Workload(self.name, sessions, self.describe())
