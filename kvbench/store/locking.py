"""The machine's benchmark lock: one timed measurement at a time on a shared machine."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

#: the lock ``flock /tmp/kvbench-bench.lock CMD`` takes, so shell scripts and Python drivers exclude each other
LOCK = "/tmp/kvbench-bench.lock"


@contextmanager
def bench_lock(path: str = LOCK) -> Iterator[None]:
    """Hold the benchmark lock (flock(2), as the ``flock`` command takes it) for the block."""
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
