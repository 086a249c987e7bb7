"""Hydra entry points for ``run`` and ``capture``. Thin: the work is in ``kvbench.runner`` and ``kvbench.capture``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from kvbench.assets import AssetError
from kvbench.config import CONFIG_DIR, make_compressor

USER_ERRORS = (ValueError, AssetError, FileNotFoundError)


def _fail(e: Exception) -> None:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def _sweep_cell() -> bool:
    """In a multirun, print which cell this is (the sweep's progress) and return True."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not (HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN):
        return False
    job = HydraConfig.get().job
    # the sweep's progress, in the terminal and in launcher logs (Hydra's own job log is switched off)
    print(f"[sweep cell #{job.num}] {' '.join(HydraConfig.get().overrides.task)}", file=sys.stderr, flush=True)
    return True


@hydra.main(config_path=str(CONFIG_DIR), config_name="run", version_base="1.3")
def _run(cfg: DictConfig) -> None:
    from kvbench.runner import format_summary, measure, run_dir_for, write_run

    in_sweep = _sweep_cell()
    try:
        compressor = make_compressor(cfg.get("compressor"))
        cfg_dict = OmegaConf.to_container(cfg, resolve=True)
        run_dir = run_dir_for(cfg_dict, compressor)
        if cfg.metrics.resume and (run_dir / "summary.json").exists():
            summary = json.loads((run_dir / "summary.json").read_text())
            print(f"reusing finished run {run_dir} (same config and code; metrics.resume=false recomputes)")
        else:
            summary, rows = measure(cfg, compressor)
            write_run(run_dir, summary, rows, cfg_dict)
    except USER_ERRORS as e:
        if in_sweep:
            print(f"error: {e}", file=sys.stderr)
            raise  # the launcher marks this cell failed, runs the others, then exits non-zero
        _fail(e)
    print(format_summary(summary))
    print(f"  -> {run_dir / 'summary.json'}")


@hydra.main(config_path=str(CONFIG_DIR), config_name="run", version_base="1.3")
def _capture(cfg: DictConfig) -> None:
    from kvbench.capture import capture, default_trace_dir
    from kvbench.models import ModelHandle

    try:
        out = Path(str(cfg.trace)).expanduser() if cfg.trace else default_trace_dir(cfg)
        trace = capture(cfg, ModelHandle(cfg.model, cfg.device), out)
    except USER_ERRORS as e:
        _fail(e)
    m = trace.manifest
    print(f"trace: {trace.path}\n  {len(trace.sequences)} sequences x {m['dataset']['seq_len']} tokens, "
          f"{m['model']['n_layers']} layers x {m['model']['n_kv_heads']} KV heads x {m['model']['head_dim']}, "
          f"{m['prefill_tokens_per_s']:.0f} tok/s")


def _hydra(entry, argv: list[str], prog: str) -> int:
    sys.argv = [prog, *argv]
    entry()
    return 0


def run_main(argv: list[str]) -> int:
    return _hydra(_run, argv, "kvbench-run")


def capture_main(argv: list[str]) -> int:
    return _hydra(_capture, argv, "kvbench-capture")
