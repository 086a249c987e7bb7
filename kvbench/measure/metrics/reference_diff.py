"""Two compressed caches compared on the same scored tokens: a coder's loss minus a reference cache's (the FP8 cache),
with the paired interval of that difference.

A coder's recall-probe loss alone says how much worse it is than the 16-bit cache; whether it keeps what a later
question needs *as well as a cache serving stacks already accept* is a comparison with that cache on the same copy
spans. Both runs score the same windows of one trace with the same 16-bit baseline, so the difference of their
compressed NLLs, token by token, is paired; its interval resamples the windows' documents and then blocks of tokens,
as every interval of a run does (:func:`kvbench.measure.metrics.intervals.document_bootstrap_ci`, the run's own block,
resamples and seed). The verdict asks whether the coder is no worse than the reference by more than
:data:`NO_WORSE_MARGIN` nats: ``no worse`` when the whole interval lies at or below it, ``worse`` when it lies wholly
above it, else ``unresolved``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.measure.metrics.intervals import document_bootstrap_ci
from kvbench.store.results import read_nll

#: how much more loss than the reference a coder may have (nats per token) and still count as no worse
NO_WORSE_MARGIN = 0.01


class NotPaired(ValueError):
    """Two runs were not scored on the same tokens with the same baseline, so their difference is not paired."""


def reference_verdict(ci: Sequence[float], margin: float = NO_WORSE_MARGIN) -> str:
    low, high = ci
    if not (np.isfinite(low) and np.isfinite(high)):
        return "unresolved"
    if high <= margin:
        return "no worse"
    if low > margin:
        return "worse"
    return "unresolved"


def paired_difference(run: Path, reference: Path, metrics: Any, documents: Sequence[int] | None,
                      probe: str = "recall") -> dict:
    """``{diff, ci, verdict, tokens}`` of ``run``'s compressed NLL minus ``reference``'s on ``probe`` (``recall``: the
    long-range probe's copy spans; ``""``: the next-token continuation). ``documents``: each scored window's document
    (the run summary's ``eval_documents``). Raises :class:`NotPaired` unless both runs scored the same spans with the
    same 16-bit NLLs, and ``ValueError`` when either kept none."""
    a, b = read_nll(run, probe), read_nll(reference, probe)
    what = f"{probe} probe" if probe else "continuation"
    if not a or not b:
        raise ValueError(f"{run.name if not a else reference.name} kept no per-token NLLs of its {what} to pair")
    same = len(a) == len(b) and all(x[0].shape == y[0].shape and np.array_equal(x[0], y[0]) for x, y in zip(a, b))
    if not same or (probe and [x[2] for x in a] != [y[2] for y in b]):
        raise NotPaired(f"{run.name} and {reference.name} were not scored on the same {what} tokens with the same "
                        "16-bit NLLs (another trace, window set or probe length): their difference is not paired")
    diffs = [x[1].astype(np.float64) - y[1].astype(np.float64) for x, y in zip(a, b)]  # per span (n_i,)
    docs = None
    if documents is not None:
        docs = [list(documents)[x[2]] for x in a] if probe else list(documents)[: len(a)]
    ci = document_bootstrap_ci(diffs, docs, int(metrics.ci_block), int(metrics.ci_resamples), int(metrics.ci_seed))
    mean = float(np.concatenate(diffs).mean())
    return {"diff": mean, "ci": ci, "verdict": reference_verdict(ci), "tokens": int(sum(d.size for d in diffs))}
