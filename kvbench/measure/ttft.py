"""Time to first token of a resumed session as a function of link bandwidth: the modelled half of
``python -m kvbench restore``.

A session's cache is stored off the accelerator (CPU memory, disk, another node) and brought back when the session
resumes, as CacheGen (Liu et al. 2024, arXiv 2310.07240) and KVTC (Staniszewski & Łańcucki, arXiv 2511.01815)
measure it. Each way of getting the cache back is one :class:`Route`, a line in 1 / bandwidth::

    ttft(B) = fixed_s + bits / B          B in bit/s; bandwidths are given in Gbit/s (1e9 bit/s)

    compressed  bits = bitstream + codec state (once)     fixed_s = decode_s + first_token_s
    16-bit KV   bits = 16 x KV elements                   fixed_s = first_token_s
    prefill     bits = context ids at ceil(log2 V) each   fixed_s = prefill_s (context + the new token)

The token the resumed session brings (its next input) is needed by all three and left out of every transfer.

Two routes ``a`` and ``b`` cross where ``fixed_a + bits_a / B = fixed_b + bits_b / B``, at
``B* = (bits_a - bits_b) / (fixed_b - fixed_a)``: a crossing exists only where one route sends fewer bits and
costs more fixed time. Above B* the route with the smaller fixed time is faster (transfer matters less as the
link gets faster); below it the one with fewer bits. Where they do not cross, one route is faster at every
bandwidth (or neither, when they tie). :func:`crossovers` names them per context:

- ``crossover_16bit_gbps``: compressed = 16-bit. Since the compressed route adds decode to the same first-token
  forward, it is faster *below* this bandwidth when it sends fewer bits; 16-bit transfer wins above it.
- ``crossover_prefill_gbps``: compressed = prefill. When decode + first token is quicker than prefill, the
  compressed restore is faster *above* this bandwidth (re-running prefill, which sends only ids, wins below it).
- ``crossover_16bit_prefill_gbps``: 16-bit = prefill, likewise.
- ``compressed_faster_than_16bit_gbps``, ``compressed_faster_than_prefill_gbps``,
  ``16bit_faster_than_prefill_gbps``: the bandwidths where the first is strictly faster, ``[low, high]`` with
  0 and infinity for open ends, or None where it never is; ``compressed_fastest_gbps``: where the compressed
  restore beats both, or None.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

GBIT = 1e9  # bit/s per Gbit/s


@dataclass(frozen=True)
class Route:
    """One way of getting a session's cache back: what crosses the link and what is computed after it."""

    name: str
    bits: float  # sent over the link
    fixed_s: float  # computed after the transfer, before the first token is out

    def transfer_s(self, gbps: float) -> float:
        return self.bits / (gbps * GBIT)

    def ttft_s(self, gbps: float) -> float:
        return self.transfer_s(gbps) + self.fixed_s


def check_bandwidths(values: object, field: str = "restore.bandwidths_gbps") -> list[float]:
    """Link bandwidths in Gbit/s: a non-empty list of finite positive numbers, returned as floats."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{field}={values!r} must be a list of link bandwidths in Gbit/s, e.g. [1, 10, 25, 100, 200]")
    out = []
    for v in values:
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{field} holds {v!r}, not a number; allowed: positive finite Gbit/s values") from None
        if isinstance(v, bool) or not math.isfinite(x) or x <= 0:
            raise ValueError(f"{field} holds {v!r}; allowed: positive finite Gbit/s values, e.g. [1, 10, 25, 100, 200]")
        out.append(x)
    if not out:
        raise ValueError(f"{field}=[] is empty; give at least one link bandwidth in Gbit/s, e.g. [1, 10, 25, 100, 200]")
    return sorted(set(out))


def crossing(a: Route, b: Route) -> float | None:
    """The bandwidth (Gbit/s) where ``a`` and ``b`` take the same time, or None where they never do at a positive,
    finite one (see the module docstring)."""
    d_fixed, d_bits = a.fixed_s - b.fixed_s, a.bits - b.bits
    if d_fixed == 0 or d_bits == 0 or (d_fixed > 0) == (d_bits > 0):
        return None
    return -d_bits / d_fixed / GBIT


def faster_range(a: Route, b: Route) -> list[float] | None:
    """``[low, high]`` Gbit/s where ``a`` is strictly faster than ``b`` (0 and ``inf`` for open ends), or None."""
    d_fixed, d_bits = a.fixed_s - b.fixed_s, a.bits - b.bits
    x = crossing(a, b)
    if x is not None:
        # at high bandwidth the transfer term vanishes and the smaller fixed time wins
        return [x, math.inf] if d_fixed < 0 else [0.0, x]
    # no sign change on (0, inf): ttft_a - ttft_b has the sign of whichever difference is not zero
    if d_fixed <= 0 and d_bits <= 0 and (d_fixed < 0 or d_bits < 0):
        return [0.0, math.inf]
    return None


def intersect(*ranges: Sequence[float] | None) -> list[float] | None:
    """The bandwidths every range holds, or None."""
    if any(r is None for r in ranges):
        return None
    lo, hi = max(r[0] for r in ranges), min(r[1] for r in ranges)  # type: ignore[index]
    return [lo, hi] if lo < hi else None


def crossovers(compressed: Route, sixteen: Route, prefill: Route) -> dict[str, object]:
    """The crossings and ranges of one context (named in the module docstring)."""
    beats_16 = faster_range(compressed, sixteen)
    beats_prefill = faster_range(compressed, prefill)
    return {
        "crossover_16bit_gbps": crossing(compressed, sixteen),
        "crossover_prefill_gbps": crossing(compressed, prefill),
        "crossover_16bit_prefill_gbps": crossing(sixteen, prefill),
        "compressed_faster_than_16bit_gbps": beats_16,
        "compressed_faster_than_prefill_gbps": beats_prefill,
        "16bit_faster_than_prefill_gbps": faster_range(sixteen, prefill),
        "compressed_fastest_gbps": intersect(beats_16, beats_prefill),
    }


def fastest(routes: Sequence[Route], gbps: float) -> str:
    """The name of the quickest route at ``gbps`` (the first listed on a tie)."""
    return min(routes, key=lambda r: r.ttft_s(gbps)).name


def ttft_rows(compressed: Route, sixteen: Route, prefill: Route, bandwidths: Sequence[float]) -> list[dict]:
    """One row per bandwidth: each route's transfer and time to first token, and which is quickest."""
    rows = []
    for gbps in bandwidths:
        rows.append({
            "bandwidth_gbps": gbps,
            "ttft_s": compressed.ttft_s(gbps),
            "ttft_16bit_s": sixteen.ttft_s(gbps),
            "ttft_prefill_s": prefill.ttft_s(gbps),
            "transfer_s": compressed.transfer_s(gbps),
            "transfer_16bit_s": sixteen.transfer_s(gbps),
            "transfer_prefill_s": prefill.transfer_s(gbps),
            "fastest": fastest((compressed, sixteen, prefill), gbps),
        })
    return rows


def id_bits(vocab_size: int) -> int:
    """Bits per plainly coded token id: ceil(log2 V)."""
    return max(1, math.ceil(math.log2(int(vocab_size))))
