"""What the study scripts share: a cell is the overrides ``python -m kvbench KIND`` would take; its finished run is
the one :mod:`kvbench.results` keys it to, and a missing one is measured by :func:`kvbench.cells.run_cell`.

Not a script: the others import it (``scripts/`` is on their path when run as ``python scripts/NAME.py``).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from kvbench.cells import compose_cell
from kvbench.config import make_compressor
from kvbench.results import cell_key, latest, root_of

#: the machine's benchmark lock, the one ``flock /tmp/kvbench-bench.lock CMD`` takes: one timing at a time
LOCK = "/tmp/kvbench-bench.lock"


def compose(kind: str, overrides: list[str], root: Path) -> Any:
    """The cell's config with its runs under ``root`` (absolute, so the working directory does not move them)."""
    return compose_cell(kind, [*overrides, f"paths.results={root}"])


def key(cfg: Any) -> str:
    """The ``cell_key`` :func:`kvbench.cells.run_cell` files this config's runs under."""
    compressor = make_compressor(cfg.get("compressor"))
    return cell_key(OmegaConf.to_container(cfg, resolve=True), compressor.describe())


def finished_run(kind: str, cfg: Any) -> dict | None:
    """The newest finished run of the cell ``cfg`` under its results root (any code version), or None."""
    return latest(root_of(OmegaConf.to_container(cfg, resolve=True)), kind, key(cfg))


@contextmanager
def bench_lock(path: str = LOCK) -> Iterator[None]:
    """Hold the benchmark lock (flock(2), as the ``flock`` command takes it) for the block."""
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
