"""Task data as JSONL files for lm-eval's offline ``json`` loader, built once from the packaged assets.

* BIG-bench (``goal_inference``, ``step_inference``, ``implicatures``, ``vitaminc``; opt-in): ``task.json`` files
  of a local copy (:func:`bigbench_task_file`; the registry no longer serves the sdist that held them), formatted zero-shot as BIG-bench formats JSON tasks (task prefix, input and output prefixes,
  choices appended to the input where the task asks for it), a seeded sample of ``pool`` examples.
* ``passkey``: a five-digit key hidden at a given depth of a State of the Union haystack of a given length in
  tokens (the retrieval test of Mohtashami & Jaggi, arXiv 2305.16300), asked for at the end (the ``query``).
* ``sotu_lastword``: LAMBADA-style (Paperno et al., arXiv 1606.06031) last-word prediction on State of the Union
  passages: the context is a passage up to a sentence's last word, the target is that word. Nothing is asked apart
  from the passage, so it has no ``query``: both protocols compress all of it but its last token.

Rows with a question apart from their material carry it as ``query`` (the task templates render
``context + query``); the context-only protocol compresses the context alone and feeds the query on top.
* ``ruler_*``: RULER-style synthetic tasks, built by :mod:`kvbench.measure.evaluation.ruler` with the helpers here.

Files land under ``$KVBENCH_HOME/data/tasks`` keyed by their parameters (and the tokenizer, for the token-counted
ones), so two runs with the same settings read the same examples.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.inputs.assets import BIGBENCH_DIRS, BIGBENCH_SPEC, BIGBENCH_TASKS, ensure_text
from kvbench.store.atomic import write_bytes
from kvbench.store.paths import home

# BIG-bench's defaults for JSON tasks (bigbench/api/json_task.py)
_BB_DEFAULTS = {"task_prefix": "", "example_input_prefix": "\nQ: ", "example_output_prefix": "\nA: ",
                "choice_prefix": "\n  choice: ", "append_choices_to_input": True}
PASSKEY_INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
                 "Find it and memorize it. I will quiz you about it.\n\n")
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"


def tasks_dir() -> Path:
    return home() / "data" / "tasks"


def keyed_path(name: str, params: dict) -> Path:
    """The data file of task ``name`` built with ``params`` (a short hash of them in the file name)."""
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    return tasks_dir() / f"{name}-{digest}.jsonl"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """``rows`` as JSON lines, written atomically (a reader never sees half a file)."""
    write_bytes(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8"))
    return path


class TaskDataError(ValueError):
    """A task data file that is missing or cannot be read as the task's rows."""


def check_jsonl(path: Path, fields: tuple[str, ...], rebuild: str) -> Path:
    """``path`` if it holds at least one JSON object per line, each with ``fields``; else :class:`TaskDataError`
    naming the file, the first bad line, and ``rebuild`` (how to build the file again).

    lm-eval's loader would otherwise fail deep inside ``datasets`` with a message that names neither.
    """
    if not path.is_file():
        raise TaskDataError(f"task data file {path} is missing; {rebuild}")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    if not any(line.strip() for line in lines):
        raise TaskDataError(f"task data file {path} is empty; {rebuild}")
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskDataError(f"task data file {path}, line {n}: not JSON ({e.msg}); {rebuild}") from None
        if not isinstance(row, dict):
            raise TaskDataError(f"task data file {path}, line {n}: a row must be a JSON object, got "
                                f"{type(row).__name__}; {rebuild}")
        missing = [f for f in fields if f not in row]
        if missing:
            raise TaskDataError(f"task data file {path}, line {n}: missing field(s) {missing} (every row needs "
                                f"{list(fields)}); {rebuild}")
    return path


def format_bigbench(task: dict, example: dict) -> dict | None:
    """One BIG-bench multiple-choice example as ``{context, query, choices, label}`` (None if it has no single
    answer).

    A JSON task's ``input`` mixes the material and the question in free text (a dialogue and its implied answer, a
    claim and its evidence), so no boundary inside it separates them: the context is the task prefix and the input,
    the query is what the format asks after it (the listed choices and the output prefix). The output prefix's
    trailing space moves to the choices (lm-eval joins context and choice with a space).
    """
    fmt = {k: task.get(k, v) for k, v in _BB_DEFAULTS.items()}
    scores = example.get("target_scores")
    if not scores:
        return None
    choices = list(scores)
    best = max(scores.values())
    if sum(1 for v in scores.values() if v == best) != 1:
        return None
    context = (fmt["task_prefix"] + fmt["example_input_prefix"] + example["input"]).lstrip()
    query = "".join(fmt["choice_prefix"] + c for c in choices) if fmt["append_choices_to_input"] else ""
    query = (query + fmt["example_output_prefix"]).rstrip()
    return {"context": context, "query": query, "choices": choices,
            "label": choices.index(next(c for c in choices if scores[c] == best))}


def bigbench_dir() -> Path:
    """Where the BIG-bench ``task.json`` files are read from: ``$KVBENCH_HOME/data/bigbench/<task>/task.json``."""
    return home() / "data" / "bigbench"


def bigbench_task_file(task: str) -> Path:
    """The local ``task.json`` of a BIG-bench task, or :class:`TaskDataError` saying how to provide it.

    The package registry no longer serves the ``bigbench`` sdist that held these files (only a 0.0.1 release without
    them), so nothing downloads them: a copy made earlier (``python -m kvbench assets --data bigbench``, when it still
    worked) or one taken from the BIG-bench repository is read in place."""
    path = bigbench_dir() / task / "task.json"
    if not path.is_file():
        src = BIGBENCH_DIRS.get(task, task)
        raise TaskDataError(
            f"BIG-bench task {task!r} is not available: the package registry no longer serves the {BIGBENCH_SPEC} "
            f"sdist that held its task files. Point kvbench at a local copy: put its task.json at {path} (from a "
            f"clone of https://github.com/google/BIG-bench: bigbench/benchmark_tasks/{src}/task.json), or leave the "
            f"BIG-bench tasks out (the default tasks need no download)")
    return path


def bigbench_data(task: str, pool: int, seed: int) -> Path:
    """A seeded sample of ``pool`` formatted examples of a BIG-bench task."""
    if task not in BIGBENCH_TASKS:
        raise ValueError(f"unknown BIG-bench task {task!r}; available: {list(BIGBENCH_TASKS)}")
    out = keyed_path(f"bigbench_{task}", {"task": task, "pool": pool, "seed": seed, "v": 2})
    if out.exists():
        return out
    spec = json.loads(bigbench_task_file(task).read_text(encoding="utf-8"))
    rows = [r for r in (format_bigbench(spec, ex) for ex in spec["examples"]) if r is not None]
    order = np.random.default_rng(seed).permutation(len(rows))[:pool]
    return write_jsonl(out, [rows[i] | {"id": int(i)} for i in order])


def _sotu() -> list[str]:
    return [p.read_text(encoding="utf-8") for p in sorted(ensure_text("sotu").glob("*.txt"))]


def sotu_texts() -> list[str]:
    """The State of the Union addresses, one string each, in file order."""
    return _sotu()


def tokenizer_id(tokenizer: Any) -> str:
    """What keys a token-counted data file to its tokenizer (a stand-in without ``len`` keys by its class)."""
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else type(tokenizer).__qualname__
    return f"{getattr(tokenizer, 'name_or_path', '')}|{size}"


def passkey_data(tokenizer: Any, length: int, depths: list[float], per_depth: int, seed: int) -> Path:
    """Passkey examples of ``length`` tokens in all: ``per_depth`` per depth, interleaved so a limit keeps every depth."""
    params = {"length": length, "depths": list(depths), "per_depth": per_depth, "seed": seed, "tok": tokenizer_id(tokenizer), "v": 2}
    out = keyed_path(f"passkey_{length}", params)
    if out.exists():
        return out
    enc = lambda s: tokenizer(s, add_special_tokens=False).input_ids
    docs = _sotu()
    rng = np.random.default_rng([seed, length])
    rows = []
    for _ in range(per_depth):
        for depth in depths:
            key = int(rng.integers(10000, 100000))
            fixed = len(enc(PASSKEY_INTRO)) + len(enc(PASSKEY_NEEDLE.format(key=key))) + len(enc(PASSKEY_QUESTION))
            hay = _haystack(docs, enc, length - fixed, rng)
            cut = int(round(depth * len(hay)))
            context = (PASSKEY_INTRO + tokenizer.decode(hay[:cut]).strip() + PASSKEY_NEEDLE.format(key=key)
                       + tokenizer.decode(hay[cut:]).strip())
            rows.append({"context": context, "query": PASSKEY_QUESTION, "passkey": str(key), "length": length,
                         "depth": depth, "n_tokens": len(enc(context + PASSKEY_QUESTION)), "id": len(rows)})
    return write_jsonl(out, rows)


def _haystack(docs: list[str], enc, n: int, rng: np.random.Generator) -> list[int]:
    """``n`` consecutive tokens of State of the Union text from a random address (joined with the next ones)."""
    ids: list[int] = []
    i = int(rng.integers(len(docs)))
    start = None
    while len(ids) < n:
        toks = enc(docs[i % len(docs)] + "\n\n")
        if start is None:
            start = int(rng.integers(0, max(len(toks) - n, 0) + 1))
            toks = toks[start:]
        ids += toks
        i += 1
    return ids[:n]


_LAST_WORD = re.compile(r"(?<=[\s])([A-Za-z]{3,})\.(?=\s)")


def lastword_data(tokenizer: Any, n: int, context_tokens: int, seed: int) -> Path:
    """``n`` passages of about ``context_tokens`` tokens, each ending just before a sentence's last word."""
    params = {"n": n, "context_tokens": context_tokens, "seed": seed, "tok": tokenizer_id(tokenizer), "v": 1}
    out = keyed_path("sotu_lastword", params)
    if out.exists():
        return out
    docs = _sotu()
    rng = np.random.default_rng(seed)
    rows = []
    chars = context_tokens * 8  # generous: SOTU prose runs at ~4-5 characters per token
    for d in rng.permutation(len(docs)):
        text = docs[d]
        ends = [m for m in _LAST_WORD.finditer(text) if m.start() > chars]
        if not ends:
            continue
        m = ends[int(rng.integers(len(ends)))]
        ids = tokenizer(text[m.start() - chars : m.start()].rstrip(), add_special_tokens=False).input_ids
        context = tokenizer.decode(ids[-context_tokens:]).strip()
        rows.append({"context": context, "target": m.group(1), "doc": int(d), "id": len(rows)})
        if len(rows) == n:
            break
    if len(rows) < n:
        raise ValueError(f"only {len(rows)} State of the Union addresses are long enough for {context_tokens}-token "
                         f"passages; lower lastword.n or lastword.context_tokens")
    return write_jsonl(out, rows)
