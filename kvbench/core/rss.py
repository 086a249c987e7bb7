"""The process's resident memory: what it holds now, its peak since it started, and the peak of one cell.

``getrusage``'s ``ru_maxrss`` is the process's peak since start, so in a sweep that runs many cells in one process
a later cell reports the peak of an earlier, larger one. A cell's own peak is read from the kernel's high-water mark
(``VmHWM`` in ``/proc/self/status``) after resetting it at the cell's start (``5`` written to
``/proc/self/clear_refs``, Linux 4.0 on, where the process may write it). That reset lowers ``ru_maxrss`` too, so the
highest peak seen before each reset is kept here and the process's peak is the larger of the two.
"""

from __future__ import annotations

import resource
from pathlib import Path

GB = 1e9
#: the process's peak resident bytes before the last reset of the high-water mark
_EARLIER = [0]
#: whether this process reset the high-water mark at the start of the cell now measured
_CELL_STARTED = [False]


def _status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def resident_bytes() -> int:
    """Bytes this process holds in memory now (``VmRSS``; its peak where the platform has no ``/proc``)."""
    now = _status_bytes("VmRSS")
    return now if now is not None else _maxrss_bytes()


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def process_peak_gb() -> float:
    """The process's peak resident memory since it started, GB (a sweep's later cells carry earlier ones' peak)."""
    return max(_EARLIER[0], _maxrss_bytes()) / GB


def start_cell() -> bool:
    """Reset the kernel's resident high-water mark so that :func:`cell_peak_gb` reads this cell's own peak; False
    where the platform or its permissions do not allow it."""
    _EARLIER[0] = max(_EARLIER[0], _maxrss_bytes())
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        _CELL_STARTED[0] = False
        return False
    _CELL_STARTED[0] = True
    return True


def cell_peak_gb() -> float | None:
    """The peak resident memory since :func:`start_cell`, GB; None where it could not reset the mark."""
    hwm = _status_bytes("VmHWM") if _CELL_STARTED[0] else None
    return None if hwm is None else hwm / GB


def peak_fields() -> dict:
    """A summary's ``peak_rss_gb`` (the process's since start) and ``peak_rss_gb_cell`` (since :func:`start_cell`,
    or None)."""
    cell = cell_peak_gb()  # read first: the process's peak, read after, is never below it
    return {"peak_rss_gb": max(process_peak_gb(), cell or 0.0), "peak_rss_gb_cell": cell}
