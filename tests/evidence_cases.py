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
    0.01 i (its per-token NLLs average to exactly that), and the rest of a run summary's keys."""
    from kvbench.core.config import make_compressor
    from kvbench.store import results

    params = make_compressor(cell.cfg.compressor).describe()
    bits = 2.0 + i
    base = [np.full(8, 3.0, np.float32), np.full(8, 3.5, np.float32)]  # two scored windows
    comp = [b + np.float32(0.01 * i) for b in base]
    s = {"compressor": params["name"], "model": "smollm2_135m", "dataset": "sotu", "compressor_params": params,
         "cell_key": cell.key, "created": created or f"2026-01-0{i + 1}T00:00:00",
         "config": OmegaConf.to_container(cell.cfg, resolve=True), "git_sha": sha, "kind": "run", "n_tokens": 4096,
         "n_sequences": 4, "n_elements": 4096 * 11520, "bits_per_element": bits, "bits_per_token": bits * 11520,
         "bound_bits_per_token": 5.07, "compression_ratio": 16 / bits, "delta_nll": 0.01 * i, "nll_base": 3.25,
         "rel_mse_k": 0.01, "rel_mse_v": 0.02, "encode_MBps": 80.0, "decode_MBps": 150.0, "lossless": False,
         "delta_nll_ci": [0.01 * i - 0.005, 0.01 * i + 0.005], "trace": "/t/smollm2-sotu-aaaa", **extra}
    path = results.run_dir(root, "run", s["compressor"], cell.key, sha)
    results.write(path, "run", s, [{"layer": 0, "kind": "k"}], s["config"], nll=(base, comp))
    return path
