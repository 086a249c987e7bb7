"""Encoder and decoder as two parties: what crosses between them is bytes, and the harness counts every one.

The encoder is the configured compressor, fitted on calibration windows. Its fitted state
(:meth:`~kvbench.core.compressor.Compressor.state`) is framed as a checksummed bitstream whose bits the harness counts
(``codec_bits``, charged once per run). The decoder is a fresh instance rebuilt from the config alone
(:func:`~kvbench.core.compressor.rebuild`) that has loaded those bytes, so no Python object passes anything uncounted
from one side to the other.

A fitted state kept for later runs (:func:`state_cache_path`) is ``<name>-<key>.state``, the framed bitstream itself
(its CRC-32 catches a flipped bit or a cut), beside ``<name>-<key>.stats.json``, what the fit reported, sealed with
the hash of its body (:func:`kvbench.store.integrity.seal`). Either file damaged, empty or unreadable is one
:class:`~kvbench.store.integrity.IntegrityError` line naming it; deleting it makes the next run fit again.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.core.compressor import Compressor, fits, rebuild
from kvbench.core.kv import KVSequence
from kvbench.core.timing import Stopwatch
from kvbench.store.atomic import why_unwritable, write_bytes
from kvbench.store.integrity import damaged, read_sealed_json, seal
from kvbench.store.paths import home
from kvbench.store.results import git_sha


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
    cached: bool = False  # the state was fitted by an earlier run on the same calibration set
    fit_stats: dict | None = None  # what the fit reported (kept beside a cached state, so a cached run reports it too)

    @property
    def codec_bits(self) -> int:
        return state_bits(self.state)

    def stats(self) -> dict:
        """What both sides measured along the way (encode stages on one, decode stages on the other); a number
        both report, such as a predictor's set-up time, is summed: each side paid it."""
        out = {**(self.fit_stats or {}), **self.encoder.stats()}
        for k, v in self.decoder.stats().items():
            out[k] = out[k] + v if isinstance(v, (int, float)) and isinstance(out.get(k), (int, float)) else out.get(k, v)
        return out


def state_cache_path(compressor: Compressor, calib_id: str) -> Path | None:
    """Where the fitted state of ``compressor`` on the calibration set ``calib_id`` is kept, so that a sweep fits
    each (model, data, compressor) once; None when the code version is not a commit (a dirty tree could fit
    differently from the one that wrote the file)."""
    sha = git_sha()
    if sha.endswith("-dirty") or sha == "unknown":
        return None
    blob = json.dumps([calib_id, compressor.describe(), sha], sort_keys=True, default=str)
    return home() / "codecs" / f"{compressor.name}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}.state"


def prepare(compressor: Compressor, calib: Callable[[], Sequence[KVSequence]], device: str = "cpu",
            cache: Path | None = None, config: Any = None) -> Codec:
    """Fit ``compressor`` on ``calib()`` (read only when it learns anything) and rebuild its decoder from bytes.

    With ``cache`` (see :func:`state_cache_path`), state fitted earlier on the same calibration set is loaded from
    that file instead (``fit_s`` is then 0 and the encoder, too, is rebuilt from the bytes), and a fresh fit is
    written there atomically.
    """
    watch = Stopwatch(device)
    if not fits(compressor):
        return Codec(compressor, decoder_for(compressor, state_bytes(compressor)), state_bytes(compressor), 0.0)
    if cache is not None and cache.exists():
        state, fit_stats = read_cached_state(compressor, cache)
        return Codec(decoder_for(compressor, state), decoder_for(compressor, state), state, 0.0, cached=True,
                     fit_stats=fit_stats)
    windows = list(calib())
    with watch():
        compressor.fit(windows, config=config)
    fit_stats = compressor.stats()
    state = state_bytes(compressor)
    if cache is not None and state:  # a fit that only warms up (no state) is redone: it is cheap
        try:
            # the stats first: a state file on disk implies its stats are there
            write_bytes(_stats_path(cache), json.dumps(seal(fit_stats, default=_plain), sort_keys=True).encode())
            write_bytes(cache, state)
        except OSError as e:  # the cache only saves later runs a fit; this run has its state in memory
            print(f"warning: fitted state not kept in {cache.parent}: {why_unwritable(e)}; later runs fit again",
                  file=sys.stderr)
    return Codec(compressor, decoder_for(compressor, state), state, watch.seconds, fit_stats=fit_stats)


def read_cached_state(compressor: Compressor, cache: Path) -> tuple[bytes, dict]:
    """The state bytes in ``cache`` and the fit's stats beside them, both checked: a state that is empty, fails its
    frame's checksum or was written by another compressor, and stats that are missing or fail their seal, are an
    :class:`~kvbench.store.integrity.IntegrityError` naming the file."""
    rebuild = f"delete {cache} (and {_stats_path(cache).name} beside it) and rerun: the run fits the codec again"
    state = cache.read_bytes()
    if not state:
        raise damaged(cache, "is an empty fitted state", rebuild)
    try:
        Bitstream.from_bytes(state).sections(expect=state_name(compressor))
    except BitstreamError as e:
        raise damaged(cache, f"is not a sound fitted state ({e})", rebuild) from e
    side = _stats_path(cache)
    if not side.exists():  # written before the state, so a state without its stats was not written by prepare()
        raise damaged(side, "is missing beside its fitted state", rebuild)
    return state, read_sealed_json(side, rebuild)


def _stats_path(cache: Path) -> Path:
    return cache.with_suffix(".stats.json")


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else str(value)
