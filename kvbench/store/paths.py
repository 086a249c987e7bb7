"""Where kvbench keeps converted models, text, traces and results."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """``$KVBENCH_HOME`` (default ``~/.cache/kvbench``): converted weights, text, traces, codebooks."""
    return Path(os.environ.get("KVBENCH_HOME", Path.home() / ".cache" / "kvbench")).expanduser()


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def results_root(override: str | os.PathLike | None = None) -> Path:
    """``paths.results=`` beats ``$KVBENCH_RESULTS`` beats ``<repo>/results``."""
    if override:
        return Path(override).expanduser()
    env = os.environ.get("KVBENCH_RESULTS")
    return Path(env).expanduser() if env else repo_root() / "results"
