"""The results layer: which finished run is this cell, reuse it or measure it, and write it atomically.

Every command that measures (``run``, ``eval``, ``latency``, ``restore``, ``stepcost``) writes one directory per run under
``<results root>/runs/``::

    <prefix><compressor>-<cell_key>-<code version>/
        <kind file>        summary.json | eval.json | latency.json | restore.json | stepcost.json: the measurements, plus
                           ``kind``, ``cell_key``, ``git_sha``, the resolved ``config`` and ``file_sha256`` (the
                           SHA-256 of the table and of ``nll.npz``, taken as they were written), so that one file
                           describes its run
        <kind table>       rows.parquet | eval.parquet | latency.parquet | restore.parquet | stepcost.parquet
        config.json        the resolved config
        nll.npz            for a run that scores held-out tokens: per scored window the base and compressed
                           per-token NLLs, float32 (:func:`read_nll`), what its delta-NLL interval resamples; and
                           the long-range probe's, per copy span (``read_nll(dir, "recall")``)

``cell_key`` identifies what was measured: the resolved config without output paths, resume flags, the memory limit
or the code version, with the compressor node replaced by the instantiated compressor's full hyperparameters (so a config that
leaves a field at its default keys the same as one that names it), less any field its class lists in ``added_later`` at
the value named there (:meth:`kvbench.core.compressor.Compressor.keyed`: a field added to a published coder does
not orphan its earlier runs). The code version (``git_sha``) is kept
beside it, not in it: a commit does not orphan earlier runs, and :func:`latest` finds the newest finished run of a
cell under any code version unless ``same_code=True`` asks for this one.

A run directory's name is its identity: kind, compressor, ``cell_key`` and code version, never a time. Sweeps that
share a results root at once measure each cell once: a cell is measured under a lock file of its own
(``runs/.locks/``), and a sweep that waits on it reuses the run the holder wrote. Before anything is measured the
results folder is checked for a write (:func:`check_writable`), so a read-only or full disk fails at once, not
after the measurement.

The table and ``nll.npz`` are inputs to later verdicts, so they are checked against ``file_sha256`` when read: a run
whose table or NLLs are missing, empty or fail their hash is not a finished run (:func:`finished` passes over it with
a warning naming the file, so the cell is measured again and its directory replaced), and :func:`read_nll` refuses
such a file with an :class:`~kvbench.store.integrity.IntegrityError` naming it. A run written before hashes were
recorded is taken as it is (its files must still be there and non-empty): only ``metrics.resume=true`` reuses a run of
another code version, and committed evidence is kept under version control.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.store.atomic import probe_write, staged_dir, why_unwritable
from kvbench.store.integrity import check_hash, damaged, sha256_file
from kvbench.store.paths import repo_root, results_root


@dataclass(frozen=True)
class Kind:
    """One kind of measurement and the files its runs hold."""

    name: str
    prefix: str  # of the run directory's name
    summary: str  # the summary file's name
    table: str  # the per-row table's name


KINDS = {
    "run": Kind("run", "", "summary.json", "rows.parquet"),
    "eval": Kind("eval", "eval-", "eval.json", "eval.parquet"),
    "latency": Kind("latency", "latency-", "latency.json", "latency.parquet"),
    "restore": Kind("restore", "restore-", "restore.json", "restore.parquet"),
    "stepcost": Kind("stepcost", "stepcost-", "stepcost.json", "stepcost.parquet"),
    # filed by scripts/reliability.py from the fuzz tests' tally, not by a command: one per compressor and variant
    "reliability": Kind("reliability", "reliability-", "reliability.json", "reliability.parquet"),
    # filed by scripts/bench_scale.py from its measurements: one per model and context length, one row per step
    "scale": Kind("scale", "scale-", "scale.json", "scale.parquet"),
    # filed by python -m kvbench capacity from committed evidence, not measured: one per model and memory budget
    "capacity": Kind("capacity", "capacity-", "capacity.json", "capacity.parquet"),
}

#: top-level config nodes that say where results go, whether to reuse them or how much memory a run may take, not
#: what is measured
NOT_KEYED = ("paths", "hydra", "memory")
#: metrics.* fields that steer the command, not the measurement
NOT_KEYED_METRICS = ("resume", "reuse_exact_nll")
#: (node, field) -> value: config fields added after runs were filed without them, left out of the key while they hold
#: the value under which the run measures what those runs measured, so those runs keep their keys
ADDED_LATER = {
    ("dataset", "split"): "test",
    ("dataset", "allow_beyond_positions"): False,
    ("latency", "baselines"): [],
    ("latency", "quantized_cache"): {"nbits": None, "q_group_size": None, "residual_length": None},
    ("metrics", "fit_draws"): 1,
    ("metrics", "attn_queries"): 128,
    # every run before these fields loaded the model in float32 with transformers' default (sdpa) attention
    ("model", "dtype"): "float32",
    ("model", "attn_implementation"): "sdpa",
}


#: the run directory's per-token NLLs, and the summary key a measuring function hands them under (never written into
#: the summary: ``(base, compressed)``, one float array per scored window each, and optionally the long-range probe's
#: ``(base, compressed, of)``: one array per copy span each, and the scored window each span follows)
NLL_FILE = "nll.npz"
NLL_KEY = "_nll_per_token"
#: the summary key mapping a run directory's table and :data:`NLL_FILE` to their SHA-256 as written
FILE_HASHES = "file_sha256"
#: what rebuilds a run's damaged file
REMEASURE = ("measure its run again (the same command with metrics.resume=false), or, for committed evidence, "
             "restore it with `git checkout`")


def _pairs(base: list, compressed: list) -> dict:
    """Paired per-token NLL arrays concatenated as float32, and each array's ``offsets`` into them."""
    import numpy as np

    if len(base) != len(compressed) or any(len(b) != len(c) for b, c in zip(base, compressed)):
        raise ValueError(f"per-token NLLs do not pair: {[len(b) for b in base]} base against "
                         f"{[len(c) for c in compressed]} compressed tokens per window")
    offsets = np.cumsum([0, *(len(b) for b in base)]).astype(np.int64)
    cat = lambda xs: np.concatenate([np.asarray(x, np.float32).ravel() for x in xs]) if xs else np.zeros(0, np.float32)  # noqa: E731
    return {"base": cat(base), "compressed": cat(compressed), "offsets": offsets}


def write_nll(path: Path, base: list, compressed: list, recall: tuple | None = None) -> None:
    """``path`` (an ``.npz``): per scored window the base and compressed per-token NLLs, concatenated as float32,
    with the windows' ``offsets`` into them. ``recall``: the long-range probe's ``(base, compressed, of)``, per copy
    span its NLLs and the scored window it follows, stored as ``recall_base``, ``recall_compressed``,
    ``recall_offsets`` and ``recall_of``. The NLLs are computed in float32, so the file holds them exactly."""
    import numpy as np

    arrays = _pairs(base, compressed)
    if recall is not None and len(recall[0]):
        rb, rc, of = recall
        arrays |= {f"recall_{k}": v for k, v in _pairs(rb, rc).items()} | {"recall_of": np.asarray(of, np.int64)}
    np.savez_compressed(path, **arrays)


def read_nll(run_dir: Path, probe: str = "", check_hash_first: bool = True) -> list[tuple]:
    """Per scored window of a run (its directory, or its evidence), ``(base, compressed)`` per-token NLLs; empty
    when the run has none. ``probe="recall"``: per copy span of the long-range probe, ``(base, compressed, window)``
    with the scored window it follows; empty when the run stored none. The file is checked against the hash its
    summary recorded (:data:`FILE_HASHES`; a summary written before hashes were recorded has none to check by): a
    missing, empty, damaged or unreadable file is an :class:`~kvbench.store.integrity.IntegrityError` naming it.
    ``check_hash_first=False`` reads a file that failed its hash anyway, for a check that then names what the edit
    changed."""
    import zipfile

    import numpy as np

    f = Path(run_dir) / NLL_FILE
    recorded = recorded_hashes(Path(run_dir)).get(NLL_FILE)
    if not f.exists():
        if recorded:
            raise damaged(f, "is missing though its run's summary records it", REMEASURE)
        return []
    data = f.read_bytes()
    if not data:
        raise damaged(f, "is empty", REMEASURE)
    if recorded and check_hash_first:
        check_hash(f, recorded, REMEASURE, data)
    pre = f"{probe}_" if probe else ""
    try:
        with np.load(io.BytesIO(data)) as z:
            if f"{pre}base" not in z.files:
                return []
            base, comp, off = z[f"{pre}base"], z[f"{pre}compressed"], z[f"{pre}offsets"]
            of = z[f"{pre}of"].tolist() if probe else None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise damaged(f, f"is not a readable per-token NLL file ({type(e).__name__}: {e})", REMEASURE) from e
    spans = [(base[a:b], comp[a:b]) for a, b in zip(off[:-1], off[1:])]
    return spans if of is None else [(b, c, w) for (b, c), w in zip(spans, of)]


def recorded_hashes(run_dir: Path) -> dict[str, str]:
    """The :data:`FILE_HASHES` a run directory's summary records (empty for a run written before they were)."""
    for k in KINDS.values():
        s = read_summary(Path(run_dir) / k.summary)
        if isinstance(s, dict) and isinstance(s.get(FILE_HASHES), dict):
            return dict(s[FILE_HASHES])
    return {}


def unsound(run_dir: Path, kind: str, summary: dict) -> str | None:
    """Why a run directory with a readable summary is not a finished run whose files can be trusted, or None: its
    table or NLLs are missing, empty, or fail the hashes its summary records."""
    recorded = summary.get(FILE_HASHES) if isinstance(summary.get(FILE_HASHES), dict) else {}
    for name in (kind_of(kind).table, NLL_FILE):
        f = Path(run_dir) / name
        if not f.exists():
            if name == NLL_FILE and not recorded.get(name):
                continue  # a run that scores no tokens has none
            return f"{f} is missing"
        if f.stat().st_size == 0:
            return f"{f} is empty"
        if recorded.get(name) and sha256_file(f) != recorded[name]:
            return f"{f} fails its content hash (recorded {recorded[name][:16]} when it was written)"
    return None


#: what a study writes while it runs (its pages, report files, logs): changes there are not changes of the code
OUTPUTS = "results"


def git_sha() -> str:
    """The code version: the checkout's commit, ``-dirty`` when tracked files outside :data:`OUTPUTS` differ from
    it (a study that rewrites its committed pages and log as it runs still measures the commit's code)."""
    try:
        out = subprocess.run(["git", "-C", str(repo_root()), "rev-parse", "HEAD"], capture_output=True, text=True)
        sha = out.stdout.strip() if out.returncode == 0 else "unknown"
        dirty = subprocess.run(["git", "-C", str(repo_root()), "status", "--porcelain", "--untracked-files=no", "--",
                                ".", f":(exclude){OUTPUTS}"], capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def kind_of(name: str) -> Kind:
    if name not in KINDS:
        raise ValueError(f"unknown kind of run {name!r}; one of {sorted(KINDS)}")
    return KINDS[name]


def keyed_config(cfg_dict: dict, compressor_config: dict | None = None) -> dict:
    """The part of a resolved config that identifies the measurement (see the module docstring)."""
    keyed = {k: v for k, v in cfg_dict.items() if k not in NOT_KEYED}
    if isinstance(keyed.get("metrics"), dict):
        keyed["metrics"] = {k: v for k, v in keyed["metrics"].items() if k not in NOT_KEYED_METRICS}
    for (node, name), value in ADDED_LATER.items():
        if isinstance(keyed.get(node), dict) and keyed[node].get(name, value) == value:
            keyed[node] = {k: v for k, v in keyed[node].items() if k != name}
    if compressor_config is not None:
        keyed["compressor"] = compressor_config
    return keyed


def cell_key(cfg_dict: dict, compressor_config: dict | None = None) -> str:
    """12 hex digits of the hash of :func:`keyed_config`."""
    blob = json.dumps(keyed_config(cfg_dict, compressor_config), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def root_of(cfg_dict: dict) -> Path:
    return results_root((cfg_dict.get("paths") or {}).get("results"))


def _short(sha: str) -> str:
    return sha[:7] + ("-dirty" if sha.endswith("-dirty") else "")


def run_dir(root: Path, kind: str, name: str, key: str, sha: str) -> Path:
    return Path(root) / "runs" / f"{kind_of(kind).prefix}{name}-{key}-{_short(sha)}"


def read_summary(path: Path) -> dict | None:
    """A finished run's summary, or None when the file is missing or unreadable (a run still being written never
    is: directories appear whole)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def finished(root: Path, kind: str, key: str, name: str = "*", same_code: bool = False) -> list[dict]:
    """Every finished run of the cell ``key`` under ``root``, newest first; each summary gets ``_dir``. A run whose
    table or NLLs are missing, empty or fail their recorded hash (:func:`unsound`) is not finished: a warning names
    the file."""
    k = kind_of(kind)
    sha = _short(git_sha()) if same_code else "*"
    out = []
    for f in Path(root).glob(f"runs/{k.prefix}{name}-{key}-{sha}/{k.summary}"):
        s = read_summary(f)
        if s is None or s.get("cell_key") != key:
            continue
        if (why := unsound(f.parent, kind, s)) is not None:
            # its measurements cannot be trusted; the cell is measured again and the directory replaced
            print(f"warning: not reusing run {f.parent.name}: {why}", file=sys.stderr)
            continue
        out.append({**s, "_dir": str(f.parent)})
    return sorted(out, key=lambda s: str(s.get("created", "")), reverse=True)


def latest(root: Path, kind: str, key: str, name: str = "*", same_code: bool = False) -> dict | None:
    """The newest finished run of the cell ``key`` (any code version unless ``same_code``), or None."""
    runs = finished(root, kind, key, name, same_code)
    return runs[0] if runs else None


class ResultsNotWritable(ValueError):
    """The results folder cannot take a run: read-only, not ours, or out of space."""


#: bytes the write check puts on disk (and removes): a disk without this much room cannot take a run's files
PROBE_BYTES = 64 * 1024


def check_writable(root: Path) -> None:
    """Raise :class:`ResultsNotWritable` unless a file of :data:`PROBE_BYTES` can be written, synced and removed
    in ``root/runs`` (created if missing). The probe is a hidden temporary file; nothing is left behind."""
    runs = Path(root) / "runs"
    try:
        probe_write(runs, PROBE_BYTES)
    except OSError as e:
        raise ResultsNotWritable(
            f"results folder {runs} cannot take a run: {why_unwritable(e)} ({e.filename or runs}); nothing was "
            "measured. Point paths.results=DIR (or KVBENCH_RESULTS=DIR) at a writable folder with room") from e


def cell_lock_path(root: Path, kind: str, name: str, key: str) -> Path:
    """The lock file a cell is measured under, shared by every process writing ``root``."""
    return Path(root) / "runs" / ".locks" / f"{kind_of(kind).prefix}{name}-{key}.lock"


def write(path: Path, kind: str, summary: dict, rows: list[dict], cfg_dict: dict, nll: tuple | None = None) -> dict:
    """Write a run directory atomically: it appears whole or not at all. ``nll``: ``(base, compressed)`` per-token
    NLLs per scored window, written to :data:`NLL_FILE`. The summary is written last, with the hashes of the files
    before it under :data:`FILE_HASHES`; it is returned as written."""
    import pandas as pd

    k = kind_of(kind)
    with staged_dir(path) as tmp:
        pd.DataFrame(rows).to_parquet(tmp / k.table, index=False)
        (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2, default=str))
        written = [k.table]
        if nll is not None and len(nll[0]):
            write_nll(tmp / NLL_FILE, *nll)
            written.append(NLL_FILE)
        summary = {**summary, FILE_HASHES: {name: sha256_file(tmp / name) for name in written}}
        (tmp / k.summary).write_text(json.dumps(summary, indent=2, default=str))
    return summary


@dataclass
class Outcome:
    summary: dict
    path: Path
    reused: bool


def resume_mode(value: Any) -> str:
    """``metrics.resume``: true (reuse a finished run of any code version), ``code`` (only of this code
    version) or false (always measure)."""
    if value in (True, "true", "any"):
        return "any"
    if value in (False, "false", None):
        return "never"
    if value == "code":
        return "code"
    raise ValueError(f"metrics.resume={value!r} is not allowed; choose one of [true, code, false]")


def reuse_or_measure(kind: str, cfg_dict: dict, name: str, compressor_config: dict | None,
                     measure: Callable[[], tuple[dict, list[dict]]], resume: Any = True) -> Outcome:
    """Return the newest finished run of this cell, or measure it (``measure()`` gives ``(summary, rows)``) and
    write it with ``kind``, ``cell_key``, ``git_sha`` and the resolved ``config`` in the summary; per-token NLLs
    the summary hands under :data:`NLL_KEY` go to :data:`NLL_FILE` instead.

    The results folder is checked for a write before ``measure()`` runs, and the cell is measured under its lock
    (:func:`cell_lock_path`): a process that waited on the lock finds the holder's run and reuses it (unless
    ``resume`` is false), so concurrent sweeps on one root measure and write each cell once."""
    from filelock import FileLock

    mode = resume_mode(resume)
    key = cell_key(cfg_dict, compressor_config)
    root = root_of(cfg_dict)

    def reusable() -> Outcome | None:
        found = latest(root, kind, key, name, same_code=mode == "code") if mode != "never" else None
        return None if found is None else Outcome(found, Path(found.pop("_dir")), True)

    if (out := reusable()) is not None:
        return out
    check_writable(root)
    lock = cell_lock_path(root, kind, name, key)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        if (out := reusable()) is not None:  # another process measured the cell while this one waited
            return out
        summary, rows = measure()
        nll = summary.get(NLL_KEY)
        sha = git_sha()
        summary = {**{k: v for k, v in summary.items() if k != NLL_KEY}, "kind": kind, "cell_key": key, "git_sha": sha,
                   "config": cfg_dict}
        summary.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        path = run_dir(root, kind, name, key, sha)
        summary = write(path, kind, summary, rows, cfg_dict, nll)
    return Outcome(summary, path, False)


def summaries(dirs: Iterable[str | os.PathLike], kind: str = "run") -> list[dict]:
    """Every finished run of ``kind`` under ``dirs`` (searched recursively), each with ``_dir``; a killed run's
    hidden staging directory is not a run."""
    k = kind_of(kind)
    out = []
    for d in dirs:
        for f in sorted(Path(d).rglob(k.summary)):
            if any(part.startswith(".") for part in f.relative_to(d).parts[:-1]):
                continue
            s = read_summary(f)
            if s is not None:
                out.append({**s, "_dir": str(f.parent)})
    return out


def newest_per_cell(runs: list[dict]) -> list[dict]:
    """One run per ``cell_key`` (the newest), in the order of first appearance; runs without a key stay."""
    best: dict[str, dict] = {}
    order: list[str] = []
    for i, s in enumerate(runs):
        key = s.get("cell_key") or f"#{i}"
        if key not in best:
            order.append(key)
            best[key] = s
        elif str(s.get("created", "")) > str(best[key].get("created", "")):
            best[key] = s
    return [best[k] for k in order]
