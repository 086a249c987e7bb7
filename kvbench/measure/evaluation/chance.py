"""Chance for generated tasks: the score of content-free answerers on the same examples.

A generated answer is not right one time in the number of choices; what a model scores without reading the
haystack depends on the task. FWE asks for three of its twenty coded words, so three words picked from the haystack
score about 0.15; a NIAH number is seven random digits, so no guess scores. Two answerers that never read what is
asked, each drawn ``draws`` times per example (seeded):

* ``haystack_words``: as many distinct words as the example has answers, drawn uniformly from the words of its
  haystack (the text after the task's instructions; the worked example and the question are left out). The
  haystack's *most frequent* words are not a content-free answer for CWE and FWE, where they are the answer.
* ``random_value``: as many values of the answer's form as it has answers (a seven-digit number, an adjective-noun
  key, a UUID, a five-letter variable name), where the family's answers have a form of their own.

``chance`` is the better answerer's mean score: a task whose 16-bit accuracy is not clear of it measures nothing.
"""

from __future__ import annotations

import re
import zlib

import numpy as np

from kvbench.measure.evaluation import ruler

_WORDS = re.compile(r"[A-Za-z][A-Za-z'-]*")
DRAWS = 32


def haystack_words(family: str | None, context: str) -> list[str]:
    """The distinct words (lower case, first seen first) of an example's haystack: the context after the last
    opening of the family's instructions (the whole context for an unknown family)."""
    make = ruler.FAMILIES[family].make if family in ruler.FAMILIES else None
    text = context.rsplit(make.opens, 1)[-1] if make is not None else context
    return list(dict.fromkeys(w.lower() for w in _WORDS.findall(text)))


def chance_scores(docs: list[dict], draws: int = DRAWS, seed: int = 0) -> dict[str, float]:
    """Mean ``string_match`` of each content-free answerer over ``docs`` (RULER rows: ``context``, ``answers``,
    ``family`` where known) and ``draws`` draws per example."""
    totals: dict[str, list[float]] = {"haystack_words": [], "random_value": []}
    for doc in docs:
        answers, family = list(doc["answers"]), doc.get("family")
        k = len(answers)
        rng = np.random.default_rng([seed, zlib.crc32(str(doc["context"]).encode())])
        words = haystack_words(family, str(doc["context"]))
        make = ruler.FAMILIES[family].make if family in ruler.FAMILIES else None
        for _ in range(draws):
            if words:
                picks = rng.choice(len(words), min(k, len(words)), replace=False)
                totals["haystack_words"].append(ruler.string_match(" ".join(words[i] for i in picks), answers))
            guess = [make.value(rng) for _ in range(k)] if make is not None else [None]
            if all(g is not None for g in guess):
                totals["random_value"].append(ruler.string_match(" ".join(guess), answers))
    return {name: float(np.mean(v)) for name, v in totals.items() if v}
