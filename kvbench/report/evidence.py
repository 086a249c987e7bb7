"""Committed evidence: what a published study's pages are rebuilt from, with no model and no runs folder.

Per study, ``<results>/evidence/<study>/`` holds one folder per run, named as its run directory::

    <run dir name>/
        summary.json | eval.json | ... | stepcost.json            the run's summary as written (its config inside)
        config.json                                              only for a summary written without its config
        nll.npz                                                  the per-token paired NLLs (and the recall probe's),
                                                                 when the run has them: report --check recomputes
                                                                 the summary's delta NLLs from them
    manifest.json                                                the study: its runs, their code version, how to
                                                                 select its cells, the machine they ran on

Traces, KV, fitted state and weights are never copied (a summary names its trace; it does not hold it). A run two
studies publish is copied into each, and ``report --check`` requires the copies to be the same bytes. A study
publishes runs of one code version of a clean tree: :func:`export` refuses several versions, or a ``-dirty`` one,
unless ``allow_mixed`` (which the manifest records and each page built from it states). The cells of presets a
study borrows from another (``borrowed`` in ``configs/study/``: a reference cell that study publishes) are that
study's runs at its own code version: they are checked apart, as one clean version of their own, and the manifest
and each page name it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvbench.core.machine import machine
from kvbench.report.collect import SUMMARY_FILES, Collection, collect
from kvbench.report.sections import SECTIONS, select
from kvbench.store.atomic import staged_dir, write_json
from kvbench.store.paths import results_root
from kvbench.store.results import NLL_FILE, read_nll

__all__ = ["NLL_FILE", "NOT_BACKED", "Evidence", "MixedCodeVersions", "evidence_root", "export", "load", "machine",
           "one_code_version", "read_nll", "borrowed_runs", "study_runs"]

FOLDER = "evidence"
MANIFEST = "manifest.json"
#: what a page that is not rebuilt from evidence says of itself, under its title
NOT_BACKED = ("> **Not rebuilt from committed evidence.** The runs behind this page's figures are not in "
              "`results/evidence/`: `python -m kvbench report --check` cannot recompute them and lists this page as "
              "not checked.")
#: a study's evidence above this is a sign that something other than summaries and NLLs was copied
MAX_STUDY_BYTES = 20 * 2**20


class MixedCodeVersions(ValueError):
    """Runs of several code versions, or of a dirty tree, for one published table."""


def evidence_root(results: str | os.PathLike | None = None) -> Path:
    """``<results root>/evidence``."""
    return results_root(results) / FOLDER


def _short(sha: str) -> str:
    return sha[:7] + ("-dirty" if sha.endswith("-dirty") else "")


def one_code_version(versions: dict[str, Sequence[str]], allow_mixed: bool = False) -> str:
    """The commit every run was measured at (short), from ``{git_sha: [run names]}``. Several versions, a
    ``-dirty`` tree or an unknown one raise :class:`MixedCodeVersions` naming them, unless ``allow_mixed``: then a
    text naming each version and its run count."""
    names = {(_short(s) if s else "unknown"): list(runs) for s, runs in versions.items()}
    clean = len(names) == 1 and not any(n.endswith("-dirty") or n in ("unknown", "?") for n in names)
    if clean:
        return next(iter(names))
    listing = ", ".join(f"{v} ({len(r)} run{'s' * (len(r) != 1)}: {', '.join(r[:2])}{' ...' if len(r) > 2 else ''})"
                        for v, r in sorted(names.items()))
    if not allow_mixed:
        why = "several code versions" if len(names) > 1 else "a dirty or unknown code version"
        raise MixedCodeVersions(f"runs of {why} for one published study: {listing}. Measure the study's cells on one "
                                "clean commit (metrics.resume=code reuses only its runs), or publish them as they are "
                                "with --allow-mixed, which the page then states")
    return "mixed: " + ", ".join(f"{v} ({len(r)} runs)" for v, r in sorted(names.items()))


def _summaries(run_dir: Path) -> list[tuple[Path, dict]]:
    out = []
    for name in SUMMARY_FILES:
        f = run_dir / name
        if f.exists():
            try:
                out.append((f, json.loads(f.read_text())))
            except (OSError, ValueError) as e:
                raise ValueError(f"{f}: unreadable summary ({e})") from e
    if not out:
        raise ValueError(f"{run_dir} holds no run summary ({', '.join(SUMMARY_FILES)})")
    return out


def _versions(found: dict[Path, list[tuple[Path, dict]]]) -> dict[str, list[str]]:
    """``{git_sha: [run names]}`` of runs and their summaries."""
    versions: dict[str, list[str]] = {}
    for d, sums in found.items():
        for sha in sorted({str(s.get("git_sha") or "") for _, s in sums}):
            versions.setdefault(sha, []).append(d.name)
    return versions


def borrowed_runs(study: str, dirs: Sequence[Path], overrides: Sequence[str] = ()) -> set[str]:
    """The names of those of run directories ``dirs`` that are cells of presets ``study`` borrows from another
    study (none for a study without a ``configs/study/`` entry)."""
    from kvbench.sweep.studies_config import studies

    lent = studies().get(study)
    sec = SECTIONS.get(study)
    if lent is None or not lent.borrowed or sec is None:
        return set()
    got = select(collect(dirs), [p for p in sec.presets if p.name in lent.borrowed], overrides)
    return {Path(d).name for f in got.frames().values() if "run_dir" in f for d in f["run_dir"]}


def _commits(found: dict[Path, list[tuple[Path, dict]]], lent: set[str],
             allow_mixed: bool) -> tuple[str, str | None]:
    """The code version of the study's own runs, and that of the runs it borrows (None without any)."""
    own = one_code_version(_versions({d: s for d, s in found.items() if d.name not in lent}), allow_mixed)
    theirs = {d: s for d, s in found.items() if d.name in lent}
    return own, (one_code_version(_versions(theirs), allow_mixed) if theirs else None)


def study_runs(study: str, dirs: Iterable[str | os.PathLike], overrides: Sequence[str] = ()) -> list[Path]:
    """The run directories a study publishes from under ``dirs``: for a report section's study, the newest run of
    each of its cells (as its page shows them); for any other study, the newest run of every cell there."""
    got = collect(dirs)
    sec = SECTIONS.get(study)
    if sec is not None and sec.presets:
        got = select(got, sec.presets, overrides)
    return sorted({Path(d) for f in got.frames().values() if "run_dir" in f for d in f["run_dir"]},
                  key=lambda p: p.name)


def export(study: str, run_dirs: Iterable[str | os.PathLike], results: str | os.PathLike | None = None,
           overrides: Sequence[str] = (), allow_mixed: bool = False, wall_min: float | None = None,
           host: str | None = None) -> Path:
    """Write ``run_dirs`` as the evidence of ``study`` (replacing what it held) and return its folder.
    ``overrides``: those the study's cells ran with (the report selects its cells with them); ``wall_min``: the
    measuring run's wall time, for the page header; ``host``: the measuring machine (default: this one)."""
    dirs = [Path(d) for d in run_dirs]
    if not dirs:
        raise ValueError(f"no run to export as the evidence of {study!r}")
    if len({d.name for d in dirs}) != len(dirs):
        raise ValueError(f"two run directories of {study!r} share a name: {sorted(d.name for d in dirs)}")
    found = {d: _summaries(d) for d in dirs}
    versions = _versions(found)
    lent = borrowed_runs(study, dirs, overrides)
    commit, lent_commit = _commits(found, lent, allow_mixed)
    target = evidence_root(results) / study
    with staged_dir(target) as tmp:
        size = 0
        for d, sums in found.items():
            (tmp / d.name).mkdir()
            files = [f for f, _ in sums]
            if any(not isinstance(s.get("config"), dict) for _, s in sums) and (d / "config.json").exists():
                files.append(d / "config.json")
            if (d / NLL_FILE).exists():
                files.append(d / NLL_FILE)
            for f in files:
                shutil.copy2(f, tmp / d.name / f.name)
                size += f.stat().st_size
        if size > MAX_STUDY_BYTES:
            raise ValueError(f"the evidence of {study!r} would hold {size / 2**20:.1f} MiB, over the "
                             f"{MAX_STUDY_BYTES / 2**20:.0f} MiB a study's summaries and NLLs should need")
        write_json(tmp / MANIFEST, {
            "study": study, "runs": sorted(d.name for d in dirs), "commit": commit,
            "code_versions": {k or "unknown": len(v) for k, v in sorted(versions.items())},
            "allow_mixed": bool(allow_mixed), "overrides": list(overrides), "machine": host or machine(),
            "wall_min": wall_min, **({"borrowed": {"runs": sorted(lent), "commit": lent_commit}} if lent else {})})
    return target


@dataclass
class Evidence:
    """One study's committed evidence, read back."""

    study: str
    path: Path
    manifest: dict
    got: Collection
    commit: str  # the code version of its runs, or the ``mixed: ...`` text of an allow_mixed study
    runs: int  # how many
    lent_commit: str | None = None  # that of the runs it borrows from another study, if any

    @property
    def borrowed(self) -> str:
        """What a page says of the runs the study borrows ("" without any)."""
        n = len((self.manifest.get("borrowed") or {}).get("runs") or ())
        return (f"{n} reference run{'s' * (n != 1)} borrowed from another study's evidence at commit "
                f"`{self.lent_commit}`") if n else ""

    @property
    def overrides(self) -> list[str]:
        return list(self.manifest.get("overrides") or [])

    @property
    def date(self) -> str:
        """When its newest run was measured (YYYY-MM-DD)."""
        dates = [str(c)[:10] for f in self.got.frames().values() if "created" in f for c in f["created"].dropna()]
        return max(dates) if dates else "unknown date"


def load(study: str, results: str | os.PathLike | None = None) -> Evidence:
    """A study's evidence: its runs as the report reads runs, its manifest, and the code version they share
    (:class:`MixedCodeVersions` unless they share one or the study was exported with ``allow_mixed``)."""
    path = evidence_root(results) / study
    if not (path / MANIFEST).exists():
        raise ValueError(f"no committed evidence for study {study!r} ({path / MANIFEST} is missing); a study's "
                         "driver writes it, or python -m kvbench report --export-evidence STUDY RUN_DIRS...")
    manifest = json.loads((path / MANIFEST).read_text())
    got = dataclasses.replace(collect([path]), root=path.parent.parent)  # run_dir: FOLDER/study/run
    if got.skipped:
        raise ValueError(f"evidence of {study!r} holds unreadable runs: "
                         + "; ".join(f"{p}: {why}" for p, why in got.skipped))
    for f in got.frames().values():
        if "run_dir" in f:  # where it is in any checkout, so that what is built from it is the same everywhere
            f["run_dir"] = [f"{FOLDER}/{study}/{run}" for run in f["run_id"]]
    found = {d: _summaries(d) for d in sorted(p for p in path.iterdir() if p.is_dir())}
    lent = set((manifest.get("borrowed") or {}).get("runs") or ())
    commit, lent_commit = _commits(found, lent, bool(manifest.get("allow_mixed")))
    return Evidence(study, path, manifest, got, commit, len(found), lent_commit)
