"""What the run path codes and scores: items (one sequence each) from a source (dataset windows or a workload)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.core.kv import Context, KVSequence


@dataclass
class Item:
    """One sequence: its KV, and what is scored on its reconstruction.

    ``continuation`` (``(E + 1,)`` token ids, or None: not scored) is scored on the first ``score_from`` tokens of
    the reconstructed cache; ``extras`` goes into the encoder's context only (never the decoder's).
    """

    kv: KVSequence
    score_from: int
    continuation: torch.Tensor | None
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class Source:
    """The items of one cell, its calibration windows (read only when the compressor fits) and the summary
    fields that describe where the items came from."""

    items: list[Item]
    calib: Callable[[], Sequence[KVSequence]]
    fields: dict[str, Any]
    calib_id: str = ""  # names the calibration set, for the fitted-state cache


def coding_contexts(items: Sequence[Item], model: Any, config: Any) -> tuple[list[Context], list[Context]]:
    """Fresh encoder and decoder contexts for coding ``items``: the encoder's carry each item's ``extras``, which
    never reach the decoder's."""
    enc = []
    for it in items:
        ctx = Context.for_kv(it.kv, model, config)
        ctx.extras.update(it.extras)
        enc.append(ctx)
    return enc, [Context.for_kv(it.kv, model, config) for it in items]
