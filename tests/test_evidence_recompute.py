"""A measured run's per-token NLLs give back its summary's delta NLL, interval and verdict, and its recall probe's,
to the last bit (tiny model): what ``report --check`` recomputes is what the run measured."""

from __future__ import annotations

import json

import numpy as np

from kvbench.report.rederive import recompute_run
from kvbench.store import results


def test_a_tiny_model_runs_figures_come_back_from_its_nll_npz(tiny_cfg, tiny_handle):
    from kvbench.sweep.cells import run_cell

    cfg = tiny_cfg("+compressor=kivi", "compressor.bits=2", "compressor.residual=0", "compressor.group_size=16",
                   "metrics.recall_tokens=8")
    out = run_cell("run", cfg, tiny_handle, resume=False)
    spans = results.read_nll(out.path, "recall")
    assert len(spans) == cfg.dataset.n_sequences and all(len(b) == 8 for b, _, _ in spans)
    assert [w for _, _, w in spans] == list(range(cfg.dataset.n_sequences))  # the window each span follows
    assert out.summary["recall_tokens"] == 8 * cfg.dataset.n_sequences
    assert recompute_run(out.path) == ([], [])
    # one float32 step of one recall token is a different run
    f = out.path / results.NLL_FILE
    with np.load(f) as z:
        arrays = {k: z[k].copy() for k in z.files}
    arrays["recall_compressed"][0] = np.nextafter(arrays["recall_compressed"][0], np.float32(np.inf))
    np.savez_compressed(f, **arrays)
    problems, _ = recompute_run(out.path)
    # the file no longer has the content hash its run recorded, and what the edit changed is named after that
    assert problems[0].startswith(f"{f} fails its content hash"), problems
    assert problems[1:] and all(p.split(":")[0] in ("delta_nll_recall", "delta_nll_recall_ci") for p in problems[1:]), problems
    assert json.loads((out.path / "summary.json").read_text())["delta_nll"] == out.summary["delta_nll"]
