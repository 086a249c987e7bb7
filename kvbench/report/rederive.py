"""Every committed verdict re-derived from the per-token evidence, and every copy of a run the same bytes.

A page is built from run summaries; the summaries' delta NLL, its interval and its verdict against the 1% line (and
the long-range recall probe's) are statistics of the per-token NLLs each run keeps in ``nll.npz``. Rebuilding a page
from its summaries proves the page says what the summaries say, not that the summaries say what the tokens do: this
module recomputes those statistics from the stored arrays with the very functions the run measured them with
(:func:`kvbench.measure.metrics.paired_loss.task_loss`, :func:`~kvbench.measure.metrics.paired_loss.recall_loss`: the same documents, blocks,
resamples and seed) and names every field that differs. The NLLs are computed in float32 and stored as float32, so
a run's statistics come back to the last bit; the comparison allows :data:`RELATIVE` for a different numpy build, far
below what one edited token moves (one float32 step of one token among thousands moves a mean by about 1e-10).

A capacity run (``python -m kvbench capacity``) holds no per-token NLLs: its rows are computed again from the
evidence of the studies it names (:func:`kvbench.report.capacity.recompute`), so a projection left behind by a
republished study fails the check.

A run published by two studies is stored in each (a study's evidence is a folder of its own): :func:`copies`
requires those copies to be byte-identical, so an edit to one cannot make two pages disagree about one run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.measure.metrics.paired_loss import recall_loss, task_loss
from kvbench.store.integrity import IntegrityError
from kvbench.store.results import NLL_FILE, read_nll

#: the summary of a run that scores held-out tokens (other kinds keep no per-token NLLs)
SUMMARY = "summary.json"
#: the summary of a capacity run, recomputed from the evidence it was computed from
CAPACITY = "capacity.json"
#: how far a recomputed figure may be from the summary's, relative (and absolute, for figures near zero)
RELATIVE = 1e-12
#: what a summary with per-token NLLs must state, per probe
REQUIRED = {"": ("nll_base", "nll_compressed", "delta_nll", "delta_nll_ci", "delta_nll_verdict_1pct"),
            "recall": ("nll_recall_base", "delta_nll_recall", "delta_nll_recall_ci")}


@dataclass
class Verified:
    """What recomputing a study's evidence found: ``problems`` fail the pages that read it; ``notes`` say what
    could not be recomputed (a run measured before its arrays were stored)."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, str) or isinstance(b, str):
        return a == b
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return math.isclose(a, b, rel_tol=RELATIVE, abs_tol=RELATIVE)
    return a == b


def _shown(v) -> str:
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_shown(x) for x in v) + "]"
    return repr(v)


def differences(summary: Mapping, recomputed: Mapping, required: Iterable[str] = ()) -> list[str]:
    """Each field of ``recomputed`` the summary states otherwise (a field an older summary lacks is not compared,
    unless ``required``)."""
    out = [f"{k}: the summary does not state it" for k in required if k not in summary]
    for k, v in recomputed.items():
        if k in summary and not _same(summary[k], v):
            out.append(f"{k}: {_shown(v)} recomputed from {NLL_FILE}, the summary says {_shown(summary[k])}")
    return out


def _metrics(run_dir: Path, summary: Mapping):
    """The run's ``metrics`` config (block, resamples, seed of its interval), from its summary or config.json."""
    from omegaconf import OmegaConf

    cfg = summary.get("config")
    if not isinstance(cfg, dict) and (run_dir / "config.json").exists():
        cfg = json.loads((run_dir / "config.json").read_text())
    metrics = (cfg or {}).get("metrics") if isinstance(cfg, dict) else None
    missing = [k for k in ("ci_block", "ci_resamples", "ci_seed") if k not in (metrics or {})]
    if missing:
        raise ValueError(f"its config names no metrics.{', metrics.'.join(missing)}: the interval cannot be redrawn")
    return OmegaConf.create(metrics)


def recompute_run(run_dir: str | Path) -> tuple[list[str], list[str]]:
    """``(problems, notes)`` of one run: each of its delta-NLL and recall-probe figures recomputed from its
    ``nll.npz`` that its summary states otherwise."""
    import numpy as np


    run_dir = Path(run_dir)
    if (run_dir / CAPACITY).exists():
        from kvbench.report.capacity import recompute

        return recompute(run_dir)
    if not (run_dir / SUMMARY).exists():
        return [], []
    summary = json.loads((run_dir / SUMMARY).read_text())
    problems: list[str] = []
    try:
        windows = read_nll(run_dir)
    except IntegrityError as e:  # an edited file: say so, then say what the edit changed
        problems.append(str(e))
        windows = read_nll(run_dir, check_hash_first=False)
    if not windows:
        scored = bool(summary.get("eval_tokens")) or bool(summary.get("recall_tokens"))
        return problems, [f"delta NLL not recomputed: no {NLL_FILE}"] if scored else []
    try:
        metrics = _metrics(run_dir, summary)
    except ValueError as e:
        return [*problems, f"{NLL_FILE} cannot be checked: {e}"], []
    wide = lambda xs: [np.asarray(x, np.float64) for x in xs]  # noqa: E731 - as the run held them
    docs = summary.get("eval_documents")
    got = task_loss(wide(b for b, _ in windows), wide(c for _, c in windows), metrics, docs)
    problems += differences(summary, got, REQUIRED[""])
    spans = read_nll(run_dir, "recall", check_hash_first=False)
    if spans:
        got = recall_loss(wide(b for b, _, _ in spans), wide(c for _, c, _ in spans), metrics, docs,
                          [w for _, _, w in spans])
        problems += differences(summary, got, REQUIRED["recall"])
        return problems, []
    if summary.get("recall_tokens"):
        return problems, [f"recall probe not recomputed: its {NLL_FILE} holds no recall arrays"]
    return problems, []


def verify_study(path: str | Path) -> Verified:
    """Every run of a study's evidence folder recomputed (:func:`recompute_run`), each problem naming the run."""
    path = Path(path)
    out = Verified()
    unrecomputed: dict[str, list[str]] = {}
    for run in sorted(p for p in path.iterdir() if p.is_dir()):
        problems, notes = recompute_run(run)
        out.problems += [f"{path.name}/{run.name}: {p}" for p in problems]
        for n in notes:
            unrecomputed.setdefault(n, []).append(run.name)
    for note, runs in unrecomputed.items():
        out.notes.append(f"{path.name}: {note} ({len(runs)} run{'s' * (len(runs) != 1)}"
                         f"{': ' + ', '.join(runs) if len(runs) <= 3 else ''})")
    return out


def copies(root: str | Path, studies: Iterable[str]) -> dict[str, list[str]]:
    """Per study, the runs it shares with another study whose copies are not byte-identical (the same files,
    the same bytes), each named with the other study and the files that differ."""
    root = Path(root)
    where: dict[str, list[Path]] = {}
    for study in studies:
        if (root / study).is_dir():
            for run in sorted(p for p in (root / study).iterdir() if p.is_dir()):
                where.setdefault(run.name, []).append(run)
    out: dict[str, list[str]] = {}
    for name, dirs in where.items():
        first = dirs[0]
        for other in dirs[1:]:
            files = sorted({p.name for d in (first, other) for p in d.iterdir() if p.is_file()})
            differ = [f for f in files if not ((first / f).is_file() and (other / f).is_file()
                                               and (first / f).read_bytes() == (other / f).read_bytes())]
            if differ:
                line = (f"run {name}: its copies in {first.parent.name}/ and {other.parent.name}/ differ "
                        f"({', '.join(differ)}); a run published by two studies must be the same bytes in both")
                for d in (first, other):
                    out.setdefault(d.parent.name, []).append(line)
    return out
