"""Encoder and decoder as two parties: what crosses between them is bytes, and the harness counts every one.

The encoder is the configured compressor, fitted on calibration windows. Its fitted state
(:meth:`~kvbench.compressor.Compressor.state`) is framed as a checksummed bitstream whose bits the harness counts
(``codec_bits``, charged once per run). The decoder is a fresh instance rebuilt from the config alone
(:func:`~kvbench.compressor.rebuild`) that has loaded those bytes, so no Python object passes anything uncounted
from one side to the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbench.coding.bitstream import Bitstream
from kvbench.compressor import Compressor, fits, rebuild
from kvbench.kv import KVSequence
from kvbench.timing import Stopwatch


def state_name(compressor: Compressor) -> str:
    return f"{compressor.name}.state"


def state_bytes(compressor: Compressor) -> bytes:
    """The encoder's fitted state as a framed bitstream (empty when nothing was fitted)."""
    sections = compressor.state()
    return Bitstream.pack(state_name(compressor), sections).data if sections else b""


def state_bits(state: bytes) -> int:
    """Every bit of a state stream, counted from its bytes (its frame included)."""
    return Bitstream.from_bytes(state).num_bits if state else 0


def decoder_for(compressor: Compressor, state: bytes) -> Compressor:
    """A fresh instance of ``compressor``'s config that knows only ``state``."""
    fresh = rebuild(compressor)
    fresh.load_state(Bitstream.from_bytes(state).sections(expect=state_name(compressor)) if state else {})
    return fresh


@dataclass
class Codec:
    """A fitted encoder, the decoder rebuilt from its state bytes, and what that cost."""

    encoder: Compressor
    decoder: Compressor
    state: bytes
    fit_s: float

    @property
    def codec_bits(self) -> int:
        return state_bits(self.state)

    def stats(self) -> dict:
        """What both sides measured along the way (encode stages on one, decode stages on the other); a number
        both report, such as a predictor's set-up time, is summed: each side paid it."""
        out = dict(self.encoder.stats())
        for k, v in self.decoder.stats().items():
            out[k] = out[k] + v if isinstance(v, (int, float)) and isinstance(out.get(k), (int, float)) else out.get(k, v)
        return out


def prepare(compressor: Compressor, calib: Callable[[], Sequence[KVSequence]], device: str = "cpu") -> Codec:
    """Fit ``compressor`` on ``calib()`` (read only when it learns anything) and rebuild its decoder from bytes."""
    watch = Stopwatch(device)
    if fits(compressor):
        windows = list(calib())
        with watch():
            compressor.fit(windows)
    state = state_bytes(compressor)
    return Codec(compressor, decoder_for(compressor, state), state, watch.seconds)
