"""Rate, computed by the harness from the bitstreams' exact bit counts — never by a compressor."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping

BASELINE_BITS = 16


def rate_summary(num_bits: Iterable[int], parts: Iterable[Mapping[str, int]], n_tokens: int, n_elements: int,
                 codec_bits: int = 0) -> dict:
    """Totals over every sequence of a run, plus the codec's fitted state (predictors, steps) charged once per run.

    ``stream_*`` count the bitstreams alone; ``codec_bits`` is the serialised state the decoder must hold (also
    reported as ``side_info_bits``, its earlier name), and the ``bits_*``/``compression_ratio`` keys include it.
    """
    streams = int(sum(num_bits))
    total = streams + codec_bits
    by_part: Counter[str] = Counter()
    for p in parts:
        by_part.update(p)
    if codec_bits:
        by_part["side_info"] += codec_bits
    return {
        "total_bits": int(total),
        "bits_per_element": total / n_elements,
        "bits_per_token": total / n_tokens,
        "compression_ratio": BASELINE_BITS * n_elements / total if total else math.inf,
        "stream_bits": streams,
        "stream_bits_per_element": streams / n_elements,
        "stream_compression_ratio": BASELINE_BITS * n_elements / streams if streams else math.inf,
        "codec_bits": int(codec_bits),
        "side_info_bits": int(codec_bits),
        "bits_by_part": dict(by_part),
    }


def bound_bits_per_token(logprobs_nats: Iterable[float], count: int) -> float:
    """Mean cross-entropy of tokens under the model, in bits: the paper's H(token | history)."""
    return -float(sum(logprobs_nats)) / count / math.log(2) if count else math.nan
