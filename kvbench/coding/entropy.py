"""Batched entropy coding with constriction (Bamler, "Understanding entropy coding with asymmetric numeral
systems", arXiv 2201.01741): the probability model is separate from the coder, and bit counts come from the coder.

Every call takes whole numpy arrays; the per-symbol loop runs inside constriction's compiled coder. Streams
are range-coded, several batches to one stream, and returned as ``(bytes, exact_bits)`` for :meth:`kvbench.coding.bitstream.Bitstream.pack`. Next to
each actual size, :func:`ideal_bits_*` give the model's own estimate ``sum(-log2 p(symbol))`` so that reports can
show coder overhead (actual vs. model-estimated rate, as CompressAI does).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import constriction
import numpy as np

from kvbench.coding.bitstream import BitstreamError

_model = constriction.stream.model
_queue = constriction.stream.queue
#: values a quantized Laplace may span: the coder's 24-bit probabilities give each at least one unit
MAX_SUPPORT = 1 << 24


def _finish(enc) -> tuple[bytes, int]:
    words = enc.get_compressed()  # uint32 words; the coder's real output
    return words.astype("<u4").tobytes(), 32 * len(words)


def _words(raw: bytes) -> np.ndarray:
    if len(raw) % 4:
        raise BitstreamError(f"entropy-coded section of {len(raw)} bytes is not a whole number of 32-bit words")
    return np.frombuffer(raw, dtype="<u4").astype(np.uint32)


def _as_params(x, n: int) -> np.ndarray:
    return np.broadcast_to(np.asarray(x, dtype=np.float64), (n,)).copy()


def _safe_scale(scale, n: int) -> np.ndarray:
    # The same floor on both sides: the decoder must see the very same model the encoder used.
    return np.maximum(_as_params(scale, n), 1e-3)


def laplace_bits(symbols: np.ndarray, scale, mean=0.0) -> np.ndarray:
    """-log2 p of each symbol under the same quantized Laplace (flattened), floored where p underflows (1e-300).

    In closed form, one transcendental call per symbol: with ``t = |x - mean|`` and scale ``b``, a cell that lies on
    one side of the mean (``t >= 1/2``) has mass ``exp(-t/b) sinh(1/(2b))``, the cell around it
    ``1 - exp(-1/(2b)) cosh(t/b)``; a difference of two CDFs would cancel to 0 far out on the upper side.
    """
    t = np.abs(np.asarray(symbols, dtype=np.float64).reshape(-1) - _as_params(mean, np.size(symbols)))
    b = _safe_scale(scale, t.size)
    bits = np.empty_like(t)
    far = t >= 0.5
    tf, bf = t[far], b[far]
    bits[far] = tf / (bf * np.log(2.0)) - np.log2(np.sinh(0.5 / bf))
    tn, bn = t[~far] / b[~far], 0.5 / b[~far]
    bits[~far] = -np.log2(-0.5 * (np.expm1(tn - bn) + np.expm1(-tn - bn)))
    return np.minimum(bits, -np.log2(1e-300))


def ideal_bits_laplace(symbols: np.ndarray, scale, mean=0.0) -> float:
    """The model's own estimate of the coded size, sum(-log2 p), for the same quantized Laplace."""
    return float(laplace_bits(symbols, scale, mean).sum())


def ideal_bits_categorical(symbols: np.ndarray, probs: np.ndarray) -> float:
    p = np.asarray(probs, dtype=np.float64)
    s = np.asarray(symbols, dtype=np.int64).reshape(-1)
    p = p / p.sum(axis=-1, keepdims=True)
    chosen = p[s] if p.ndim == 1 else p[np.arange(s.size), s]
    return float(-np.log2(np.maximum(chosen, 1e-300)).sum())


class StreamEncoder:
    """One range-coded stream written in several batched calls, finished once.

    For models that change between batches: one shared row per group of symbols (fitted histograms per
    channel), or rows that only exist one step at a time (a language model's next-token distribution). One
    stream pays the coder's final flush once instead of once per call.
    """

    def __init__(self) -> None:
        self._enc = _queue.RangeEncoder()

    def categorical(self, symbols: np.ndarray, probs: np.ndarray) -> None:
        """Code ``symbols[i]`` under row ``probs[i]`` (``(n, K)``) or one shared row (``(K,)``)."""
        s = np.ascontiguousarray(symbols, dtype=np.int32).reshape(-1)
        if not s.size:
            return
        p = np.asarray(probs, dtype=np.float64)
        if p.ndim == 1:
            self._enc.encode(s, _model.Categorical(p, perfect=False))
        else:
            self._enc.encode(s, _model.Categorical(perfect=False), np.ascontiguousarray(p))

    def categorical_rows(self, symbols: np.ndarray, probs: Sequence[np.ndarray]) -> None:
        """Code row ``g`` of ``symbols`` ``(G, n)`` under its own distribution ``probs[g]`` (``(K_g,)``): one
        histogram per group (a channel, a head), one coder call per group without per-call conversions."""
        s = np.ascontiguousarray(symbols, dtype=np.int32)
        for row, p in zip(s, probs):
            self._enc.encode(row, _model.Categorical(p, perfect=False))

    def laplace(self, symbols: np.ndarray, scale, lo: int, hi: int, mean=0.0) -> None:
        """Code integers in ``[lo, hi]`` under a quantized Laplace with per-symbol (or scalar) mean and scale."""
        if not 0 <= hi - lo < MAX_SUPPORT:
            raise ValueError(f"a Laplace coder over [{lo}, {hi}]; the coder takes 1 to {MAX_SUPPORT:,} values")
        s = np.ascontiguousarray(symbols, dtype=np.int32).reshape(-1)
        if s.size and (s.min() < lo or s.max() > hi):
            raise ValueError(f"symbols span [{s.min()}, {s.max()}], outside the coder range [{lo}, {hi}]")
        if s.size:
            self._enc.encode(s, _model.QuantizedLaplace(lo, hi), _as_params(mean, s.size), _safe_scale(scale, s.size))

    def finish(self) -> tuple[bytes, int]:
        return _finish(self._enc)


@contextmanager
def _coded(what: str = "entropy-coded section"):
    """Turn the coder library's complaints about a stream (its data does not fit the model, a model built from
    corrupted side information is invalid) into a :class:`BitstreamError`."""
    try:
        yield
    except (AssertionError, ValueError, RuntimeError, OverflowError) as e:
        if isinstance(e, BitstreamError):
            raise
        raise BitstreamError(f"{what} cannot be decoded under its model ({type(e).__name__}: {e})") from e
    except BaseException as e:  # a panic in the coder's Rust code surfaces as pyo3's PanicException
        if type(e).__name__ != "PanicException":
            raise
        raise BitstreamError(f"{what}: the coder refused its model ({e})") from e


class StreamDecoder:
    """Reads a :class:`StreamEncoder` stream back with the same sequence of calls and models.

    A decoder that has read every symbol it expects calls :meth:`finish`: a range-coded stream that was
    truncated, padded or swapped for another decodes to *some* symbols without complaint, and only the end of
    the stream tells.
    """

    def __init__(self, raw: bytes) -> None:
        with _coded():
            self._dec = _queue.RangeDecoder(_words(raw)) if raw else None

    def categorical(self, n: int, probs: np.ndarray) -> np.ndarray:
        if n == 0:
            return np.zeros(0, dtype=np.int32)
        p = np.asarray(probs, dtype=np.float64)
        with _coded():
            if p.ndim == 1:
                return self._decoder().decode(_model.Categorical(p, perfect=False), n).astype(np.int32)
            return self._decoder().decode(_model.Categorical(perfect=False), np.ascontiguousarray(p)).astype(np.int32)

    def categorical_rows(self, n: int, probs: Sequence[np.ndarray]) -> np.ndarray:
        """Read back what :meth:`StreamEncoder.categorical_rows` wrote: ``len(probs)`` rows of ``n``, ``(G, n)``."""
        out = np.empty((len(probs), n), dtype=np.int32)
        if out.size:
            dec = self._decoder()
            with _coded():
                for g, p in enumerate(probs):
                    out[g] = dec.decode(_model.Categorical(p, perfect=False), n)
        return out

    def laplace(self, n: int, scale, lo: int, hi: int, mean=0.0) -> np.ndarray:
        if n == 0:
            return np.zeros(0, dtype=np.int32)
        if not 0 <= hi - lo < MAX_SUPPORT:
            raise BitstreamError(f"entropy-coded section: a Laplace coder over [{lo}, {hi}]; the coder takes "
                                 f"1 to {MAX_SUPPORT:,} values")
        with _coded():
            model = _model.QuantizedLaplace(lo, hi)
            return self._decoder().decode(model, _as_params(mean, n), _safe_scale(scale, n)).astype(np.int32)

    def finish(self, what: str = "entropy-coded section") -> None:
        """Check that the stream ends where its last expected symbol does (raise :class:`BitstreamError` if not)."""
        if self._dec is not None and not self._dec.maybe_exhausted():
            raise BitstreamError(f"{what} does not end where its symbols do: it was truncated, padded or is "
                                 "another section's stream")

    def _decoder(self):
        if self._dec is None:
            raise BitstreamError("entropy-coded section is empty but symbols were expected")
        return self._dec


__all__ = ["StreamDecoder", "StreamEncoder", "ideal_bits_categorical", "ideal_bits_laplace", "laplace_bits"]
