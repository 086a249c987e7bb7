"""Rate, computed by the harness from the bitstreams' exact bit counts — never by a compressor."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping

BASELINE_BITS = 16


#: tokens a deployment codes with one fitted codec, over which ``bits_per_element_amortized`` spreads its state
AMORTIZE_TOKENS = 1_000_000


def rate_summary(num_bits: Iterable[int], parts: Iterable[Mapping[str, int]], n_tokens: int, n_elements: int,
                 codec_bits: int = 0, amortize_tokens: int = AMORTIZE_TOKENS) -> dict:
    """Totals over every sequence of a run, plus the codec's fitted state (predictors, steps) charged once per run.

    Three rates, named: ``stream_*`` count the bitstreams alone; the ``bits_*``/``compression_ratio`` keys charge
    ``codec_bits`` (the serialised state the decoder must hold, also reported as ``side_info_bits``, its earlier
    name) once to this run; ``bits_per_element_amortized`` charges this run's share of it when one fitted codec
    serves ``amortize_tokens`` tokens (all of it when the run has at least that many).
    """
    if amortize_tokens < 1:
        raise ValueError(f"rate.amortize_tokens={amortize_tokens} must be at least 1 (tokens one fitted codec serves)")
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
        "bits_per_element_amortized": (streams + codec_bits * min(1.0, n_tokens / amortize_tokens)) / n_elements,
        "amortize_tokens": int(amortize_tokens),
        "codec_bits": int(codec_bits),
        "side_info_bits": int(codec_bits),
        "bits_by_part": dict(by_part),
    }


def bound_bits_per_token(logprobs_nats: Iterable[float], count: int) -> float:
    """Mean cross-entropy of tokens under the model, in bits: the paper's H(token | history)."""
    return -float(sum(logprobs_nats)) / count / math.log(2) if count else math.nan
