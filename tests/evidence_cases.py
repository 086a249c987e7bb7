"""Synthetic finished runs for the evidence and page tests: real run directories (``kvbench.store.results.write``)
of real cells of the per-vector study, with made-up measurements and per-token NLLs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

#: the per-vector study's cells the tests run: (variant, bits) of its TurboQuant preset
CELLS = (("mse", 2), ("mse", 2.5), ("mse", 3), ("prod", 2))


def per_vector_cells():
    from kvbench.report.sections import section
    from kvbench.sweep.presets import cells

    wanted = {(v, float(b)) for v, b in CELLS}
    return [c for c in cells(section("per_vector").presets)
            if (c.cfg.compressor.get("variant"), float(c.cfg.compressor.get("bits", -1))) in wanted]


def write_run(root: Path, cell, i: int, sha: str = "a" * 40, created: str | None = None, **extra) -> Path:
    """A finished run of ``cell`` under ``root/runs``: run ``i`` has ``bits_per_element`` 2 + i, ``delta_nll``
    about 0.01 i, and the rest of a run summary's keys; its NLL figures (and its recall probe's, about 0.1 i) are
    what the measuring functions make of its per-token NLLs, as a run's are."""
    from kvbench.core.config import make_compressor
    from kvbench.measure.run import recall_loss, task_loss
    from kvbench.store import results

    params = make_compressor(cell.cfg.compressor).describe()
    bits = 2.0 + i
    base, comp = nlls(0.01 * i, 64)  # two scored windows
    recall = (*nlls(0.1 * i, 16), [0, 1])  # a copy span after each
    metrics = OmegaConf.create(OmegaConf.to_container(cell.cfg.metrics, resolve=True))
    s = {"compressor": params["name"], "model": "smollm2_135m", "dataset": "sotu", "compressor_params": params,
         "cell_key": cell.key, "created": created or f"2026-01-0{i + 1}T00:00:00",
         "config": OmegaConf.to_container(cell.cfg, resolve=True), "git_sha": sha, "kind": "run", "n_tokens": 4096,
         "n_sequences": 4, "n_elements": 4096 * 11520, "bits_per_element": bits, "bits_per_token": bits * 11520,
         "bound_bits_per_token": 5.07, "compression_ratio": 16 / bits, **task_loss(base, comp, metrics),
         **recall_loss(recall[0], recall[1], metrics, None, recall[2]),
         "rel_mse_k": 0.01, "rel_mse_v": 0.02, "encode_MBps": 80.0, "decode_MBps": 150.0, "lossless": False,
         "trace": "/t/smollm2-sotu-aaaa", **extra}
    path = results.run_dir(root, "run", s["compressor"], cell.key, sha)
    results.write(path, "run", s, [{"layer": 0, "kind": "k"}], s["config"], nll=(base, comp, recall))
    return path


def nlls(delta: float, n: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Two windows of ``n`` per-token NLLs each, base and compressed, as float32 values (as a run scores them): the
    base averages 3.25, the compressed ``delta`` more, with a spread so that the interval has a width."""
    wobble = np.sin(np.arange(n)) * 0.25  # (n,)
    base = [(3.0 + np.where(np.arange(n) % 2, 0.25, -0.25)).astype(np.float32).astype(np.float64),
            (3.5 + np.where(np.arange(n) % 2, -0.25, 0.25)).astype(np.float32).astype(np.float64)]
    comp = [(b + delta + s * wobble).astype(np.float32).astype(np.float64) for b, s in zip(base, (0.04, -0.04))]
    return base, comp
