"""What a measurement ran on and under: the machine, the torch threads, the load from other jobs.

Every kind of run records them in its summary (:func:`conditions`), so that a page quoting a time can say only what
the run itself recorded about where and how it was measured; a study's manifest names the machine the same way.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine() -> str:
    """The machine measuring: CPU, cores, torch and Python versions."""
    cpu = platform.processor() or "?"
    info = Path("/proc/cpuinfo")
    if info.exists():
        cpu = next((ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines() if ln.startswith("model name")),
                   cpu)
    try:
        import torch

        version = torch.__version__
    except ImportError:
        version = "?"
    return f"{cpu}, {os.cpu_count()} CPU cores, torch {version}, Python {platform.python_version()}"


def load_average() -> float:
    """The 1-minute load average (NaN where the platform has none): other jobs on a shared machine slow a run."""
    try:
        return float(os.getloadavg()[0])
    except OSError:
        return float("nan")


def conditions(threads: int | None = None, load: float | None = None) -> dict:
    """The run summary's ``torch_threads`` (``threads``: those the run measured on, default the process's setting
    now), ``load_average_1min`` (``load``: taken when measuring began, default now) and ``machine``."""
    import torch

    return {"torch_threads": int(torch.get_num_threads() if threads is None else threads),
            "load_average_1min": load_average() if load is None else float(load), "machine": machine()}
