"""What mutated streams do to every compressor's decoder, published from evidence: results/reliability.md.

One command, at a clean commit (the evidence records the commit; a dirty tree is refused before anything runs):

    .venv/bin/python scripts/reliability.py [--examples N] [--allow-mixed] [--keep-tally FILE]

runs the dedicated fuzz run, ``pytest -m fuzz tests/test_fuzz_streams.py`` (every compressor and variant of
tests/stream_cases.py: a fixed number of distinct section mutations behind a valid frame reach its decoder, frame
mutations are tallied apart; ``--examples N``: N for every compressor instead, a trial the page then states), with
the tests' tally (``KVBENCH_FUZZ_TALLY``); files one run of kind ``reliability`` per compressor and variant (its
counts in ``reliability.json``, one row per mutation) under results/sweeps/reliability/runs/; exports them as the
evidence of study ``reliability`` (results/evidence/reliability/); registers results/reliability.md in
results/evidence/pages.json with its source results/evidence/pages/reliability.md, unless it is registered; and
rebuilds the page and its report section (results/report/reliability/) from the evidence alone, as
``python -m kvbench report --check`` does to compare them.

Exits non-zero when a fuzz test failed (the runs, the evidence and the page are written all the same and show it
in the page's failures and tests-passed columns), when the code changed while the tests ran (nothing is filed), or
when nothing could be published. The dedicated run took 9.6 minutes on two shared cores (load about seven).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

from kvbench.report.evidence import MixedCodeVersions, evidence_root, export
from kvbench.report.pages import SOURCES, register, registry, write_pages
from kvbench.store.paths import repo_root, results_root
from kvbench.store.results import cell_key, git_sha, run_dir, write

STUDY = "reliability"
PAGE = "reliability.md"
TEST = "tests/test_fuzz_streams.py"
#: the tally's tests whose lines are counted (the oracle's test of itself is not)
COUNTED = ("frame", "sections")
REJECTED = {"rejected: BitstreamError": "rejected_bitstream_error", "rejected: ValueError": "rejected_value_error"}
IDENTICAL = "no-op: decodes as the original"
DIFFERENTLY = ("decoded: another valid stream", "decoded: known limit")
KNOWN_LIMIT = "decoded: known limit"
FAILURE = "failure"
#: the tally's outcome of a section mutation a frame would refuse (tests/test_fuzz_streams.py: FRAME_REFUSED)
FRAME_REFUSED = "refused by a frame"


def run_fuzz(tally: Path, examples: int | None) -> tuple[dict[str, tuple[bool, float]], float]:
    """The dedicated fuzz run with its tally written to ``tally``: per case whether its tests passed and their
    seconds, and the minutes the whole run took."""
    env = {**os.environ, "KVBENCH_FUZZ_TALLY": str(tally)}
    env.pop("KVBENCH_FUZZ_EXAMPLES", None)
    if examples is not None:
        env["KVBENCH_FUZZ_EXAMPLES"] = str(examples)
    junit = tally.with_suffix(".xml")
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "fuzz", f"--junitxml={junit}",
                    TEST], cwd=repo_root(), env=env)
    return passed_per_case(junit), (time.monotonic() - start) / 60


def passed_per_case(junit: Path) -> dict[str, tuple[bool, float]]:
    """Whether every test of a case (the parameter in ``test[...]``) passed, and their seconds, from pytest's JUnit
    XML."""
    out: dict[str, tuple[bool, float]] = {}
    if not junit.exists():  # pytest did not get as far as writing it: no test counts as passed
        return out
    for case in ET.parse(junit).iter("testcase"):
        name = case.get("name", "")
        if "[" not in name:
            continue
        param = name[name.index("[") + 1:-1]
        bad = any(case.find(tag) is not None for tag in ("failure", "error", "skipped"))
        ok, seconds = out.get(param, (True, 0.0))
        out[param] = (ok and not bad, seconds + float(case.get("time") or 0))
    return out


def read_tally(path: Path) -> list[dict]:
    """The tally's lines (one JSON object each)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mutation_rows(lines: list[dict]) -> list[dict]:
    """One row per mutation tried: how many, and what became of them."""
    by_op: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for r in lines:
        c = by_op[(r["kind"], r["op"])]  # kind: frame, structure or payload
        c["mutation_n"] += 1
        c["mutation_rejected"] += r["outcome"] in REJECTED
        c["mutation_identical"] += r["outcome"] == IDENTICAL
        c["mutation_differently"] += r["outcome"] in DIFFERENTLY
        c["mutation_failures"] += r["outcome"] == FAILURE
    return [{"mutation": op, "mutation_class": klass, **{k: int(c[k]) for k in (
        "mutation_n", "mutation_rejected", "mutation_identical", "mutation_differently", "mutation_failures")}}
            for (klass, op), c in sorted(by_op.items())]


def summaries(tally: list[dict], passed: dict[str, tuple[bool, float]]) -> dict[str, tuple[dict, list[dict], dict]]:
    """Per case of the tally, ``(summary, rows, config)`` of its reliability run: the config says what was asked
    (the case, its compressor config and overrides, the counts), the summary what the decoders did."""
    cases: dict[str, dict] = {}
    lines: dict[str, list[dict]] = defaultdict(list)
    for r in tally:
        if r["test"] == "case":
            asked = cases.setdefault(r["compressor"], {**{k: r[k] for k in ("config", "overrides", "content_check",
                                                                          "stream_bytes")}, "reach": 0, "frame": 0})
            asked["reach"] = max(asked["reach"], r["reach"])
            asked["frame"] = max(asked["frame"], r["frame"])
        elif r["test"] in COUNTED and r["outcome"] != FRAME_REFUSED:
            lines[r["compressor"]].append(r)
    unknown = sorted(set(lines) - set(cases))
    if unknown:
        raise ValueError(f"the tally has mutations of {unknown} but no line saying what was asked of them")
    out = {}
    for name, asked in sorted(cases.items()):
        rows = lines[name]
        frame = [r for r in rows if r["test"] == "frame"]
        reached = [r for r in rows if r["test"] == "sections"]
        if len({r["stream"] for r in reached}) != len(reached):
            raise ValueError(f"{name}: the tally counts a mutated stream twice")
        outcomes = Counter(r["outcome"] for r in reached)
        config = {"study": STUDY, "case": name, "config": asked["config"], "overrides": asked["overrides"],
                  "reach_asked": asked["reach"], "frame_asked": asked["frame"]}
        summary = {
            "compressor": asked["config"],
            "case": name,
            "overrides": asked["overrides"],
            "content_check": asked["content_check"],
            "stream_bytes": asked["stream_bytes"],
            "reach_asked": asked["reach"],
            "frame_mutations": len(frame),
            "frame_rejected": sum(r["outcome"] in REJECTED for r in frame),
            "reached_decoder": len(reached),
            **{key: outcomes[o] for o, key in REJECTED.items()},
            "rejected": sum(outcomes[o] for o in REJECTED),
            "decoded_identical": outcomes[IDENTICAL],
            "decoded_differently": sum(outcomes[o] for o in DIFFERENTLY),
            "known_limit": outcomes[KNOWN_LIMIT],
            "failures": sum(r["outcome"] == FAILURE for r in rows),
            "tests_passed": passed.get(name, (False, 0.0))[0],
            "tests_s": round(passed.get(name, (False, 0.0))[1], 1),
            "rows": _mutation_rows(rows),
        }
        out[name] = (summary, summary["rows"], config)
    return out


def file_runs(found: dict[str, tuple[dict, list[dict], dict]], root: Path, sha: str) -> list[Path]:
    """Write each case's run, measured at code version ``sha``, under ``root``/runs (as every command files its
    runs) and return their directories."""
    created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    dirs = []
    for name, (summary, rows, config) in found.items():
        key = cell_key(config)
        path = run_dir(root, STUDY, name.replace("/", "+"), key, sha)
        write(path, STUDY, {**summary, "kind": STUDY, "cell_key": key, "git_sha": sha, "created": created,
                            "config": config}, rows, config)
        dirs.append(path)
    return dirs


def publish(dirs: list[Path], results: Path, allow_mixed: bool, wall_min: float | None) -> int:
    """Export the runs as the study's evidence, register the page if it is not, rebuild it; 0 when it built."""
    try:
        evidence = export(STUDY, dirs, results, allow_mixed=allow_mixed, wall_min=wall_min)
    except MixedCodeVersions as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"evidence: {len(dirs)} runs -> {evidence}")
    source = evidence_root(results) / SOURCES / PAGE
    if not source.exists():
        print(f"error: the page's source {source} is missing (it is committed with the repository)", file=sys.stderr)
        return 1
    if PAGE not in registry(results):
        register(PAGE, results, study=STUDY, report=f"report/{STUDY}")
    (built,) = write_pages(results, [PAGE])
    problems = built.errors + [f"{built.page.source}:{ln}: {w!r} typed by hand, not a reference"
                               for ln, w in built.literals]
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if built.text is None or problems:
        return 1
    print(f"-> {results_root(results) / PAGE}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=None,
                    help="distinct mutated streams to reach every decoder (default: the dedicated run's count)")
    ap.add_argument("--allow-mixed", action="store_true",
                    help="publish from a dirty tree (the evidence and the page say so)")
    ap.add_argument("--keep-tally", type=Path, default=None, help="also keep the tests' tally (JSON lines) here")
    args = ap.parse_args(argv)
    sha = git_sha()
    if (sha.endswith("-dirty") or sha == "unknown") and not args.allow_mixed:
        print(f"error: the code version is {sha}: commit first (the evidence records one clean commit), or pass "
              "--allow-mixed, which the page then states", file=sys.stderr)
        return 1
    results = results_root()
    with tempfile.TemporaryDirectory(prefix="kvbench-reliability-") as tmp:
        tally = Path(tmp) / "tally.jsonl"
        passed, wall_min = run_fuzz(tally, args.examples)
        if not tally.exists():
            print("error: the fuzz run wrote no tally", file=sys.stderr)
            return 1
        if args.keep_tally:
            args.keep_tally.write_bytes(tally.read_bytes())
        found = summaries(read_tally(tally), passed)
    print(f"fuzz run: {len(found)} compressors and variants in {wall_min:.1f} min")
    if git_sha() != sha:  # the tests ran from files that changed under them: no one code version measured
        print(f"error: the code changed during the run ({sha} -> {git_sha()}); nothing is filed", file=sys.stderr)
        return 1
    dirs = file_runs(found, results / "sweeps" / STUDY, sha)
    status = publish(dirs, results, args.allow_mixed, round(wall_min, 1))
    failed = sorted(n for n, (s, _, _) in found.items() if not s["tests_passed"] or s["failures"])
    if failed:
        print(f"fuzz tests failed for {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else status


if __name__ == "__main__":
    sys.exit(main())
