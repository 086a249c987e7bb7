"""The Hydra commands of ``python -m kvbench``: those with a config in :data:`kvbench.sweep.commands.COMMANDS` (``run``,
``eval``, ``latency``, ``restore``, ``capture``), each an entry point made by :func:`hydra_entry` for its config.
Thin: a measuring command is one cell through :func:`cell`, which reuses a finished run of the same config or
measures and writes one (:mod:`kvbench.store.results`) with the measuring function the table names.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
from omegaconf import DictConfig

from kvbench.core.config import CONFIG_DIR
from kvbench.inputs.assets import AssetError
from kvbench.sweep.commands import COMMANDS, function, measuring
from kvbench.sweep.overrides import per_cell

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
    print(f"  -> {out.path / measuring(kind).kind.summary}")


def capture_trace(cfg: DictConfig) -> None:
    """``python -m kvbench capture``: capture (or reuse) the config's KV trace and say where it is."""
    from kvbench.inputs.capture import capture, default_trace_dir
    from kvbench.inputs.models import ModelHandle
    from kvbench.sweep.config_check import read_config

    try:
        cfg = read_config(cfg)
        out = Path(str(cfg.trace)).expanduser() if cfg.trace else default_trace_dir(cfg)
        trace = capture(cfg, ModelHandle(cfg.model, cfg.device), out)
    except USER_ERRORS as e:
        _fail(e)
    m = trace.manifest
    print(f"trace: {trace.path}\n  {len(trace.sequences)} sequences x {m['dataset']['seq_len']} tokens, "
          f"{m['model']['n_layers']} layers x {m['model']['n_kv_heads']} KV heads x {m['model']['head_dim']}, "
          f"{m['prefill_tokens_per_s']:.0f} tok/s")


def hydra_entry(config_name: str, body: Callable[[DictConfig], None]) -> Callable[[], None]:
    """A ``hydra.main`` entry point: it composes ``configs/<config_name>.yaml`` with the overrides in ``sys.argv``
    (every cell of a multirun with ``-m``) and runs ``body`` on each composed config."""

    @hydra.main(config_path=str(CONFIG_DIR), config_name=config_name, version_base="1.3")
    def entry(cfg: DictConfig) -> None:
        body(cfg)

    return entry


def main(name: str, argv: list[str]) -> int:
    """``python -m kvbench NAME ARGV`` for a command with a Hydra config."""
    command = COMMANDS[name]
    if command.config is None:
        raise ValueError(f"command {name!r} has no Hydra config; it parses its own arguments")
    body = functools.partial(cell, name) if command.measure else function(command.main)
    if command.measure:
        try:
            argv = per_cell(argv)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    sys.argv = [f"kvbench-{name}", *argv]
    hydra_entry(command.config, body)()
    return 0
