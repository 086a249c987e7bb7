"""Which tokens of a planted needle an eviction method keeps: the mechanism behind a lost retrieval.

A RULER needle's value (a 7-digit number, a word, a UUID) is several tokens, and an eviction method keeps a
fixed share of the tokens of every (layer, KV head) by its own score. Under the kvpress protocol the context is
compressed before the question is seen, so a query-aware scorer (SnapKV's observation window, TOVA's last query)
scores the needle with the queries of the haystack's tail; with the question prefilled too (``query_aware``) the
question's queries do the scoring. :func:`needle_kept` measures, for one example, in how many (layer, KV head)
pairs each method keeps every token of the value, and in how many some but not all (a partial value: the digits
the model reads back are not the needle's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvbench.core.kv import Context, KVSequence
from kvbench.inputs.capture import capture_window

PROTOCOLS = ("context_only", "query_aware")


@dataclass(frozen=True)
class NeedleKept:
    """One method on one example under one protocol."""

    tokens: int  # tokens in the compressed segment
    needle: tuple[int, ...]  # positions of the value's tokens in it
    whole: float  # share of (layer, KV head) pairs that keep every token of the value
    some: float  # share that keep at least one but not all
    kept: torch.Tensor  # (L, H, n) bool: the value's tokens each pair keeps


def needle_positions(offsets: list[tuple[int, int]], start: int, stop: int) -> list[int]:
    """The tokens whose characters overlap ``[start, stop)`` of the text they were cut from."""
    return [i for i, (s, e) in enumerate(offsets) if s < stop and e > start]


def segment(tokenizer: Any, example: dict, protocol: str) -> tuple[list[int], list[int]]:
    """``(ids, needle)``: the tokens a cache compresses for ``example`` under ``protocol`` (the context alone, or
    the whole prompt but its last token, as the evaluation splits it) and the positions of the first answer's
    tokens among them."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol {protocol!r}; one of {list(PROTOCOLS)}")
    context, answer = example["context"], example["answers"][0]
    at = context.find(answer)
    if at < 0:
        raise ValueError(f"example {example.get('id')}: its answer {answer!r} is not in its context; a needle task's is")
    text = context if protocol == "context_only" else context + example["query"]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc.input_ids if protocol == "context_only" else enc.input_ids[:-1]
    return ids, needle_positions(enc.offset_mapping[: len(ids)], at, at + len(answer))


@torch.no_grad()
def needle_kept(handle: Any, methods: dict[str, Any], example: dict, protocol: str) -> dict[str, NeedleKept]:
    """Per eviction method (:mod:`compressors.eviction`: anything with ``kept_mask``), the needle's tokens each (layer, KV head) keeps when the segment of ``example`` that
    ``protocol`` compresses is prefilled by ``handle``'s model and scored by the method."""
    ids, needle = segment(handle.tokenizer, example, protocol)
    got = capture_window(handle.model, torch.tensor(ids), len(ids), torch.float32)
    kv = KVSequence(got["k"], got["v"], torch.tensor(ids))
    ctx = Context.for_kv(kv, model=handle, config=handle.model.config)
    out = {}
    for name, method in methods.items():
        kept = method.kept_mask(kv, ctx)[..., needle]  # (L, H, n)
        whole = kept.all(-1)  # (L, H)
        some = kept.any(-1) & ~whole  # (L, H)
        out[name] = NeedleKept(len(ids), tuple(needle), float(whole.float().mean()), float(some.float().mean()), kept)
    return out
