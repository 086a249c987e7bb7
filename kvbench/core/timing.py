"""Measuring a block honestly: wall-clock time (synchronize, then time with CUDA events) and peak resident memory."""

from __future__ import annotations

import os
import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path

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


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """Current resident set size of this process (Linux ``/proc/self/statm``); 0 where there is no procfs."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _status_bytes(field: str) -> int:
    try:
        m = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    except OSError:
        return 0
    return int(m.group(1)) * 1024 if m else 0


class PeakRSS:
    """Highest resident set size of this process between :meth:`start` and :meth:`stop`.

    Three readings, the highest wins, so the result cannot fall below what was resident at any of them:
    a sample when the block ends (an allocation still alive is always seen), samples every ``interval_s`` on a
    background thread (an allocation freed inside the block is seen once it lived through one sample), and the
    kernel's own high-water mark ``VmHWM`` where ``clear_refs`` could reset it at the start (catches spikes between
    samples). ``VmHWM`` alone is not enough: some kernels and sandboxes refuse the reset or report a stale mark.
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.base = self.high = 0
        self.samples = 0  # taken so far; lets a caller wait for a sample without guessing at timing
        self._hwm_reset = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:  # "5" resets the peak RSS (VmHWM) of this process to its current RSS
            Path("/proc/self/clear_refs").write_text("5")
            reset = True
        except OSError:
            reset = False
        self.base = self.high = resident_bytes()
        # trust the mark only if the reset took: right after it, it must sit at the current RSS, not a past peak
        self._hwm_reset = reset and 0 < _status_bytes("VmHWM") <= self.base + (16 << 20)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        self.high = max(self.high, resident_bytes())
        self.samples += 1

    def _run(self) -> None:
        fd = os.open("/proc/self/statm", os.O_RDONLY) if os.path.exists("/proc/self/statm") else None
        if fd is None:
            return
        try:
            while not self._stop.wait(self.interval_s):
                # pread on one descriptor: ~1 us a sample, so the thread costs the measured block nothing visible
                self.high = max(self.high, int(os.pread(fd, 128, 0).split()[1]) * _PAGE)
                self.samples += 1
        finally:
            os.close(fd)

    def stop(self) -> int:
        """Stop sampling; the peak resident bytes seen since :meth:`start` (0 where there is no procfs)."""
        self.sample()  # first, while memory is as the block left it: joining the thread hands back its stack
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self._hwm_reset:
            self.high = max(self.high, _status_bytes("VmHWM"))
        return self.high
