"""The presets in ``configs/experiment/`` as cells: what ``python -m kvbench KIND -m +experiment=NAME [AXES]`` runs,
one override list per cell, and running them in one process or one process each.

A preset's cells come from its ``hydra.sweeper.params`` expanded by Hydra's own basic sweeper, so they are the cells
of the multirun to the letter (an axis given on the command line replaces the preset's), and each cell composes and
keys (:func:`kvbench.sweep.cells.key_of`) as that multirun's job would.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from kvbench.core.config import CONFIG_DIR
from kvbench.store.locking import LOCK, bench_lock
from kvbench.store.results import Outcome, resume_mode
from kvbench.sweep.cells import compose_cell, finished, key_of, run_cell
from kvbench.sweep.commands import MEASURING, measuring


@dataclass(frozen=True)
class Preset:
    kind: str  # the measuring command (kvbench.sweep.commands.MEASURING): run | eval | latency | restore
    name: str  # configs/experiment/<name>.yaml


@dataclass(frozen=True)
class Cell:
    kind: str
    overrides: tuple[str, ...]  # what ``python -m kvbench KIND`` takes for this cell alone
    cfg: Any

    @functools.cached_property
    def key(self) -> str:
        return key_of(self.cfg)

    @property
    def command(self) -> str:
        return f"python -m kvbench {self.kind} {' '.join(self.overrides)}"


@functools.cache
def _preset_config(preset: Preset) -> Any:
    """The preset composed for its command, with Hydra's own config (its sweep axes, the config groups it chose)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name="kvbench"):
        return compose(config_name=measuring(preset.kind).config, overrides=[f"+experiment={preset.name}"],
                       return_hydra_config=True)


def sweep_params(preset: Preset) -> dict[str, str]:
    """The preset's ``hydra.sweeper.params`` as composed for its command."""
    params = OmegaConf.to_container(_preset_config(preset).hydra.sweeper.params) or {}
    return {str(k): str(v) for k, v in params.items()}


def other_models(preset: Preset, models: Iterable[str]) -> list[str]:
    """Of ``models``, those that ``model=NAME`` moves the preset's cells to: not one its cells run on already (the
    override then is a no-op, or picks among the cells of its model axis)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    axis = sweep_params(preset).get("model")
    if axis is None:
        own = {_preset_config(preset).hydra.runtime.choices.get("model")}
    else:
        (parsed,) = OverridesParser.create().parse_overrides([f"model={axis}"])
        own = set(parsed.sweep_string_iterator()) if parsed.is_sweep_override() else {parsed.value()}
    return [m for m in models if m not in own]


def cell_overrides(preset: Preset, overrides: Sequence[str] = ()) -> list[list[str]]:
    """Each cell's overrides, in the order the multirun runs them."""
    # the basic sweeper's own expansion (not a copy of it), so -m and this list cannot drift apart
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [f"{k}={v}" for k, v in sweep_params(preset).items()] + [f"+experiment={preset.name}", *overrides]
    return BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(args), None)[0]


@functools.cache
def _composed(kind: str, overrides: tuple[str, ...]) -> Any:
    return compose_cell(kind, list(overrides))  # a Hydra compose takes ~0.2 s: a report and its tests ask again


def fitting(kind: str, overrides: Sequence[str]) -> list[str]:
    """``overrides`` less those whose key only other commands have: a report given the overrides of every study of a
    run (``limit=1`` for the eval cells, ``dataset.seq_len=512`` for all) applies to each preset those of its own
    command. A key no command has (``compressor.variant``) stays, so the presets it does not fit show nothing."""
    bases = {k: _composed(k, ()) for k in MEASURING}

    def has(cfg: Any, key: str) -> bool:
        return OmegaConf.select(cfg, key, default=_MISSING) is not _MISSING

    out = []
    for o in overrides:
        key = o.split("=", 1)[0]
        if key.startswith(("+", "~")) or has(bases[kind], key) or not any(has(b, key) for b in bases.values()):
            out.append(o)
    return out


_MISSING = object()


@functools.cache
def _key(kind: str, overrides: tuple[str, ...]) -> str:
    return key_of(_composed(kind, overrides))


def cell_keys(preset: Preset, overrides: Sequence[str] = ()) -> list[str]:
    """The ``cell_key`` of each cell of ``preset`` with ``overrides``, in the order of :func:`cells`, each cell
    composed and keyed once per process; none when the overrides do not apply to the preset."""
    from hydra.errors import ConfigCompositionException

    try:
        return [_key(preset.kind, tuple(ov)) for ov in cell_overrides(preset, overrides)]
    except ConfigCompositionException:
        return []


def cells(presets: Iterable[Preset], overrides: Sequence[str] = (), root: Path | None = None,
          unfit: Callable[[Preset, Exception], None] | None = None) -> list[Cell]:
    """Every cell of ``presets``, composed, in order; ``root`` (made absolute, so the working directory does not
    move them) puts their runs there. ``overrides`` apply to every cell and replace a preset's axis of the same key;
    with ``unfit``, a preset they do not apply to (``compressor.variant=mse`` to KIVI's cells) is left out and
    passed to it, so that overrides can pick the cells of one preset among several."""
    from hydra.errors import ConfigCompositionException

    extra = [*overrides, *([f"paths.results={Path(root).resolve()}"] if root is not None else [])]
    out = []
    for p in presets:
        try:
            out += [Cell(p.kind, tuple(ov), copy.deepcopy(_composed(p.kind, tuple(ov))))
                    for ov in cell_overrides(p, extra)]
        except ConfigCompositionException as e:
            if unfit is None:
                raise
            unfit(p, e)
    return out


def _reusable(cell: Cell, force: bool) -> bool:
    """Whether :func:`kvbench.sweep.cells.run_cell` would reuse a finished run of the cell (then nothing is timed)."""
    mode = "never" if force else resume_mode(cell.cfg.metrics.resume)
    return mode != "never" and finished(cell.kind, cell.cfg, same_code=mode == "code") is not None


def run_in_process(todo: Sequence[Cell], force: bool = False, lock: bool = False) -> list[Cell]:
    """Run the cells on one loaded model, each measured one under the benchmark lock when ``lock``, with the load
    average at its start in its summary; a failing cell is reported and the others still run. The failed cells."""
    from kvbench.inputs.models import ModelHandle
    from kvbench.sweep.cells import formatter

    handles: dict[str, ModelHandle] = {}  # one loaded model per model config and device (a preset may have a model axis)
    failed = []
    for i, cell in enumerate(todo, 1):
        which = json.dumps([OmegaConf.to_container(cell.cfg.model, resolve=True), str(cell.cfg.device)], sort_keys=True)
        handle = handles.setdefault(which, ModelHandle(cell.cfg.model, cell.cfg.device))
        try:  # a compressor that cannot be built fails here, when its cell is keyed
            reuse = _reusable(cell, force)
            print(f"[{i}/{len(todo)}] {cell.command}" + (" (finished run reused)" if reuse else ""), flush=True)
            with bench_lock() if lock and not reuse else nullcontext():
                out: Outcome = run_cell(cell.kind, cell.cfg, handle, resume=False if force else None,
                                        extra={"load_average_1min": os.getloadavg()[0]})
        except Exception as e:  # noqa: BLE001 - one failing cell must not stop the others
            print(f"  failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            failed.append(cell)
            continue
        if not out.reused:
            print(formatter(cell.kind)(out.summary), flush=True)
    return failed


def run_isolated(todo: Sequence[Cell], lock: bool = False) -> list[Cell]:
    """Run each cell as its own ``python -m kvbench`` process (so that a process-wide measure such as peak memory
    is the cell's alone), under ``flock`` on the benchmark lock when ``lock``. The failed cells."""
    failed = []
    for i, cell in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {cell.command}", flush=True)
        cmd = [sys.executable, "-m", "kvbench", cell.kind, *cell.overrides]
        if subprocess.run(["flock", LOCK, *cmd] if lock else cmd).returncode:
            failed.append(cell)
    return failed
