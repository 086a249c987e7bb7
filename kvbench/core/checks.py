"""Validation of hyperparameters, with errors that name the field, the bad value and what is allowed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def _named(owner: str, field: str) -> str:
    """``owner.field``, or ``field`` for a top-level config field (``owner`` empty)."""
    return f"{owner}.{field}" if owner else field


def check_choice(owner: str, field: str, value: Any, allowed: Iterable[Any]) -> None:
    """Raise a ValueError that names the field, the bad value and what is allowed."""
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"{_named(owner, field)}={value!r} is not allowed; choose one of {allowed}")


def check_range(owner: str, field: str, value: float, lo: float, hi: float, *, integer: bool = False) -> None:
    """Raise a ValueError unless ``lo <= value <= hi`` (and integral when asked)."""
    if integer and (isinstance(value, bool) or int(value) != value):
        raise ValueError(f"{owner}.{field}={value!r} must be a whole number in [{lo}, {hi}]")
    if not lo <= value <= hi:
        raise ValueError(f"{owner}.{field}={value!r} is out of range; allowed: {lo} <= {field} <= {hi}")


def check_count(owner: str, field: str, value: Any, least: int, what: str = "") -> int:
    """``value`` as an int, or a ValueError unless it is a whole number of at least ``least`` (``what`` says what it
    counts)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{_named(owner, field)}={value!r} must be a whole number of at least {least}"
                         f"{f' ({what})' if what else ''}")
    return value


def check_flag(owner: str, field: str, value: Any) -> bool:
    """``value``, or a ValueError unless it is true or false (a word such as ``yes`` would read as true)."""
    if not isinstance(value, bool):
        raise ValueError(f"{_named(owner, field)}={value!r} is not allowed; choose true or false")
    return value
