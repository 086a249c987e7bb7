"""results/reliability.md from evidence: the fuzz tests' tally becomes one reliability run per compressor
(scripts/reliability.py) that counts only distinct mutations behind a valid frame as reaching the decoder, the runs
become the study's evidence, and the registered page rebuilds from it and passes ``report --check``."""

from __future__ import annotations

import importlib.util
import json
import shutil
from types import SimpleNamespace

import pytest
from test_fuzz_streams import DEDICATED, DEFAULT, FRAME_REFUSED, SLOW, targets

from kvbench.report.check import check
from kvbench.report.evidence import load
from kvbench.store.paths import repo_root

SOURCE = repo_root() / "results" / "evidence" / "pages" / "reliability.md"
#: the compressors the page's findings name, and one whose format has a content check
CASES = ("identity", "fp8", "kivi", "lossless", "delta", "delta/laplace", "recompute", "speculative", "waterfill", "kvtc")


def _script():
    spec = importlib.util.spec_from_file_location("reliability_script", repo_root() / "scripts" / "reliability.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tally(case: str, reach: int = 6, checked: bool = False) -> list[dict]:
    """A tally as the fuzz tests write it for ``case``: its two ``case`` lines, four frame mutations, ``reach``
    section mutations (half rejected, a third decoded as the original, the rest to another cache) and one section
    mutation a frame refused, which does not count."""
    config, _, variant = case.partition("/")
    head = {"compressor": case, "test": "case", "config": config, "overrides": [f"compressor.coder={variant}"] if
            variant else [], "content_check": checked, "stream_bytes": 100}
    lines = [{**head, "of": "frame", "reach": 0, "frame": 4}, {**head, "of": "sections", "reach": reach, "frame": 0}]
    lines += [{"compressor": case, "test": "frame", "op": op, "kind": "frame", "section": "", "stream": f"f{i}",
               "outcome": "rejected: BitstreamError"} for i, op in enumerate(["flip", "flip", "truncate", "extend"])]
    outcomes = ["rejected: BitstreamError", "rejected: ValueError", "no-op: decodes as the original",
                "decoded: another valid stream" if not checked else "rejected: BitstreamError"]
    lines += [{"compressor": case, "test": "sections", "op": "flip" if i % 2 else "drop",
               "kind": "payload" if i % 2 else "structure", "section": "k", "stream": f"s{i}",
               "outcome": outcomes[i % 4]} for i in range(reach)]
    lines.append({"compressor": case, "test": "sections", "op": "add", "kind": "structure", "section": "extra",
                  "stream": "x", "outcome": FRAME_REFUSED})
    lines.append({"compressor": case, "test": "oracle", "op": "add", "kind": "structure", "section": "extra",
                  "stream": "o", "outcome": "no-op: decodes as the original"})
    return lines


def test_only_distinct_mutations_behind_a_valid_frame_count_as_reaching_the_decoder():
    script = _script()
    found = script.summaries(tally("identity", reach=8), {"identity": (True, 1.5)})
    summary, rows, config = found["identity"]
    assert summary["frame_mutations"] == summary["frame_rejected"] == 4
    assert summary["reached_decoder"] == 8 and summary["reach_asked"] == 8  # not the frame-refused one, nor the oracle's
    assert (summary["rejected_bitstream_error"], summary["rejected_value_error"], summary["rejected"]) == (2, 2, 4)
    assert (summary["decoded_identical"], summary["decoded_differently"], summary["failures"]) == (2, 2, 0)
    assert summary["tests_passed"] and summary["tests_s"] == 1.5 and not summary["content_check"]
    assert {(r["mutation_class"], r["mutation"]): r["mutation_n"] for r in rows} == {
        ("frame", "extend"): 1, ("frame", "flip"): 2, ("frame", "truncate"): 1, ("payload", "flip"): 4,
        ("structure", "drop"): 4}
    assert config["case"] == "identity" and config["reach_asked"] == 8
    twice = tally("identity")
    twice.append(dict(twice[-3]))  # the same mutated stream tallied again
    with pytest.raises(ValueError, match="counts a mutated stream twice"):
        script.summaries(twice, {})
    assert not script.summaries(tally("identity"), {})["identity"][0]["tests_passed"]  # no JUnit line: not passed


def test_the_dedicated_run_asks_for_the_published_count_and_make_test_for_fewer(monkeypatch):
    monkeypatch.delenv("KVBENCH_FUZZ_EXAMPLES", raising=False)
    run = lambda expr: SimpleNamespace(option=SimpleNamespace(markexpr=expr))  # noqa: E731
    assert targets(run("fuzz"), "recompute") == (DEDICATED, DEDICATED // 2) and DEDICATED >= 200
    assert targets(run(""), "identity") == (DEFAULT, DEFAULT // 2)
    assert targets(run("not integration"), "recompute") == (SLOW["recompute"], DEFAULT // 2)
    monkeypatch.setenv("KVBENCH_FUZZ_EXAMPLES", "7")
    assert targets(run(""), "recompute") == targets(run("fuzz"), "identity") == (7, 3)


def test_the_page_is_rebuilt_from_the_reliability_evidence_and_passes_the_check(tmp_path, capsys):
    script = _script()
    root = tmp_path / "results"
    lines = [line for case in CASES for line in tally(case, checked=case in ("recompute", "speculative"))]
    found = script.summaries(lines, {case: (True, 2.0) for case in CASES})
    (root / "evidence" / "pages").mkdir(parents=True)
    shutil.copy(SOURCE, root / "evidence" / "pages" / "reliability.md")
    dirty = script.file_runs(found, tmp_path / "sweeps", "0123456789abcdef-dirty")
    assert script.publish(dirty, root, allow_mixed=False, wall_min=None) == 1  # a dirty tree is not published
    assert "dirty" in capsys.readouterr().err and not (root / "reliability.md").exists()
    dirs = script.file_runs(found, tmp_path / "sweeps", "0123456789abcdef")
    assert sorted(json.loads((d / "reliability.json").read_text())["case"] for d in dirs) == sorted(CASES)
    assert script.publish(dirs, root, allow_mixed=False, wall_min=0.1) == 0
    shutil.rmtree(tmp_path / "sweeps")  # the page needs the evidence only
    text = (root / "reliability.md").read_text()
    assert "each compressor's test decodes\n  6 distinct mutated streams" in text
    # per compressor: frame mutations and refused, reached, rejected (BitstreamError, ValueError), decoded as the
    # original, to another cache and its share of those reached, known limit, failures, tests passed and seconds
    assert "| recompute | True | 4 | 4 | 6 | 3 | 2 | 1 | 0 | 0.0% | 0 | 0 | True | 2.0 |" in text
    assert "| identity | False | 4 | 4 | 6 | 2 | 2 | 1 | 1 | 16.7% | 0 | 0 | True | 2.0 |" in text
    assert "recompute's decoder,\n  5 were rejected,\n  1 decoded as the original and\n  0 to another cache" in text
    assert load("reliability", root).runs == len(CASES) and "at commit `0123456` " in text
    assert json.loads((root / "evidence" / "pages.json").read_text())["reliability.md"]["study"] == "reliability"
    outcomes = {o.page.rsplit("/", 1)[-1]: o for o in check(root, pages=[root / "reliability.md"])}
    assert outcomes["reliability.md"].status == "ok", outcomes["reliability.md"].lines
    # a changed count in the evidence is a different page
    run = next(d for d in (root / "evidence" / "reliability").iterdir() if d.name.startswith("reliability-identity"))
    summary = json.loads((run / "reliability.json").read_text())
    (run / "reliability.json").write_text(json.dumps({**summary, "decoded_differently": 3}))
    assert check(root, pages=[root / "reliability.md"])[0].status == "differs"
