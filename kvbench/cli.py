"""Hydra entry points for ``run``, ``eval``, ``latency``, ``restore`` and ``capture``. Thin: each measuring command is one cell
through :func:`cell`, which reuses a finished run of the same config or measures and writes one
(:mod:`kvbench.store.results`); the work is in ``kvbench.measure.run``, ``kvbench.measure.evaluation.evaluate``, ``kvbench.measure.latency`` and ``kvbench.measure.restore``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from kvbench.core.config import CONFIG_DIR
from kvbench.inputs.assets import AssetError

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


def cell(kind: str, cfg: DictConfig) -> None:
    """Reuse the newest finished run of this config (``metrics.resume``) or measure one and write it."""
    from kvbench.store.results import kind_of
    from kvbench.sweep.cells import formatter, run_cell

    in_sweep = _sweep_cell()
    try:
        out = run_cell(kind, cfg)
    except USER_ERRORS as e:
        if in_sweep:
            print(f"error: {e}", file=sys.stderr)
            raise  # the launcher marks this cell failed, runs the others, then exits non-zero
        _fail(e)
    if out.reused:
        print(f"reusing finished run {out.path} (same config, code {out.summary.get('git_sha', '?')[:12]}; "
              "metrics.resume=code reuses only runs of this code version, metrics.resume=false recomputes)")
    print(formatter(kind)(out.summary))
    print(f"  -> {out.path / kind_of(kind).summary}")


@hydra.main(config_path=str(CONFIG_DIR), config_name="run", version_base="1.3")
def _run(cfg: DictConfig) -> None:
    cell("run", cfg)


@hydra.main(config_path=str(CONFIG_DIR), config_name="eval", version_base="1.3")
def _eval(cfg: DictConfig) -> None:
    cell("eval", cfg)


@hydra.main(config_path=str(CONFIG_DIR), config_name="latency", version_base="1.3")
def _latency(cfg: DictConfig) -> None:
    cell("latency", cfg)


@hydra.main(config_path=str(CONFIG_DIR), config_name="restore", version_base="1.3")
def _restore(cfg: DictConfig) -> None:
    cell("restore", cfg)


@hydra.main(config_path=str(CONFIG_DIR), config_name="run", version_base="1.3")
def _capture(cfg: DictConfig) -> None:
    from kvbench.inputs.capture import capture, default_trace_dir
    from kvbench.inputs.models import ModelHandle

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


def eval_main(argv: list[str]) -> int:
    return _hydra(_eval, argv, "kvbench-eval")


def latency_main(argv: list[str]) -> int:
    return _hydra(_latency, argv, "kvbench-latency")


def restore_main(argv: list[str]) -> int:
    return _hydra(_restore, argv, "kvbench-restore")


def capture_main(argv: list[str]) -> int:
    return _hydra(_capture, argv, "kvbench-capture")
