"""Token pieces for workload prompts: passages of the run's text, chat-template rendering that keeps shared
parts token-identical, and the fixed instruction texts.

Prompts are assembled from separately tokenized pieces (template text, system prompt, passages). Tokenizing
the whole prompt string instead could merge tokens across a piece boundary differently in two sessions, so that
a prefix shared in text would not be shared in tokens; serving systems with prompt caching segment prompts the
same way (template and message boundaries).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import numpy as np

from kvbench.inputs.assets import AssetError

# A system prompt of the kind chat services prepend to every conversation.
SYSTEM_PROMPT = (
    "You are a careful, knowledgeable assistant that helps people read, understand and discuss historical "
    "documents, speeches and public records. Follow these guidelines in every answer. First, read the whole "
    "passage the user gives you before you reply, and base your answer on what the passage actually says; when "
    "the passage does not contain the answer, say so plainly instead of guessing. Second, be concise: prefer a "
    "short paragraph or a few bullet points, and quote the passage only when the exact wording matters. Third, "
    "explain the historical context when it helps the reader, naming the period, the office and the people "
    "involved, but keep your own opinions out of it and present contested questions from more than one side. "
    "Fourth, when the user asks for a summary, state the main claim first, then the evidence and the proposals, "
    "in the order the speaker gives them. Fifth, when numbers appear, repeat them exactly as written and do not "
    "compute new figures unless the user asks you to, in which case show each step. Sixth, if the user's request "
    "is ambiguous, answer the most likely reading and mention the other one in a single sentence. Finally, "
    "write in clear, plain English, avoid jargon, and never invent sources, dates or quotations."
)

USER_ASKS = (
    "Summarize the passage below in three sentences.",
    "What is the main argument of the passage below?",
    "Which policies does the speaker propose in the passage below?",
    "Explain the historical context of the passage below.",
    "List the key facts and figures in the passage below.",
    "What problem does the speaker describe in the passage below, and what solution is offered?",
)

QUESTION_TEMPLATES = (
    "What does the address say about {w}?",
    "How does the speaker describe {w}?",
    "Why does the speaker mention {w}?",
    "Summarize the part of the address about {w}.",
    "What action on {w} does the speaker ask Congress to take?",
)

FOLLOW_UPS = (
    "Here is the next part of the speech.",
    "Please continue with this passage.",
    "Now read this section and tell me what changes.",
    "And what about this part?",
)

_STOP = set(
    "about above after again against their there these those which would could should shall being other every "
    "under while where whose within without great state states united government congress people public year "
    "years country nation national upon made make have with from that this will been were they them more than "
    "into such also only most must what when your very some much".split()
)


def encode(tokenizer: Any, text: str) -> np.ndarray:
    """Token ids of ``text`` without special tokens added, as int64."""
    return np.asarray(tokenizer(text, add_special_tokens=False).input_ids, dtype=np.int64)


def cat(pieces: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces]) if pieces else np.zeros(0, np.int64)


def first_tokens(tokenizer: Any, text: str, n: int, what: str) -> np.ndarray:
    ids = encode(tokenizer, text)
    if ids.size < n:
        raise ValueError(f"{what} holds only {ids.size} tokens; ask for at most that many")
    return ids[:n]


def passages(docs: list[str], tokenizer: Any, n: int, length: int, seed: int) -> list[np.ndarray]:
    """``n`` non-overlapping passages of ``length`` tokens from seeded documents at seeded offsets."""
    if n == 0:
        return []
    rng = np.random.default_rng(seed)
    per_doc = max(1, -(-n // max(len(docs), 1)))
    out: list[np.ndarray] = []
    for i in rng.permutation(len(docs)):
        ids = encode(tokenizer, docs[i])
        slots = ids.size // length
        if slots == 0:
            continue
        take = min(per_doc, slots, n - len(out))
        for s in sorted(rng.choice(slots, size=take, replace=False)):
            out.append(ids[int(s) * length : (int(s) + 1) * length])
        if len(out) == n:
            return out
    raise AssetError(f"the text holds only {len(out)} passages of {length} tokens; need {n}: use fewer sessions, "
                     "shorter passages or a larger text")


def keywords(text: str, n: int) -> list[str]:
    """The ``n`` most frequent content words of a document (lower case, 5+ letters, not stop words)."""
    words = [w for w in re.findall(r"[a-z]{5,}", text.lower()) if w not in _STOP]
    return [w for w, _ in Counter(words).most_common(n)]


def chat_tokens(tokenizer: Any, messages: list[tuple[str, Any]], add_generation_prompt: bool = True) -> np.ndarray:
    """Token ids of ``messages`` (role, text or token ids) rendered with the tokenizer's chat template.

    The template is rendered once with placeholder contents and cut at the placeholders: template text and
    contents are tokenized separately, so a conversation's prompt is a token prefix of its next turn's.
    Tokenizers without a chat template (base models) get ``role: content`` lines.
    """
    contents = [encode(tokenizer, c) if isinstance(c, str) else np.asarray(c, dtype=np.int64) for _, c in messages]
    if not getattr(tokenizer, "chat_template", None):
        pieces: list[np.ndarray] = []
        for (role, _), ids in zip(messages, contents):
            pieces += [encode(tokenizer, f"{role}: "), ids, encode(tokenizer, "\n")]
        if add_generation_prompt:
            pieces.append(encode(tokenizer, "assistant: "))
        return cat(pieces)
    marks = [f"\u2063KVBENCH{i}\u2063" for i in range(len(messages))]
    text = tokenizer.apply_chat_template([{"role": r, "content": m} for (r, _), m in zip(messages, marks)],
                                         tokenize=False, add_generation_prompt=add_generation_prompt)
    pieces, rest = [], text
    for mark, ids in zip(marks, contents):
        before, found, rest = rest.partition(mark)
        if not found:
            raise ValueError("the chat template does not render message contents verbatim; cannot build workloads with it")
        pieces += [encode(tokenizer, before), ids]
    pieces.append(encode(tokenizer, rest))
    return cat(pieces)
