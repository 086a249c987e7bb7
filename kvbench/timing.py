"""Wall-clock timing that is honest on GPUs: synchronize, then time with CUDA events."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class Stopwatch:
    def __init__(self, device: str = "cpu") -> None:
        self.cuda = device.startswith("cuda") and torch.cuda.is_available()
        self.seconds = 0.0

    @contextmanager
    def __call__(self):
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            torch.cuda.synchronize()
            self.seconds += start.elapsed_time(end) / 1000.0
        else:
            t0 = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - t0
