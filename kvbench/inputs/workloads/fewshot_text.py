"""Few-shot tasks cut from the run's text, so that the ``fewshot`` workload needs no download.

An example is a passage of consecutive words of one document, starting at a sentence start where the text has
sentences, and a one-word answer:

* ``next_word``: the passage, cut inside a sentence, and the word that follows it (five letters or more, so
  mostly a content word), as LAMBADA asks (Paperno et al. 2016, "The LAMBADA dataset: Word prediction requiring a
  broad discourse context", arXiv 1606.06031);
* ``fill_blank``: the passage, ending at a sentence end, with one of its lower-case words of five letters or more
  replaced by a blank, and that word (a cloze test).

The examples come out as a BIG-bench JSON task (``description``, ``examples`` of ``input`` and ``target``), so the
workload renders them in the same Q/A format as BIG-bench's own tasks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")
_PUNCT = ".,;:!?\"'()[]-"
_CLOZE = re.compile(r"[a-z]{5,}")
_ANSWER = re.compile(r"[A-Za-z]{5,}")
# a title's full stop (Mr., Dr., St., Jr.) ends no sentence
_ABBREVIATION = re.compile(r"[A-Z][a-z]{0,2}\.")


def sentence_starts(words: list[str]) -> list[int]:
    """Indices of the words that start a sentence: the first, and capitalised words after a sentence end."""
    return [0, *(j + 1 for j, w in enumerate(words[:-1])
                 if SENTENCE_END.search(w) and not _ABBREVIATION.fullmatch(w) and words[j + 1][:1].isupper())]
BLANK = "____"


@dataclass(frozen=True)
class TextTask:
    instruction: str
    blank: bool  # hide a word inside the passage (else ask for the word after it)


TASKS = {
    "next_word": TextTask("Read each passage and answer with the single word that comes next in the text.", False),
    "fill_blank": TextTask(f"In each passage one word has been replaced by {BLANK}. Answer with the missing word.", True),
}


def _example(task: TextTask, passage: list[str], after: str, rng: np.random.Generator) -> dict | None:
    """One example from a passage and the word after it, or None where the passage has no answer of the form."""
    if task.blank:
        ends = [j + 1 for j, w in enumerate(passage) if SENTENCE_END.search(w)]
        if ends and ends[-1] < len(passage) // 2:  # text without sentence ends keeps the whole passage
            return None
        passage = passage[: ends[-1]] if ends else passage
        spots = [j for j, w in enumerate(passage) if _CLOZE.fullmatch(w.strip(_PUNCT))]
        if not spots:
            return None
        j = spots[int(rng.integers(len(spots)))]
        word = passage[j].strip(_PUNCT)
        shown = passage[:j] + [passage[j].replace(word, BLANK, 1)] + passage[j + 1 :]
        return {"input": " ".join(shown), "target": word}
    word = after.strip(_PUNCT)
    # a passage that ends a sentence leaves the next word open; LAMBADA's passages stop inside one
    if SENTENCE_END.search(passage[-1]) or not _ANSWER.fullmatch(word):
        return None
    return {"input": " ".join(passage), "target": word}


def text_task(name: str, docs: list[str], n: int, passage_words: int, rng: np.random.Generator) -> dict:
    """``n`` seeded examples of the built-in task ``name`` as a BIG-bench JSON task. Passages are drawn
    ``passage_words`` / 2 to 3/2 ``passage_words`` words long (``fill_blank`` cuts them back to their last sentence
    end), at most ``ceil(n / len(docs))`` from a document, so that the examples cover many documents."""
    if name not in TASKS:
        raise ValueError(f"fewshot.tasks: {name!r} is not a built-in task; choose from {sorted(TASKS)} "
                         "(or source=bigbench with a task_dir)")
    task = TASKS[name]
    lo, hi = max(1, passage_words // 2), passage_words + passage_words // 2
    per_doc = -(-n // max(len(docs), 1))
    out: list[dict] = []
    for d in rng.permutation(len(docs)):
        words = docs[int(d)].split()
        starts = sentence_starts(words)
        # text without sentences (a word list, code) starts passages anywhere
        starts = np.array(starts if len(starts) > 1 else range(len(words)), dtype=np.int64)
        taken: set[int] = set()
        for _ in range(4 * per_doc):  # some draws have no answer of the task's form
            if len(taken) == per_doc or len(out) == n:
                break
            length = int(rng.integers(lo, hi + 1))
            fits = starts[starts + length < len(words)]
            if fits.size == 0:
                break
            s = int(rng.choice(fits))
            ex = None if s in taken else _example(task, words[s : s + length], words[s + length], rng)
            if ex is not None:
                taken.add(s)
                out.append(ex)
        if len(out) == n:
            return {"name": name, "description": task.instruction, "examples": out}
    raise ValueError(f"fewshot: the text yields only {len(out)} {name} examples of {lo}+ words; need {n} (k_shot plus "
                     "the questions per task): use fewer sessions, a smaller k_shot or passage_words, or a larger text")
