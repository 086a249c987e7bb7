"""The compressor interface.

A compressor turns one sequence's KV into a :class:`~kvbench.bitstream.Bitstream` and back. Its decoder gets the
bitstream and the :class:`~kvbench.kv.Context` (shapes, dtype, model) and nothing else. Hyperparameters are
dataclass fields, validated in ``__post_init__``; composition is by wrapping one compressor in another.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from kvbench.bitstream import Bitstream
from kvbench.kv import Context, KVSequence


class Compressor(abc.ABC):
    """Base class. Subclasses are ``@dataclass``es whose fields are their hyperparameters."""

    #: registered name; also written into every bitstream header
    name: ClassVar[str] = ""
    #: True when decode(encode(kv)) is bit-exact by construction (the harness verifies it on every run)
    lossless: ClassVar[bool] = False
    #: True when the decoder needs ``ctx.model`` (the harness then loads the model)
    needs_model: ClassVar[bool] = False

    def fit(self, calib: Sequence[KVSequence]) -> None:
        """Learn codebooks or predictors on calibration sequences (disjoint from the evaluated ones)."""

    @abc.abstractmethod
    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream: ...

    @abc.abstractmethod
    def decode(self, bs: Bitstream, ctx: Context) -> KVSequence: ...

    def side_info_bits(self) -> int:
        """Bits of state shared by every sequence (fitted predictor weights, codebooks that are not derivable).

        The harness charges them once per run and reports them amortised per token.
        """
        return 0

    def stats(self) -> dict[str, Any]:
        """What the compressor measured along the way, summed over the run's sequences: time per stage (a model
        pass inside decode), the model-estimated size next to the coded one. The harness files it under
        ``compressor_stats``. Never the rate itself: that is counted from the bitstreams.
        """
        return {}

    def describe(self) -> dict[str, Any]:
        """Name and hyperparameters, for summaries."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} if dataclasses.is_dataclass(self) else {}
        return {"name": self.name, **{k: v.describe() if isinstance(v, Compressor) else v for k, v in fields.items()}}


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
