"""Rate, computed by the harness from the bitstreams' exact bit counts — never by a compressor."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping

BASELINE_BITS = 16


def rate_summary(num_bits: Iterable[int], parts: Iterable[Mapping[str, int]], n_tokens: int, n_elements: int,
                 side_info_bits: int = 0) -> dict:
    """Totals over every sequence of a run, plus once-per-run side information (fitted predictors, codebooks)."""
    total = sum(num_bits) + side_info_bits
    by_part: Counter[str] = Counter()
    for p in parts:
        by_part.update(p)
    if side_info_bits:
        by_part["side_info"] += side_info_bits
    return {
        "total_bits": int(total),
        "bits_per_element": total / n_elements,
        "bits_per_token": total / n_tokens,
        "compression_ratio": BASELINE_BITS * n_elements / total if total else math.inf,
        "side_info_bits": int(side_info_bits),
        "bits_by_part": dict(by_part),
    }


def bound_bits_per_token(logprobs_nats: Iterable[float], count: int) -> float:
    """Mean cross-entropy of tokens under the model, in bits: the paper's H(token | history)."""
    return -float(sum(logprobs_nats)) / count / math.log(2) if count else math.nan
