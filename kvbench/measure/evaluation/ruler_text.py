"""Building blocks of the RULER-style prompts (:mod:`kvbench.measure.evaluation.ruler`): a prompt's parts and the
template that lays them out, fitting a prompt to a length in tokens, haystacks, needles and their keys and values."""

from __future__ import annotations

import re
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Protocol

import numpy as np

from kvbench.measure.evaluation import task_data as data

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = np.linspace(0.0, 1.0, 40)  # RULER draws needle depths from 40 evenly spaced ones

# keys and word values are adjective-noun pairs, as RULER's (its lists come from the wonderwords package)
ADJECTIVES = tuple("""
able ancient angry bitter brave bright broad calm careful cheap clever cold cool curious damp dark deep eager
early empty fair fancy fierce flat fresh gentle giant glad golden grand green happy heavy hollow honest huge
humble jolly keen kind large lazy light little lively loud lucky mighty modern narrow neat noble odd old plain
polite proud quick quiet rapid rare rich rough round royal rusty sharp shiny short silent silly simple sleepy
slow smooth soft solid sour spicy steep strange strong sweet swift tall tame tender thick tidy tiny tough
vast warm wet wide wild wise young""".split())
NOUNS = tuple("""
anchor apple arrow badge basket beach bell berry blanket boat bottle bread breeze bridge brush bucket button
cabin camera candle canyon carpet castle cherry circle cloud clover coast comet copper cotton crayon crown
desert diamond dragon drum eagle engine falcon feather fence forest fountain garden glove harbor hammer helmet
island jacket kettle kitten ladder lantern lemon marble meadow mirror monkey needle ocean orchard otter paddle
parrot pebble pencil pepper pillow planet pocket puzzle rabbit ribbon river rocket saddle shadow shell silver
spoon squirrel statue stone summer tiger timber tower tulip turtle valley violin wagon walnut window winter""".split())
SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")
WORD = re.compile(r"\b[a-z]{4,12}\b")
COMMON = 20  # a CWE word occurs at least this often in the State of the Union text: plain English, not names


Count = Callable[[str], int]


@dataclass(frozen=True)
class Parts:
    """A prompt in three parts: what is compressed, and the two parts asked after it."""

    context: str  # instructions, worked example and haystack
    question: str
    answer_prefix: str  # the answer's start, already written: the model continues it


#: ``(context, query)`` texts of a prompt's parts, the query being the question and the answer prefix
Wrap = Callable[[Parts], "tuple[str, str]"]


def plain(parts: Parts) -> tuple[str, str]:
    """The parts as they are (a base model's prompt)."""
    return parts.context, parts.question + parts.answer_prefix


def chat(tokenizer: Any) -> Wrap:
    """The parts in one user turn of the tokenizer's chat template, the answer prefix after the assistant's
    opening: the template's head joins the context, its tail the query (RULER wraps its tasks the same way)."""
    mark = "\u2063KVBENCH\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False, add_generation_prompt=True)
    head, found, tail = text.partition(mark)
    if not found:
        raise ValueError("the chat template does not render a message's content verbatim; set ruler.chat_template=false")
    return lambda parts: (head + parts.context, parts.question + tail + parts.answer_prefix.lstrip())


@dataclass(frozen=True)
class Fit:
    """How prompts are laid out and measured: the template that wraps the parts, and the tokenizer's count."""

    count: Count
    wrap: Wrap = plain


def solved(parts: Parts, answer: str) -> str:
    """A worked example: the whole prompt answered, as the text that opens a task's context."""
    return parts.context + parts.question + parts.answer_prefix + " " + answer + "\n\n"


def after(shot: str, parts: Parts) -> Parts:
    return Parts(shot + parts.context, parts.question, parts.answer_prefix)


@dataclass(frozen=True)
class Example:
    context: str  # compressed under the context-only protocol
    query: str  # the question and the answer prefix, fed on top of the context uncompressed
    answers: list[str]
    extra: dict  # what to record besides (needle depths, the keys or value asked)


class Maker(Protocol):
    """What builds one family's examples."""

    #: the end of the task's instructions, after which its haystack starts (worked examples come before it)
    opens: ClassVar[str]

    def example(self, rng: np.random.Generator, target: int, fit: Fit, name: str, src: Sources) -> Example: ...

    def value(self, rng: np.random.Generator) -> str | None:
        """A random value of the answers' form, or None where the haystack's words are their form."""


def fit_prompt(render_n: Callable[[int], Parts], fit: Fit, target: int, upper: int, what: str) -> tuple[str, str, int]:
    """The prompt ``render_n(n)`` with the largest ``n <= upper`` that fits in ``target`` tokens, as ``(context,
    query, length)``.

    Token counts grow with ``n`` (one more haystack word or list entry), so a bisection finds it.
    """
    def measure(n: int) -> tuple[str, str, int]:
        ctx, query = fit.wrap(render_n(n))
        return ctx, query, fit.count(ctx + query)

    lo_best = measure(0)
    if lo_best[2] > target:
        raise ValueError(f"{what}: the instructions, worked example and needles alone take {lo_best[2]} tokens, more "
                         f"than the {target}-token length asked for; choose a ruler.lengths entry above {lo_best[2]}")
    if measure(upper)[2] <= target:
        raise ValueError(f"{what}: {upper} units of filler do not reach {target} tokens; the filler text is too short "
                         f"for this length")
    lo, hi = 0, upper  # measure(lo) <= target < measure(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = measure(mid)
        if got[2] <= target:
            lo, lo_best = mid, got
        else:
            hi = mid
    return lo_best


def insert(words: list[str], needles: Sequence[str], depths: Sequence[float]) -> str:
    """``words`` joined by spaces with each needle placed at the sentence boundary nearest its depth (0 = first)."""
    ends = np.array([0, *(i + 1 for i, w in enumerate(words) if SENTENCE_END.search(w))], dtype=np.int64)
    if ends[-1] != len(words):
        ends = np.append(ends, len(words))
    want = np.asarray(depths, dtype=float) * len(words)
    at = ends[np.abs(ends[None, :] - want[:, None]).argmin(axis=1)]  # (needles,)
    parts: list[str] = []
    start = 0
    for pos, needle in sorted(zip(at.tolist(), needles), key=lambda p: p[0]):
        parts += words[start:pos]
        parts.append(needle)
        start = pos
    parts += words[start:]
    return " ".join(parts)


def noise_words(n: int) -> list[str]:
    unit = NOISE.split()
    return (unit * (n // len(unit) + 1))[:n]


class Sources:
    """The State of the Union text behind the essay haystack and the CWE word pool, read once per data file."""

    @cached_property
    def essays(self) -> list[str]:
        return data.sotu_texts()

    @cached_property
    def vocabulary(self) -> list[str]:
        """Lower-case words of 4-12 letters seen at least ``COMMON`` times, sorted."""
        seen = Counter(w for doc in self.essays for w in WORD.findall(doc.lower()))
        return sorted(w for w, c in seen.items() if c >= COMMON)


def essay_words(docs: list[str], n: int, rng: np.random.Generator) -> list[str]:
    """``n`` consecutive words of State of the Union text from a sentence start in a random address."""
    i = int(rng.integers(len(docs)))
    words = docs[i].split()
    starts = [0, *(j + 1 for j, w in enumerate(words[:-1]) if SENTENCE_END.search(w))]
    words = words[starts[int(rng.integers(len(starts)))]:]
    for j in range(1, len(docs) + 1):  # on into the following addresses, wrapping round at most once
        if len(words) >= n:
            break
        words += docs[(i + j) % len(docs)].split()
    return words[:n]


def draw_key(rng: np.random.Generator, taken: set[str]) -> str:
    while True:
        k = f"{ADJECTIVES[rng.integers(len(ADJECTIVES))]}-{NOUNS[rng.integers(len(NOUNS))]}"
        if k not in taken:
            taken.add(k)
            return k


def draw_value(kind: str, rng: np.random.Generator, taken: set[str]) -> str:
    if kind == "word":
        return draw_key(rng, taken)
    while True:
        v = str(int(rng.integers(10**6, 10**7))) if kind == "number" else str(uuid.UUID(bytes=rng.bytes(16), version=4))
        if v not in taken:
            taken.add(v)
            return v


def join_list(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]
