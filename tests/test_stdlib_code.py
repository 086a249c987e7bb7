"""The second text domain: the Python standard library's own modules, one document each, windows drawn across them."""

import sysconfig
from pathlib import Path

from kvbench.core.config import compose
from kvbench.inputs.data import STDLIB_SKIP, load_documents, sample_windows, stdlib_sources


def test_the_standard_library_modules_are_the_documents():
    files = stdlib_sources()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 200 and all(p.suffix == ".py" for p in files)
    assert root / "json" / "decoder.py" in files and root / "collections" / "__init__.py" in files
    assert not any(STDLIB_SKIP & set(p.relative_to(root).parts[:-1]) for p in files)  # no test suites
    docs = load_documents(compose(["dataset=stdlib_code"]).dataset)
    assert len(docs) == len(files) and any("def " in d for d in docs)


def test_windows_come_from_different_modules_and_repeat_with_the_seed(tokenizer):
    ds = compose(["dataset=stdlib_code"]).dataset
    docs = load_documents(ds)
    a = sample_windows(docs, tokenizer, 6, 200, seed=0)
    assert a.shape == (6, 200) and len({tuple(w[:50].tolist()) for w in a}) == 6
    assert (sample_windows(docs, tokenizer, 6, 200, seed=0) == a).all()
