"""Restore-from-storage time to first token: the measurement on the tiny model, the TTFT arithmetic, the crossovers,
the projection and the plumbing (results layer, report figure)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from compressors.exact.identity import Identity
from compressors.exact.recompute import Recompute
from compressors.quantizers.kivi import KIVI
from compressors.quantizers.turboquant import TurboQuant
from kvbench.coding.bitstream import Bitstream
from kvbench.core.config import compose
from kvbench.core.kv import Context
from kvbench.inputs.models import ModelHandle
from kvbench.measure.restore import format_restore, measure_restore, session_kv, session_window
from kvbench.measure.restore_projection import Accelerator, Shape, project
from kvbench.measure.ttft import GBIT, Route, check_bandwidths, crossing, crossovers, faster_range, ttft_rows


@pytest.fixture()
def restore_cfg(tmp_path, text_file, monkeypatch):
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path / "home"))

    def make(*overrides: str):
        cfg = compose(["model=hf", "model.path=unused", "dataset=text", f"dataset.path={text_file}",
                       "dataset.seq_len=64", "dataset.eval_len=16", "dataset.n_sequences=1", "dataset.n_calib=1",
                       "restore.contexts=[48,96]", "restore.repeats=1", f"paths.results={tmp_path / 'results'}",
                       *overrides], config_name="restore")
        OmegaConf.set_struct(cfg, False)
        return cfg

    return make


@pytest.fixture(scope="module")
def handle():
    from conftest import CharTokenizer, tiny_llama

    return ModelHandle.from_loaded(tiny_llama(seed=3), CharTokenizer(),
                                   OmegaConf.create({"name": "hf", "source": "hf", "path": "unused"}))


def check_arithmetic(summary: dict, rows: list[dict]) -> None:
    """Every row's times from its own measured parts; the crossovers agree with which route is faster."""
    bws = summary["bandwidths_gbps"]
    want = [(m["context"], b) for m in summary["measured"] for b in bws]
    assert [(r["context"], r["bandwidth_gbps"]) for r in rows] == want
    for r in rows:
        bit_s = r["bandwidth_gbps"] * GBIT
        assert r["ttft_s"] == pytest.approx(r["bytes"] * 8 / bit_s + r["decode_s"] + r["first_token_s"], rel=1e-12)
        assert r["ttft_16bit_s"] == pytest.approx(r["bytes_16bit"] * 8 / bit_s + r["first_token_s"], rel=1e-12)
        assert r["ttft_prefill_s"] == pytest.approx(r["bytes_ids"] * 8 / bit_s + r["prefill_s"], rel=1e-12)
        times = {"compressed": r["ttft_s"], "16bit": r["ttft_16bit_s"], "prefill": r["ttft_prefill_s"]}
        assert times[r["fastest"]] == min(times.values())
        c = summary["crossovers"][str(r["context"])]
        for key, a, b in (("compressed_faster_than_16bit_gbps", "compressed", "16bit"),
                          ("compressed_faster_than_prefill_gbps", "compressed", "prefill"),
                          ("16bit_faster_than_prefill_gbps", "16bit", "prefill")):
            inside = c[key] is not None and c[key][0] < r["bandwidth_gbps"] < c[key][1]
            assert inside == (times[a] < times[b]), (key, r)
        best = c["compressed_fastest_gbps"]
        in_best = best is not None and best[0] < r["bandwidth_gbps"] < best[1]
        assert in_best == (times["compressed"] < min(times["16bit"], times["prefill"]))
    for m in summary["measured"]:  # at a crossing the two routes take the same time
        c = summary["crossovers"][str(m["context"])]
        comp = (m["decode_s"] + m["first_token_s"], m["bits"])
        for key, (fa, xa), (fb, xb) in (("crossover_16bit_gbps", comp, (m["first_token_s"], m["bits_16bit"])),
                                        ("crossover_prefill_gbps", comp, (m["prefill_s"], m["bits_ids"]))):
            if c[key] is not None:
                b = c[key] * GBIT
                assert fa + xa / b == pytest.approx(fb + xb / b, rel=1e-9)
        # the 16-bit crossing falls as decode time grows, so the median round's lies within the rounds' spread
        lo_hi = c["crossover_16bit_gbps_spread"]
        assert (c["crossover_16bit_gbps"] is None) == (lo_hi is None)
        if lo_hi is not None:
            assert lo_hi[0] <= c["crossover_16bit_gbps"] <= lo_hi[1]
    for r in rows:
        spread = summary["crossovers"][str(r["context"])]["crossover_16bit_gbps_spread"]
        assert [r["crossover_16bit_gbps_lo"], r["crossover_16bit_gbps_hi"]] == (spread or [r["crossover_16bit_gbps_lo"]] * 2)


def test_identity_restores_the_prefill_token_and_sends_its_counted_bits(restore_cfg, handle):
    cfg = restore_cfg()
    summary, rows = measure_restore(cfg, Identity(), handle)
    assert summary["contexts"] == [48, 96] and summary["notes"] == []
    assert len(rows) == 2 * 5 and summary["bandwidths_gbps"] == [1.0, 10.0, 25.0, 100.0, 200.0]
    window, _, _ = session_window(cfg, handle, [48, 96])
    for m in summary["measured"]:
        T = m["context"]
        kv = session_kv(handle.model, window[:T], torch.float16)
        # counted independently: the bytes the encoder writes, re-read as the decoder sees them
        bits = Bitstream.from_bytes(Identity().encode(kv, Context.for_kv(kv)).data).num_bits
        assert m["stream_bits"] == bits and m["codec_bits"] == 0 and m["bits"] == bits
        assert bits >= 16 * kv.n_elements and m["bits_16bit"] == 16 * kv.n_elements == 16 * 2 * 2 * 2 * T * 16
        assert m["bits_ids"] == T * 7  # 128 ids: 7 bits each
        assert m["exact"] and m["first_token"] == m["first_token_prefill"] == m["first_token_16bit"]
        assert m["first_token_matches_prefill"] and m["first_token_matches_16bit"]
        assert m["encode_s"] > 0 and m["decode_s"] > 0 and m["first_token_s"] > 0 and m["prefill_s"] > 0
        for name, times in m["repeat_s"].items():  # every round kept; the figure is their median
            assert len(times) == summary["repeats"] and m[f"{name}_s"] == sorted(times)[len(times) // 2]
    for r in rows:
        m = next(x for x in summary["measured"] if x["context"] == r["context"])
        assert r["bytes"] == m["bits"] / 8 and r["bytes_16bit"] == m["bits_16bit"] / 8
    # the frame makes identity a few bytes larger than raw 16-bit KV and decoding only adds time: never faster
    for c in summary["crossovers"].values():
        assert c["compressed_faster_than_16bit_gbps"] is None and c["crossover_16bit_gbps"] is None
    check_arithmetic(summary, rows)
    text = format_restore(summary)
    for word in ("MEASURED", "MODELLED", "PROJECTION", "llama3.1_70b", "fastest"):
        assert word in text


@pytest.mark.parametrize("compressor", [KIVI(bits=2, group_size=16, residual=0), TurboQuant(bits=3)],
                         ids=["kivi", "turboquant"])
def test_lossy_restore_sends_fewer_bytes(restore_cfg, handle, compressor):
    summary, rows = measure_restore(restore_cfg("restore.repeats=3"), compressor, handle)
    for m in summary["measured"]:
        assert not m["exact"] and m["bits"] < 0.4 * m["bits_16bit"]
        c = summary["crossovers"][str(m["context"])]
        # fewer bits and an added decode: faster than 16-bit below the crossing (if decode costs anything)
        assert c["compressed_faster_than_16bit_gbps"][0] == 0.0
        assert c["compressed_faster_than_16bit_gbps"][1] == (c["crossover_16bit_gbps"] or math.inf)
    check_arithmetic(summary, rows)
    proj = summary["projection"]
    assert "PROJECTION" in proj["label"] and set(proj["models"]) == {"llama3.1_8b", "llama3.1_70b"}
    p8 = proj["models"]["llama3.1_8b"]
    n_el = 2 * 32 * 8 * 128 * 32768
    assert p8["kv_elements"] == n_el and p8["bytes_16bit"] == 2 * n_el
    last = summary["measured"][-1]
    assert p8["bytes"] == pytest.approx(last["bits_per_element"] * n_el / 8)
    assert p8["decode_s"] == pytest.approx(n_el / last["decode_elements_per_s"])


def test_recompute_restores_exactly_and_is_not_projected(restore_cfg, handle):
    summary, rows = measure_restore(restore_cfg("restore.contexts=[24]"), Recompute(), handle)
    (m,) = summary["measured"]
    # the ids range-coded under the model, regenerated by the same prefill the session ran
    assert m["exact"] and m["first_token_matches_16bit"] and 0 < m["bits"] < m["bits_16bit"] / 50
    assert summary["projection"]["models"] == {} and "needs_model" in summary["projection"]["skipped"]
    check_arithmetic(summary, rows)


def test_contexts_are_clipped_to_positions_and_text(restore_cfg, handle, tmp_path):
    summary, _ = measure_restore(restore_cfg("restore.contexts=[48,600,900]", "restore.bandwidths_gbps=[10]"),
                                 Identity(), handle)
    assert summary["contexts"] == [48, 511] and summary["contexts_requested"] == [48, 600, 900]
    assert len(summary["notes"]) == 2 and "512 positions" in summary["notes"][0]
    short = tmp_path / "short.txt"
    short.write_text("the nation shall endure " * 8)  # 192 characters: 192 tokens
    summary, _ = measure_restore(restore_cfg("restore.contexts=[48,400]", f"dataset.path={short}"), Identity(), handle)
    assert summary["contexts"] == [48, 191] and "192 tokens" in summary["notes"][0]


@pytest.mark.parametrize("bad", ["[]", "[0]", "[10,-1]", "[x]", "[.nan]", "[.inf]"])
def test_bad_bandwidths_are_refused(restore_cfg, handle, bad):
    with pytest.raises(ValueError, match=r"restore\.bandwidths_gbps"):
        measure_restore(restore_cfg(f"restore.bandwidths_gbps={bad}"), Identity(), handle)


@pytest.mark.parametrize("overrides, field", [(["restore.contexts=[1]"], "restore.contexts"),
                                              (["restore.repeats=0"], "restore.repeats"),
                                              (["restore.threads=0"], "restore.threads"),
                                              (["restore.threads=two"], "restore.threads")])
def test_bad_contexts_and_repeats_are_refused(restore_cfg, handle, overrides, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        measure_restore(restore_cfg(*overrides), Identity(), handle)


def test_crossings_of_lines():
    fast_big = Route("a", bits=8e9, fixed_s=0.1)  # 8 Gbit, 0.1 s after it
    slow_small = Route("b", bits=1e9, fixed_s=0.8)
    # 0.1 + 8/B = 0.8 + 1/B  ->  B = 10 Gbit/s
    assert crossing(fast_big, slow_small) == pytest.approx(10.0)
    assert faster_range(fast_big, slow_small) == [pytest.approx(10.0), math.inf]
    assert faster_range(slow_small, fast_big) == [0.0, pytest.approx(10.0)]
    dominated = Route("c", bits=9e9, fixed_s=0.2)
    assert crossing(dominated, fast_big) is None and faster_range(dominated, fast_big) is None
    assert faster_range(fast_big, dominated) == [0.0, math.inf]
    assert faster_range(fast_big, fast_big) is None
    c = crossovers(Route("compressed", 2e9, 0.3), Route("16bit", 8e9, 0.1), Route("prefill", 1e6, 1.0))
    assert c["crossover_16bit_gbps"] == pytest.approx(30.0)  # 0.3 + 2/B = 0.1 + 8/B
    assert c["compressed_fastest_gbps"][1] == pytest.approx(30.0)
    three = (Route("compressed", 2e9, 0.3), Route("16bit", 8e9, 0.1), Route("prefill", 1e6, 1.0))
    for r in ttft_rows(*three, [1, 29, 31]):
        assert r["fastest"] == {1: "prefill", 29: "compressed", 31: "16bit"}[r["bandwidth_gbps"]]


def test_bandwidths_are_checked():
    assert check_bandwidths([100, 1, 10, 10]) == [1.0, 10.0, 100.0]
    for bad in ([], [0], [True], "10", None, [float("nan")]):
        with pytest.raises(ValueError, match="bandwidths_gbps"):
            check_bandwidths(bad)


def test_projection_formulas():
    s = Shape("s", n_layers=2, n_kv_heads=1, n_heads=4, head_dim=8, params=1e6, vocab_size=1000)
    assert s.kv_elements(10) == 2 * 2 * 1 * 8 * 10
    assert s.prefill_flops(10) == 2 * 1e6 * 10 + 2 * 2 * 4 * 8 * 100
    acc = Accelerator(flops=1e12, memory_bytes_per_s=1e15)
    assert acc.prefill_s(s, 10) == pytest.approx(s.prefill_flops(10) / 1e12)
    node = {"tokens": 10, "flops": 1e12, "memory_bytes_per_s": 1e15, "models": {"s": {
        "n_layers": 2, "n_kv_heads": 1, "n_heads": 4, "head_dim": 8, "params": 1e6, "vocab_size": 1000}}}
    rates = {"bits_per_element": 2.0, "encode_elements_per_s": 1e6, "decode_elements_per_s": 2e6}
    got = project(rates, node, [1.0], False)
    row = got["models"]["s"]
    assert row["bytes"] == 2.0 * 320 / 8 and row["bytes_ids"] == 10 * 10 / 8 and row["decode_s"] == 320 / 2e6
    assert row["prefill_s"] == pytest.approx(s.prefill_flops(11) / 1e12)
    with pytest.raises(ValueError, match="lacks"):
        project({"bits_per_element": 2.0, "encode_elements_per_s": 1.0, "decode_elements_per_s": 1.0},
                {**node, "models": {"s": {"n_layers": 2}}}, [1.0], False)


def test_the_command_writes_a_restore_run_and_the_report_draws_it(restore_cfg, handle, tmp_path):
    from kvbench.report.build import write_report
    from kvbench.sweep.cells import run_cell

    cfg = restore_cfg("+compressor=identity", "restore.contexts=[32]", "restore.bandwidths_gbps=[1,100]",
                      "restore.threads=1")
    before = torch.get_num_threads()
    out = run_cell("restore", cfg, handle=handle)
    assert out.summary["torch_threads"] == 1 and torch.get_num_threads() == before
    assert out.path.name.startswith("restore-identity-")
    s = json.loads((out.path / "restore.json").read_text())
    assert s["kind"] == "restore" and s["cell_key"] and s["git_sha"] and s["config"]["restore"]["contexts"] == [32]
    assert [r["bandwidth_gbps"] for r in s["rows"]] == [1.0, 100.0]
    assert {"ttft_s", "ttft_16bit_s", "ttft_prefill_s"} <= set(s["rows"][0])
    assert (out.path / "restore.parquet").exists()
    res = write_report([tmp_path / "results"], tmp_path / "report", formats=("png",))
    assert res["restore"] == 2 and res["rows"] == 0
    assert (tmp_path / "report" / "figures" / "restore_ttft.png").exists()
    assert "TTFT compressed s" in (tmp_path / "report" / "restore.md").read_text()
