"""``python -m kvbench report --check``: pages rebuilt from synthetic committed evidence pass it; a page edited by
hand, a figure typed into hand-written text, a reference that selects no run or several, runs of mixed code
versions, a per-token NLL edited under a run's summary and two copies of one run that differ fail it; a page without
evidence passes only by saying so. The committed pages pass it."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from evidence_cases import per_vector_cells, write_run

from kvbench.report import refs
from kvbench.report.check import FAILED, check, summary
from kvbench.report.evidence import export, load
from kvbench.report.pages import NOT_BACKED, build, register, source_from_page, write_pages

SOURCE = """# Per-vector quantizers

TurboQuant_mse at {{ per_vector: compressor.variant=mse compressor.bits=2.5 | bits_per_element }} bits per element
changes the held-out NLL by {{ per_vector: compressor.variant=mse compressor.bits=2.5 | delta_nll_ci }} nats (95%
interval), on windows whose base NLL is {{ per_vector: * | nll_base .2f }} nats in every run.

<!-- generated:per_vector (the table) -->
<!-- /generated -->

<!-- findings:per_vector (written by hand) -->
The 16-bit baseline of 2024 is 1st; within 1% at {{ per_vector: compressor.variant=prod | compression_ratio x }}x.
<!-- /findings -->
"""


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A results root with the per-vector study's evidence (four runs of one commit) and its page, registered and
    rebuilt from it."""
    root = tmp_path_factory.mktemp("published")
    runs = [write_run(root / "measured", c, i) for i, c in enumerate(per_vector_cells())]
    export("per_vector", runs, root, host="a test machine")
    (root / "per_vector.md").write_text(SOURCE)
    register("per_vector.md", root)
    (built,) = write_pages(root, formats=("png",))
    assert not built.errors and not built.literals
    shutil.rmtree(root / "measured")  # the check needs no runs folder
    return root


def _copy(published, tmp_path):
    root = tmp_path / "results"
    shutil.copytree(published, root)
    return root


def _failures(root):
    return [o for o in check(root, pages=sorted(root.glob("*.md"))) if o.status in FAILED]


def test_a_page_rebuilt_from_its_evidence_passes_the_check(published):
    text = (published / "per_vector.md").read_text()
    # the references render the selected run's figures; the header names the commit and the evidence
    assert "TurboQuant_mse at 3.000 bits per element" in text  # run 1: 2 + 1 bits
    (lo, hi), = [s["delta_nll_ci"] for s in map(json.loads, map(Path.read_text, published.glob("evidence/*/*/summary.json")))
                 if s["bits_per_element"] == 3.0]
    assert f"by [{lo:+.4f}, {hi:+.4f}] nats" in text and "base NLL is 3.25 nats" in text
    assert "within 1% at 3.20x." in text  # run 3 (prod): 16 / 5 bits, as a ratio
    assert "measured at commit `aaaaaaa` up to 2026-01-04 on a test machine" in text
    assert "| turboquant variant=mse | 2.5 | 3.000 |" in text  # the generated table
    outcomes = check(published, pages=sorted(published.glob("*.md")))
    assert [(o.status, o.page.endswith("per_vector.md")) for o in outcomes] == [("ok", True)], summary(outcomes)
    assert (published / "report" / "per_vector.csv").exists()  # the data behind its figure is compared too


def test_a_page_edited_by_hand_fails_the_check_with_a_diff(published, tmp_path):
    root = _copy(published, tmp_path)
    page = root / "per_vector.md"
    page.write_text(page.read_text().replace("| turboquant variant=mse | 2.5 | 3.000 |", "| turboquant variant=mse | 2.5 | 2.900 |"))
    (failed,) = _failures(root)
    assert failed.status == "differs"
    assert "-| turboquant variant=mse | 2.5 | 2.900 |" in "\n".join(failed.lines)
    assert "+| turboquant variant=mse | 2.5 | 3.000 |" in "\n".join(failed.lines)
    # so does the data behind a figure
    root = _copy(published, tmp_path / "again")
    csv = root / "report" / "per_vector.csv"
    csv.write_text(csv.read_text().replace("3.0,", "2.9,", 1))
    (failed,) = _failures(root)
    assert failed.status == "differs" and any("per_vector.csv (committed)" in ln for ln in failed.lines)


def test_a_figure_typed_into_a_findings_block_fails_the_check(published, tmp_path):
    root = _copy(published, tmp_path)
    source = root / "evidence" / "pages" / "per_vector.md"
    source.write_text(source.read_text().replace("The 16-bit baseline", "At 2.13 bits/elt (6,680x, 31% less) the "
                                                 "16-bit baseline"))
    write_pages(root, formats=())  # rebuilt, the page matches its source: only the typed figures fail
    (failed,) = _failures(root)
    assert failed.status == "figures"
    assert [ln.split(":")[2].split()[0] for ln in failed.lines] == ["'2.13'", "'6,680x'", "'31%'"]


def test_a_typed_figure_is_named_by_its_line_in_the_source_file(published, tmp_path):
    root = _copy(published, tmp_path)
    source = root / "evidence" / "pages" / "per_vector.md"
    source.write_text(source.read_text().replace("The 16-bit baseline", "At 2.13 bits the 16-bit baseline"))
    page = json.loads((root / "evidence" / "pages.json").read_text())
    page["per_vector.md"]["literals"] = "findings"  # only the findings blocks are read for typed figures
    (root / "evidence" / "pages.json").write_text(json.dumps(page))
    (built,) = write_pages(root, formats=())
    line = next(i for i, ln in enumerate(source.read_text().split("\n"), 1) if "At 2.13 bits" in ln)
    assert line > 5 and built.literals == [(line, "2.13")]
    (failed,) = _failures(root)
    assert failed.lines[0].startswith(f"evidence/pages/per_vector.md:{line}: '2.13' is typed by hand")


def _edit_nll(run, key, i=3):
    """``run``'s nll.npz with value ``i`` of array ``key`` moved by one float32 step: the smallest edit there is."""
    f = run / "nll.npz"
    with np.load(f) as z:
        arrays = {k: z[k].copy() for k in z.files}
    arrays[key][i] = np.nextafter(arrays[key][i], np.float32(np.inf))
    np.savez_compressed(f, **arrays)


@pytest.mark.parametrize("key, field", [("compressed", "delta_nll"), ("base", "nll_base"),
                                        ("recall_compressed", "delta_nll_recall"), ("recall_base", "nll_recall_base")])
def test_one_per_token_nll_edited_under_a_summary_fails_the_check_naming_the_run_and_the_page(published, tmp_path,
                                                                                               key, field):
    root = _copy(published, tmp_path)
    run = sorted((root / "evidence" / "per_vector").glob("turboquant-*"))[1]
    _edit_nll(run, key)
    (failed,) = _failures(root)
    assert failed.status == "evidence" and failed.page.endswith("per_vector.md")
    assert any(ln.startswith(f"per_vector/{run.name}: {field}: ") and "recomputed from nll.npz, the summary says"
               in ln for ln in failed.lines), failed.lines
    assert f"EVIDENCE   {failed.page}" in summary([failed])


def test_a_summary_edited_above_its_per_token_nlls_fails_the_check(published, tmp_path):
    root = _copy(published, tmp_path)
    run = sorted((root / "evidence" / "per_vector").glob("turboquant-*"))[2]
    s = json.loads((run / "summary.json").read_text())
    other = next(v for v in ("within", "not within", "unresolved") if v != s["delta_nll_verdict_1pct"])
    (run / "summary.json").write_text(json.dumps({**s, "delta_nll_verdict_1pct": other}))
    (failed,) = _failures(root)
    assert failed.status == "evidence"
    assert any("delta_nll_verdict_1pct: " in ln and f"the summary says {other!r}" in ln for ln in failed.lines)


def test_a_run_measured_before_the_recall_arrays_were_stored_is_noted_not_failed(published, tmp_path):
    root = _copy(published, tmp_path)
    run = sorted((root / "evidence" / "per_vector").glob("turboquant-*"))[0]
    with np.load(run / "nll.npz") as z:
        np.savez_compressed(run / "nll.npz", **{k: z[k] for k in ("base", "compressed", "offsets")})
    s = json.loads((run / "summary.json").read_text())  # a run of that time recorded no file hashes either
    (run / "summary.json").write_text(json.dumps({k: v for k, v in s.items() if k != "file_sha256"}))
    (outcome,) = check(root, pages=sorted(root.glob("*.md")))
    assert outcome.status == "ok" and outcome.notes == [
        f"per_vector: recall probe not recomputed: its nll.npz holds no recall arrays (1 run: {run.name})"]
    assert f"note: {outcome.notes[0]}" in summary([outcome])


def test_two_studies_copies_of_one_run_must_be_the_same_bytes(published, tmp_path):
    root = _copy(published, tmp_path)
    shutil.copytree(root / "evidence" / "per_vector", root / "evidence" / "other")
    assert _failures(root) == []  # identical copies
    run = sorted((root / "evidence" / "other").glob("turboquant-*"))[0]
    s = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**s, "rel_mse_k": 0.5}))  # no NLL figure: only the copies differ
    failed = _failures(root)
    assert [(o.status, o.page.rsplit("/", 1)[-1]) for o in failed] == [("evidence", "per_vector.md"),
                                                                       ("evidence", "other")]
    assert all(o.lines == [f"run {run.name}: its copies in other/ and per_vector/ differ (summary.json); a run "
                           "published by two studies must be the same bytes in both"] for o in failed)
    assert "1 page(s) rebuilt from evidence; 2 failed" in summary(check(root, pages=sorted(root.glob("*.md"))))


@pytest.mark.parametrize("text, figures", [
    ("within 1% of the base NLL, a 95% interval, in 2024, 16-bit KV, the 2nd model (arXiv 2501.19392)", []),
    ("1. first item\n## 2. Section\n- `compressor.bits=2 dataset.seq_len=1024` on SmolLM2-135M, gemma3_270m, fp8", []),
    ("{{ s: a=1 | x .2f }} and <!-- 3.14 --> and ![fig](report/figures/f_2.png)", []),
    ("2.126 against 3.092 is 31% less; 18,792x; +0.0042 [-0.0025, +0.0106]; 0.82-2.93 Gbit/s",
     ["2.126", "3.092", "31%", "18,792x", "+0.0042", "-0.0025", "+0.0106", "0.82-2.93"]),
    ("`2.13` bits, 5.3x, 1.29× the bound, ~10 tokens/s, dNLL=0.004", ["2.13", "5.3x", "1.29×", "10", "0.004"]),
])
def test_literal_figures_are_the_numbers_that_are_not_on_the_allow_list(text, figures):
    assert [f for _, f in refs.literal_figures(text)] == figures


def test_a_reference_selects_exactly_one_run_and_names_the_matches_otherwise(published):
    got = load("per_vector", published).got

    def render(text):
        return refs.render(text, lambda study: got)

    assert render("{{ per_vector: compressor.variant=prod compressor.bits=2 | bits_per_element .1f }}") == ("5.0", [])
    assert render("{{ per_vector: cfg.compressor.variant=mse compressor_params.bits=3 | delta_nll +.3f }}") == \
        ("+0.020", [])
    _, (err,) = render("{{ per_vector: compressor.variant=mse | delta_nll }}")
    assert "selects 3 rows of per_vector/runs, not one" in err and err.count("turboquant-") == 3
    _, (err,) = render("{{ per_vector: compressor.variant=mse compressor.bits=4 | delta_nll }}")
    assert "selects no row" in err and "compressor.bits=4" in err and "(their compressor.bits: 2, 2.5, 3)" in err
    _, (err,) = render("{{ per_vector: * | delta_nll }}")  # '*' takes several rows only when they agree
    assert "the 4 rows selected differ in delta_nll" in err
    _, (err,) = render("{{ per_vector: compressor.varaint=mse | delta_nll }}")
    assert "no field 'compressor.varaint'" in err
    _, (err,) = render("{{ per_vector compressor.bits=2 | delta_nll }}")
    assert "a reference is" in err
    # in a code span or fence it is an example of the syntax, shown as written
    example = "`{{ nothing: compressor=kivi | delta_nll }}` and\n```\n{{ nothing: * | x }}\n```"
    assert render(example) == (example, [])


def test_a_reference_that_fails_fails_the_check(published, tmp_path):
    root = _copy(published, tmp_path)
    source = root / "evidence" / "pages" / "per_vector.md"
    source.write_text(source.read_text().replace("compressor.variant=prod", "compressor.bits=2"))
    (failed,) = _failures(root)
    assert failed.status == "error" and "selects 2 rows of per_vector/runs, not one" in failed.lines[0]


def test_runs_of_several_code_versions_are_published_only_with_allow_mixed_which_the_page_states(tmp_path):
    cells = per_vector_cells()
    runs = [write_run(tmp_path / "measured", c, i, sha=s * 40) for i, (c, s) in enumerate(zip(cells, "aabb"))]
    root = tmp_path / "results"
    with pytest.raises(ValueError, match="several code versions"):
        export("per_vector", runs, root)
    export("per_vector", runs, root, allow_mixed=True)
    (root / "per_vector.md").write_text(SOURCE)
    register("per_vector.md", root)
    (built,) = write_pages(root, formats=())
    assert "measured at commit `mixed: aaaaaaa (2 runs), bbbbbbb (2 runs)` (published with `--allow-mixed`)" \
        in built.text
    assert _failures(root) == []
    # a manifest edited to take the permission back: the page no longer builds
    manifest = root / "evidence" / "per_vector" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "allow_mixed": False}))
    (failed,) = _failures(root)
    assert failed.status == "error" and "several code versions" in failed.lines[0]


def test_a_page_registered_from_its_old_text_keeps_what_is_hand_written():
    old = (f"# Old\n\n{NOT_BACKED}\n\nProse.\n\n<!-- generated:per_vector (old) -->\n| a | b |\n"
           "<!-- /generated -->\n")
    assert source_from_page(old) == "# Old\n\nProse.\n\n<!-- generated:per_vector (old) -->\n<!-- /generated -->\n"


def test_a_page_without_evidence_is_not_checked_and_must_say_so(tmp_path):
    (tmp_path / "old.md").write_text(f"# Old findings\n\n{NOT_BACKED}\n\nKIVI at 2.13 bits.\n")
    (tmp_path / "silent.md").write_text("# Silent\n\nKIVI at 2.13 bits.\n")
    outcomes = check(tmp_path, pages=sorted(tmp_path.glob("*.md")))
    assert [(o.page.rsplit("/", 1)[-1], o.status) for o in outcomes] == [("old.md", "not checked"),
                                                                        ("silent.md", "unmarked")]
    assert "not checked (no committed evidence; each page says so)" in summary(outcomes)


def test_the_readme_is_rebuilt_from_its_study_evidence(tmp_path):
    cells = per_vector_cells()
    runs = [write_run(tmp_path / "measured", c, i) for i, c in enumerate(cells)]
    root = tmp_path / "results"
    export("reproduce", runs, root, host="a test machine", wall_min=58.0)
    (root / "README.md").write_text(
        "<!-- findings:answers (by hand) -->\nTurboQuant_prod stores "
        "{{ reproduce: compressor.variant=prod | bits_per_element .1f }} bits per element.\n<!-- /findings -->\n")
    page = register("README.md", root, study="reproduce")
    assert page.builder == "readme" and page.report == "report/readme"
    (built,) = write_pages(root, formats=())
    assert built.errors == [] and built.literals == []
    text = (root / "README.md").read_text()
    assert "Regenerated by `scripts/reproduce.sh` in 58 min of wall time on 2026-01-04 at commit `aaaaaaa`, on a " \
           "test machine. 4 runs under `evidence/reproduce`" in text
    assert "TurboQuant_prod stores 5.0 bits per element." in text
    assert (root / "report" / "readme" / "runs.md").exists()
    assert _failures(root) == []
    rebuilt = build(page, root, report_out=tmp_path / "elsewhere")
    assert rebuilt.text == text  # figure links point at the page's report folder, wherever the rebuild writes


def test_the_committed_pages_pass_the_check():
    """Every page under results/ and the README is rebuilt from committed evidence or says it is not."""
    outcomes = check()
    assert not [o for o in outcomes if o.status in FAILED], summary(outcomes)


def test_the_command_exits_1_on_a_failed_check_and_0_otherwise(published, tmp_path, monkeypatch, capsys):
    from kvbench.report.build import main

    root = _copy(published, tmp_path)
    monkeypatch.setenv("KVBENCH_RESULTS", str(root))
    assert main(["--check"]) == 0
    assert "ok         " in capsys.readouterr().out
    page = root / "per_vector.md"
    page.write_text(page.read_text().replace("3.000 bits per element", "3.0 bits per element"))
    assert main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "DIFFERS" in out and "-TurboQuant_mse at 3.0 bits per element" in out
    assert main(["--pages"]) == 0 and main(["--check"]) == 0  # rebuilt from the evidence, it matches again
    runs = [write_run(tmp_path / "measured", c, i) for i, c in enumerate(per_vector_cells()[:2])]
    assert main(["--export-evidence", "per_vector", str(tmp_path / "measured" / "runs")]) == 0
    assert sorted(p.name for p in (root / "evidence" / "per_vector").iterdir() if p.is_dir()) == \
        sorted(r.name for r in runs)
    assert main(["--check"]) == 1  # the page's references now select runs the evidence no longer holds


def test_a_page_can_show_a_section_of_several_tables(published, tmp_path):
    """The overview writes one table group per stem (runs, best points, ...): a page's overview block holds them all."""
    root = _copy(published, tmp_path)
    (root / "all_runs.md").write_text("# All runs\n\n<!-- generated:overview (every run) -->\n<!-- /generated -->\n")
    register("all_runs.md", root, study="per_vector")
    built = [b for b in write_pages(root, formats=("png",)) if b.page.name == "all_runs.md"]
    assert built and not built[0].errors
    text = (root / "all_runs.md").read_text()
    assert text.count("| model |") >= 2 and "| turboquant |" in text
