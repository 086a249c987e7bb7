"""Content hashes for the files later verdicts rest on: a trace, a fitted codec state, a finished run's per-token
NLLs and table.

Each such file gets its SHA-256 recorded when it is written (in a manifest or summary beside it) and checked when it
is read. A file that does not match, is empty, or cannot be parsed raises :class:`IntegrityError`, one line naming
the file and what rebuilds it, before anything is computed from it: a flipped bit must not turn into a plausible
number, nor into a crash minutes later deep inside a measurement.

A JSON file that describes other files (a trace's manifest, a fitted state's stats) carries the hash of its own body
under :data:`SEAL`: :func:`seal` adds it, :func:`read_sealed_json` checks it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: the key under which a sealed JSON object holds the SHA-256 of the rest of its body
SEAL = "sha256"
_CHUNK = 1 << 20


class IntegrityError(ValueError):
    """A stored input is damaged, truncated, empty or carries no hash to check it by; the message names the file and
    what rebuilds it."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def damaged(path: Path, why: str, rebuild: str) -> IntegrityError:
    """The error for ``path``: what is wrong with it and how to rebuild it, on one line."""
    return IntegrityError(f"{path} {why}; nothing was computed from it. Rebuild it: {rebuild}")


def check_hash(path: Path, expected: str | None, rebuild: str, data: bytes | None = None) -> None:
    """Raise :class:`IntegrityError` unless ``path`` (or its already read ``data``) hashes to ``expected``."""
    if not expected:
        raise damaged(path, "has no recorded content hash to check it by", rebuild)
    got = sha256_bytes(data) if data is not None else sha256_file(path)
    if got != expected:
        raise damaged(path, f"fails its content hash (sha256 {got[:16]}, recorded {expected[:16]} when it was written)",
                      rebuild)


def _canonical(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def seal(obj: dict, default: Callable[[Any], Any] = str) -> dict:
    """``obj`` as it reads back from JSON, with the hash of that body under :data:`SEAL`."""
    body = json.loads(json.dumps(obj, default=default))  # what a reader will see: tuples as lists, paths as text
    body.pop(SEAL, None)
    return {**body, SEAL: sha256_bytes(_canonical(body))}


def read_sealed_json(path: Path, rebuild: str) -> dict:
    """A JSON object written by :func:`seal`, checked against its own hash; any damage (unreadable text, a
    truncated file, a changed value, no hash) is an :class:`IntegrityError` naming ``path``."""
    try:
        body = json.loads(Path(path).read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise damaged(path, f"is not readable JSON ({e})", rebuild) from e
    if not isinstance(body, dict):
        raise damaged(path, "is not a JSON object", rebuild)
    recorded = body.pop(SEAL, None)
    if not recorded:
        raise damaged(path, "carries no content hash (written by an older kvbench, or damaged)", rebuild)
    got = sha256_bytes(_canonical(body))
    if got != recorded:
        raise damaged(path, f"fails its content hash (sha256 {got[:16]} of its body, recorded {str(recorded)[:16]})",
                      rebuild)
    return body
