"""`kvbench bound`: the paper's per-vector arithmetic, the measured bound and the runs table."""

import json
import math

import pytest

from kvbench.report.bound import (
    PAPER_BOUND_BITS,
    SEVENTY_B,
    AttentionShape,
    arithmetic_rows,
    build_report,
    main,
    measured_bound,
    per_vector_bits,
    runs_table,
)


def test_the_papers_70b_figures():
    assert per_vector_bits(SEVENTY_B, 3, SEVENTY_B.heads) == 3_932_160
    assert round(per_vector_bits(SEVENTY_B, 3, SEVENTY_B.heads) / PAPER_BOUND_BITS, -3) == 914_000
    assert per_vector_bits(SEVENTY_B, 3, SEVENTY_B.kv_heads) == 491_520
    assert round(per_vector_bits(SEVENTY_B, 3, SEVENTY_B.kv_heads) / PAPER_BOUND_BITS, -3) == 114_000


def test_arithmetic_rows_count_query_and_kv_heads():
    smol = AttentionShape("smollm2", 30, 9, 3, 64)
    rows = arithmetic_rows(smol, [16, 3], measured=5.0)
    assert [r["counted"] for r in rows] == ["9 query heads"] * 2 + ["3 KV heads"] * 2
    assert [r["bits/token"] for r in rows] == [16 * 64 * 2 * 9 * 30, 3 * 64 * 2 * 9 * 30, 16 * 64 * 2 * 3 * 30, 11520 * 3]
    assert rows[3]["x measured bound"] == 11520 * 3 / 5.0
    assert rows[3]["x paper bound (4.3)"] == pytest.approx(34560 / 4.3)
    assert math.isnan(arithmetic_rows(smol, [3], measured=None)[0]["x measured bound"])


def _fake_run(root, name, compressor, bpt, bound, **extra):
    d = root / name
    d.mkdir(parents=True)
    summary = {"compressor": compressor, "model": "smollm2_135m", "dataset": "sotu", "dtype": "float16",
               "n_tokens": 4096, "n_sequences": 4, "bits_per_token": bpt, "bound_bits_per_token": bound,
               "compression_ratio": 184320 / bpt, "lossless": True, "decode_s": 1.5, **extra}
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def test_runs_table_from_fake_summaries(tmp_path):
    _fake_run(tmp_path / "a", "lossless-1", "lossless", 150000.0, 5.0, compressor_params={"name": "lossless", "coder": "range"})
    _fake_run(tmp_path / "a", "recompute-1", "recompute", 5.1, 5.0)
    _fake_run(tmp_path / "b", "kivi-1", "kivi", 53000.0, 5.0)
    (tmp_path / "b" / "broken-1").mkdir()
    (tmp_path / "b" / "broken-1" / "summary.json").write_text("{not json")
    md, skipped, n = runs_table([tmp_path / "a", tmp_path / "b"])
    assert n == 3
    lines = [ln for ln in md.splitlines() if ln.startswith("| smollm2")]
    assert [ln.split("|")[4].strip() for ln in lines] == ["recompute", "kivi", "lossless"]  # by bits/token
    assert "| 1.020 |" in lines[0]  # 5.1 / 5.0
    assert "coder=range" in lines[2]
    assert [p.name for p, _ in skipped] == ["broken-1"]
    empty, _, zero = runs_table([tmp_path / "nowhere"])
    assert zero == 0 and "no runs" in empty


def test_report_on_the_tiny_model(tiny_cfg, tiny_handle, tmp_path):
    cfg = tiny_cfg()
    shape, h_bits, n = measured_bound(cfg, tiny_handle)
    assert (shape.layers, shape.heads, shape.kv_heads, shape.head_dim) == (2, 4, 2, 16)
    assert n == 2 * 63 and 0 < h_bits < 8  # 2 eval windows of 64 tokens; a 128-symbol vocabulary
    _fake_run(tmp_path / "runs", "recompute-1", "recompute", h_bits * 1.01, h_bits)
    text = build_report(cfg, [tmp_path / "runs"], [16, 3], tiny_handle)
    assert f"**{h_bits:.3f} bits/token**" in text
    assert "| 4 query heads | 3 | 768 |" in text  # 3 x 16 x 2 x 4 x 2
    assert "| 70B-class (paper) | 64 query heads | 3 | 3,932,160 | 914,456 |" in text
    assert "| 70B-class (paper) | 8 KV heads | 3 | 491,520 | 114,307 |" in text
    assert "| recompute |" in text and "| 1.010 |" in text


def test_cli_errors_exit_2(capsys):
    assert main(["--bits", "three"]) == 2
    assert "--bits" in capsys.readouterr().err
    assert main(["no_such_key=1"]) == 2
