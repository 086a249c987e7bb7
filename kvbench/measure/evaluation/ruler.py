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
  word 6 times among single ones below 4,096 tokens, 30 times among words seen 3 times from 4,096 on; its worked
  example ten words 3 times among ten single ones). RULER draws the words from wonderwords' nouns, adjectives and
  verbs; here they are the State of the Union's plain words (4-12 letters, seen 20 times or more), so the list is
  as long as the length allows, as in RULER.
* ``fwe``: frequent-words extraction, the three most frequent coded words of a Zipf(2) stream whose top word is
  the noise "...", drawn from RULER's vocabulary of length / 50 six-letter words ("..." included: 20 at 1,024).

Every prompt follows RULER's templates: the NIAH families zero-shot (instructions, haystack, question), VT, CWE and
FWE after one worked example with its answer, and every task with the answer prefix already written, so the model
only has to continue it. With ``chat_template`` (an instruction-tuned model's tokenizer that has one: see
``ruler.chat_template``) the instructions, haystack and question are one user turn of the chat template and the
answer prefix opens the assistant's turn, as RULER wraps its tasks in the model's template. A row holds the prompt
in two parts: ``context`` (template head, instructions, worked example, haystack: what the context-only protocol
compresses) and ``query`` (the question, the template's tail and the answer prefix, fed on top uncompressed).
Lengths are in model tokens, measured with the tokenizer: the prompt (context and query) is the longest one, grown a
haystack word (or a list entry) at a time, that fits the target. Scoring is RULER's ``string_match_all``: the
fraction of expected values found, case-insensitively, in the generation.

Deviations from RULER, besides the haystack text and the CWE word list: the length counts the prompt only (RULER
counts the tokens to generate in it too, so its haystacks are shorter by that budget), and the needles' keys and
word values are adjective-noun pairs from short lists rather than wonderwords' full ones.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from scipy.special import zeta

from kvbench.measure.evaluation import task_data as data
from kvbench.measure.evaluation.ruler_text import (
    DEPTHS,
    NOISE,
    Count,
    Example,
    Fit,
    Maker,
    Parts,
    Sources,
    after,
    chat,
    draw_key,
    draw_value,
    essay_words,
    fit_prompt,
    insert,
    join_list,
    noise_words,
    plain,
    solved,
)

PREFIX = "ruler_"
METRIC = "string_match"  # the per-example score process_results returns; the runner pairs it


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
    opens: ClassVar[str] = "afterwards.\n"

    def value(self, rng: np.random.Generator) -> str:
        return draw_value(self.kind, rng, set())

    def _prompt(self, context: str, query: list[str]) -> Parts:
        many = self.values * self.queries > 1
        noun = f"{self.kind}s" if many else self.kind
        be = "are" if many else "is"
        intro = _NIAH_INTRO.format(some="Some" if many else "A", noun=noun, be=be, it="them" if many else "it")
        return Parts(intro + context, _NIAH_QUESTION.format(what="What are all" if many else "What is", noun=noun, query=join_list(query)),
                     _NIAH_ANSWER.format(noun=noun, query=join_list(query), be=be))

    def _draw(self, rng: np.random.Generator, taken: set[str]) -> tuple[list[str], list[str], list[str]]:
        """Needles (shuffled), the keys asked and their values in asking order; keys and values not in ``taken``."""
        keys = [draw_key(rng, taken) for _ in range(self.keys)]
        values = [[draw_value(self.kind, rng, taken) for _ in range(self.values)] for _ in keys]
        needles = [_NEEDLE.format(kind=self.kind, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
        needles = [needles[i] for i in rng.permutation(len(needles))]
        asked = sorted(rng.choice(self.keys, self.queries, replace=False).tolist())
        return needles, [keys[i] for i in asked], [v for i in asked for v in values[i]]

    def example(self, rng: np.random.Generator, target: int, fit: Fit, name: str, src: Sources) -> Example:
        # zero-shot, as RULER's NIAH: the instructions, the haystack with its needles, the question
        needles, query, answers = self._draw(rng, set())
        depths = rng.choice(DEPTHS, len(needles), replace=False)
        words = noise_words(target) if self.haystack == "noise" else essay_words(src.essays, target, rng)
        ctx, q, n = fit_prompt(lambda k: self._prompt(insert(words[:k], needles, depths), query), fit, target, target, name)
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
    opens: ClassVar[str] = _VT_INTRO

    def value(self, rng: np.random.Generator) -> str:
        return "".join(rng.choice(np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ")), 5))

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

    def example(self, rng: np.random.Generator, target: int, fit: Fit, name: str, src: Sources) -> Example:
        taken: set[str] = set()
        s_steps, s_names, s_value = self._chain(rng, taken)
        shot = solved(self._prompt(insert(noise_words(2 * len(NOISE.split())), s_steps, np.linspace(0.1, 0.9, len(s_steps))),
                                    s_names, s_value), " ".join(s_names))
        steps, names, value = self._chain(rng, taken)
        depths = np.sort(rng.choice(DEPTHS, len(steps), replace=False))  # in order: a variable is bound before it is read
        words = noise_words(target)
        ctx, q, n = fit_prompt(lambda k: after(shot, self._prompt(insert(words[:k], steps, depths), names, value)), fit, target,
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
    opens: ClassVar[str] = _CWE_INTRO

    def value(self, rng: np.random.Generator) -> None:
        return None

    def _list(self, words: Sequence[str], order: np.ndarray) -> str:
        return " ".join(f"{i + 1}. {words[j]}" for i, j in enumerate(order))

    def _prompt(self, listing: str) -> Parts:
        return Parts(_CWE_INTRO + listing, _CWE_QUESTION.format(k=self.common), _CWE_ANSWER.format(k=self.common))

    def example(self, rng: np.random.Generator, target: int, fit: Fit, name: str, src: Sources) -> Example:
        # RULER's frequencies: (common, rare) = (6, 1) below 4,096 tokens, (30, 3) from 4,096 on; example (3, 1)
        f_common, f_rare = (6, 1) if target < 4096 else (30, 3)
        pool = src.vocabulary
        picks = [pool[i] for i in rng.permutation(len(pool))]
        shot_common, shot_rare = picks[: self.common], picks[self.common : self.common + 10]
        shot_words = shot_common * 3 + shot_rare
        shot = solved(self._prompt(self._list(shot_words, rng.permutation(len(shot_words)))),
                       " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_common)))
        common, rare = picks[self.common + 10 : 2 * self.common + 10], picks[2 * self.common + 10 :]
        upper = min(len(rare), target // f_rare)
        if upper < 1:
            raise ValueError(f"{name}: the word pool has too few words ({len(pool)})")
        seed = int(rng.integers(2**32))

        def with_rare(k: int) -> Parts:
            words = common * f_common + rare[:k] * f_rare
            return after(shot, self._prompt(self._list(words, np.random.default_rng(seed).permutation(len(words)))))

        ctx, q, n = fit_prompt(with_rare, fit, target, upper, name)
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
    opens: ClassVar[str] = _FWE_INTRO

    def value(self, rng: np.random.Generator) -> None:
        return None

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

    def example(self, rng: np.random.Generator, target: int, fit: Fit, name: str, src: Sources) -> Example:
        shot_vocab = self._vocab(rng, 8)
        shot = solved(Parts(_FWE_INTRO + self._stream(shot_vocab, 60, int(rng.integers(2**32))), _FWE_QUESTION, _FWE_ANSWER),
                       " ".join(shot_vocab[1 : 1 + self.answers]))
        vocab = self._vocab(rng, max(target // 50, 2 * self.answers + 2))  # RULER's vocabulary size: length / 50
        seed = int(rng.integers(2**32))
        # enough words that the answers' counts differ from each other and from the rest
        ctx, q, n = fit_prompt(lambda k: Parts(shot + _FWE_INTRO + self._stream(vocab, 40 + k, seed), _FWE_QUESTION, _FWE_ANSWER),
                         fit, target, target, name)
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


def ruler_data(tokenizer: Any, family: str, length: int, n: int, seed: int, chat_template: bool = False) -> Path:
    """``n`` examples of ``family`` at ``length`` tokens, written once under ``$KVBENCH_HOME`` and keyed by their
    parameters and the tokenizer (same arguments, same bytes); ``chat_template``: in the tokenizer's chat template
    (:func:`chat`)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown RULER task {family!r}; available: {list(FAMILIES)}")
    if n < 1 or length < 1:
        raise ValueError(f"{family}: need at least one example of a positive length; got n={n}, length={length}")
    params = {"family": family, "length": length, "n": n, "seed": seed, "tok": data.tokenizer_id(tokenizer),
              "chat": bool(chat_template), "v": 3}
    out = data.keyed_path(f"{family}_{length}", params)
    if out.exists():
        return out
    count: Count = lambda s: len(tokenizer(s, add_special_tokens=False).input_ids)
    # one stream per (seed, family, length), so adding a family or a length leaves the others' examples alone
    rng = np.random.default_rng([seed, zlib.crc32(family.encode()), length])
    make, src = FAMILIES[family].make, Sources()
    fit = Fit(count, chat(tokenizer) if chat_template else plain)
    rows = []
    for i in range(n):
        ex = make.example(rng, length, fit, f"{family} at {length} tokens", src)
        rows.append({"context": ex.context, "query": ex.query, "answers": ex.answers, "length": length, "family": family,
                     "chat_template": bool(chat_template), **ex.extra, "id": i})
    return data.write_jsonl(out, rows)
