"""Fitting a compressor on the calibration split of the run's trace, for the in-the-loop commands."""

from __future__ import annotations

from typing import Any

from kvbench.capture import load_or_capture
from kvbench.compressor import Compressor
from kvbench.models import ModelHandle
from kvbench.timing import Stopwatch


def fit_compressor(cfg: Any, compressor: Compressor, handle: ModelHandle) -> float:
    """Fit on the calibration windows of the run trace (captured once, then reused) when the compressor learns
    anything; returns the seconds it took."""
    if type(compressor).fit is Compressor.fit:
        return 0.0
    trace = load_or_capture(cfg, handle)
    watch = Stopwatch(cfg.device)
    with watch():
        compressor.fit([s.kv for s in trace.calib])
    return watch.seconds
