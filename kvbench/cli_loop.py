"""Hydra entry points for ``eval`` (task accuracy) and ``latency``, the commands that put a compressed cache in the
model's loop. Thin, as ``kvbench.cli``: the work is in ``kvbench.evaluation.runner`` and ``kvbench.latency``.

Each writes ``results/runs/<kind>-<compressor>-<hash>/`` with ``<kind>.json`` (the summary) and a parquet table,
under names of their own so that ``python -m kvbench report`` (which reads ``summary.json``) does not mistake them
for compression cells.
"""

from __future__ import annotations

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from kvbench.cli import USER_ERRORS, _fail, _hydra
from kvbench.config import CONFIG_DIR, make_compressor


def _run_dir(kind: str, cfg: DictConfig, name: str) -> Path:
    from kvbench.paths import results_root
    from kvbench.runner import config_hash

    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    return results_root(cfg_dict.get("paths", {}).get("results")) / "runs" / f"{kind}-{name}-{config_hash(cfg_dict)}"


def _write(run_dir: Path, kind: str, summary: dict, rows: list[dict], cfg: DictConfig) -> None:
    import pandas as pd

    from kvbench.atomic import staged_dir

    with staged_dir(run_dir) as tmp:
        pd.DataFrame(rows).to_parquet(tmp / f"{kind}.parquet", index=False)
        (tmp / "config.json").write_text(json.dumps(OmegaConf.to_container(cfg, resolve=True), indent=2, default=str))
        (tmp / f"{kind}.json").write_text(json.dumps(summary, indent=2, default=str))


def _cell(kind: str, cfg: DictConfig, measure, fmt) -> None:
    try:
        compressor = make_compressor(cfg.get("compressor"))
        run_dir = _run_dir(kind, cfg, compressor.name)
        if cfg.metrics.resume and (run_dir / f"{kind}.json").exists():
            summary = json.loads((run_dir / f"{kind}.json").read_text())
            print(f"reusing finished run {run_dir} (same config and code; metrics.resume=false recomputes)")
        else:
            summary, rows = measure(cfg, compressor)
            _write(run_dir, kind, summary, rows, cfg)
    except USER_ERRORS as e:
        _fail(e)
    print(fmt(summary))
    print(f"  -> {run_dir / f'{kind}.json'}")


@hydra.main(config_path=str(CONFIG_DIR), config_name="eval", version_base="1.3")
def _eval(cfg: DictConfig) -> None:
    from kvbench.evaluation.runner import evaluate, format_eval

    _cell("eval", cfg, evaluate, format_eval)


@hydra.main(config_path=str(CONFIG_DIR), config_name="latency", version_base="1.3")
def _latency(cfg: DictConfig) -> None:
    from kvbench.latency import format_latency, measure_latency

    _cell("latency", cfg, measure_latency, format_latency)


def eval_main(argv: list[str]) -> int:
    return _hydra(_eval, argv, "kvbench-eval")


def latency_main(argv: list[str]) -> int:
    return _hydra(_latency, argv, "kvbench-latency")
