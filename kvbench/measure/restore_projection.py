"""A projection, not a measurement: the restore table carried to larger model shapes (Llama-3.1-8B and -70B by
default) at a longer context, from what ``python -m kvbench restore`` measured on the small model.

What each number rests on (``restore.projection`` in ``configs/restore.yaml``):

- bytes: the coder's measured bitstream bits per KV element (largest measured context) times the shape's KV elements
  ``2 * layers * kv_heads * head_dim * tokens``. Codec state (fitted parameters) is left out: it belongs to a model
  and was measured on another one. 16-bit KV: 2 bytes per element. Prefill: ``tokens * ceil(log2 vocab)`` bits.
- coding time: the shape's elements at the coder's measured elements per second on this machine (encode and decode
  measured separately), so a coder timed on the CPU is projected at CPU speed.
- model time, at an assumed effective accelerator throughput ``flops`` (FLOP/s) and memory bandwidth
  ``memory_bytes_per_s`` (a roofline: the larger of compute and memory time)::

      prefill(T)     = 2 * params * T + 2 * layers * heads * head_dim * T**2    FLOPs over T tokens, causal
                       (QK^T and AV each 2 * layers * heads * head_dim * T**2 / 2 with the mask)
      first token(T) = max((2 * params + 4 * layers * heads * head_dim * T) / flops,
                           (2 * params + 16-bit KV bytes) / memory_bytes_per_s)
                       one new token against T cached ones: reads the 16-bit weights and the cache once

  ``heads`` are the query heads (GQA shares K/V, not the attention arithmetic).

Coders whose decoder runs the model (``needs_model``: recompute, speculative) do not cost time per KV element, so
the per-element projection does not apply to them and is left out with a note.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbench.core.checks import check_range
from kvbench.measure.ttft import Route, crossovers, id_bits, ttft_rows

LABEL = "PROJECTION (modelled from measured rates and assumed accelerator throughput; not measured)"
FORMULA = ("prefill FLOPs = 2*params*T + 2*layers*heads*head_dim*T^2; first token = max((2*params + "
           "4*layers*heads*head_dim*T) / flops, (2*params + 16-bit KV bytes) / memory_bytes_per_s); coding time = "
           "KV elements / measured elements per second; bytes = measured bitstream bits/element x KV elements / 8")


@dataclass(frozen=True)
class Shape:
    """A model's shape as far as KV size and FLOPs go."""

    name: str
    n_layers: int
    n_kv_heads: int
    n_heads: int  # query heads
    head_dim: int
    params: float
    vocab_size: int

    @classmethod
    def from_config(cls, name: str, node: Mapping[str, Any]) -> Shape:
        fields = ("n_layers", "n_kv_heads", "n_heads", "head_dim", "params", "vocab_size")
        missing = [f for f in fields if f not in node]
        if missing:
            raise ValueError(f"restore.projection.models.{name} lacks {missing}; each model gives {list(fields)}")
        for f in fields:
            check_range(f"restore.projection.models.{name}", f, float(node[f]), 1, 1e15, integer=f != "params")
        return cls(name, int(node["n_layers"]), int(node["n_kv_heads"]), int(node["n_heads"]), int(node["head_dim"]),
                   float(node["params"]), int(node["vocab_size"]))

    def kv_elements(self, tokens: int) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * tokens  # K and V

    def prefill_flops(self, tokens: int) -> float:
        return 2 * self.params * tokens + 2 * self.n_layers * self.n_heads * self.head_dim * tokens**2

    def step_flops(self, cached: int) -> float:
        return 2 * self.params + 4 * self.n_layers * self.n_heads * self.head_dim * cached


@dataclass(frozen=True)
class Accelerator:
    """Assumed effective throughput of the accelerator the projection runs the model on."""

    flops: float  # FLOP/s
    memory_bytes_per_s: float

    def prefill_s(self, shape: Shape, tokens: int) -> float:
        return max(shape.prefill_flops(tokens) / self.flops, 2 * shape.params / self.memory_bytes_per_s)

    def first_token_s(self, shape: Shape, cached: int) -> float:
        kv16 = 2 * shape.kv_elements(cached)
        return max(shape.step_flops(cached) / self.flops, (2 * shape.params + kv16) / self.memory_bytes_per_s)


def accelerator(node: Mapping[str, Any]) -> Accelerator:
    flops, mem = float(node["flops"]), float(node["memory_bytes_per_s"])
    check_range("restore.projection", "flops", flops, 1e9, 1e18)
    check_range("restore.projection", "memory_bytes_per_s", mem, 1e9, 1e15)
    return Accelerator(flops, mem)


def project(measured: Mapping[str, float], node: Mapping[str, Any], bandwidths: list[float],
            needs_model: bool) -> dict[str, Any]:
    """The projected table for every shape in ``node`` (``restore.projection``). ``measured`` holds the coder's
    ``bits_per_element`` (bitstream only) and ``encode_elements_per_s`` / ``decode_elements_per_s``."""
    tokens = int(node["tokens"])
    check_range("restore.projection", "tokens", tokens, 1, 10**8, integer=True)
    acc = accelerator(node)
    out: dict[str, Any] = {
        "label": LABEL, "formula": FORMULA, "tokens": tokens,
        "assumptions": {"flops": acc.flops, "memory_bytes_per_s": acc.memory_bytes_per_s,
                        "coder_rates": "measured on this machine (see measured)"},
        "from_measured": dict(measured), "models": {},
    }
    if needs_model:
        out["skipped"] = ("the decoder runs the model (needs_model): its time does not scale per KV element, so the "
                          "per-element projection does not apply")
        return out
    for name, spec in (node.get("models") or {}).items():
        shape = Shape.from_config(str(name), spec)
        n_el = shape.kv_elements(tokens)
        first = acc.first_token_s(shape, tokens)
        decode_s = n_el / measured["decode_elements_per_s"] if measured["decode_elements_per_s"] > 0 else math.inf
        encode_s = n_el / measured["encode_elements_per_s"] if measured["encode_elements_per_s"] > 0 else math.inf
        comp = Route("compressed", measured["bits_per_element"] * n_el, decode_s + first)
        sixteen = Route("16bit", 16.0 * n_el, first)
        prefill = Route("prefill", float(tokens * id_bits(shape.vocab_size)), acc.prefill_s(shape, tokens + 1))
        out["models"][shape.name] = {
            "shape": {k: getattr(shape, k) for k in ("n_layers", "n_kv_heads", "n_heads", "head_dim", "params",
                                                     "vocab_size")},
            "kv_elements": n_el, "bytes": comp.bits / 8, "bytes_16bit": sixteen.bits / 8, "bytes_ids": prefill.bits / 8,
            "encode_s": encode_s, "decode_s": decode_s, "first_token_s": first, "prefill_s": prefill.fixed_s,
            "rows": ttft_rows(comp, sixteen, prefill, bandwidths),
            "crossovers": crossovers(comp, sixteen, prefill),
        }
    return out
