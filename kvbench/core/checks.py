"""Validation of hyperparameters, with errors that name the field, the bad value and what is allowed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def check_choice(owner: str, field: str, value: Any, allowed: Iterable[Any]) -> None:
    """Raise a ValueError that names the field, the bad value and what is allowed."""
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"{owner}.{field}={value!r} is not allowed; choose one of {allowed}")


def check_range(owner: str, field: str, value: float, lo: float, hi: float, *, integer: bool = False) -> None:
    """Raise a ValueError unless ``lo <= value <= hi`` (and integral when asked)."""
    if integer and (isinstance(value, bool) or int(value) != value):
        raise ValueError(f"{owner}.{field}={value!r} must be a whole number in [{lo}, {hi}]")
    if not lo <= value <= hi:
        raise ValueError(f"{owner}.{field}={value!r} is out of range; allowed: {lo} <= {field} <= {hi}")
