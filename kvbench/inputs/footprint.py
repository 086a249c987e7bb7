"""Whether one window fits in memory, estimated from the model config before the model runs.

A window too large for the machine would otherwise end in the kernel's OOM kill minutes into a capture, with no
message. The peak of one window, in bytes, is estimated as

    peak = runtime + weights + kv_float32 + kv_held + working

    runtime     what this process holds now besides the weights (VmRSS, less the weights where they are loaded),
                at least RUNTIME_BYTES: a loaded model's weights are mapped from its file and become resident only as
                the first forward pass reads them, so the process's size now may not count them yet
    weights     parameters x 4 (float32, as ModelHandle loads them); parameters = V*h (embeddings) [+ V*h, an untied
                LM head] + L * (h*D*(Hq + 2*Hkv) + Hq*D*h + 3*h*I) (attention and a gated MLP; norms and biases,
                under 0.1%, left out)
    kv_float32  2 (K, V) x L x Hkv x D x 4 x (T + S): the float32 cache of every layer the prefill fills and the
                scoring cache holds with the scored tokens S on top (the larger of eval_len and the recall probe)
    kv_held     2 x L x Hkv x D x bytes(cache dtype) x T x n: the windows a run holds in the cache dtype at once (the
                trace's evaluated and calibration windows, and the decoded copy of each evaluated one)
    working     what the chunked forward (kvbench.inputs.forward) needs beside the cache, for c = min(T, PREFILL_CHUNK)
                tokens fed at once: 4 x c x (4h + 4I + 4D*(Hq + Hkv)) of activations (hidden states, the MLP's gate,
                up and their product, queries and keys with RoPE's temporaries), 2 x 4 x Hq x (T + S) x D for K and V
                repeated to the query heads when a chunk attends to a cache through a mask, c x (T + S) bytes per
                boolean mask (one per layer type), 4 x Hq x SCORE_CHUNK x (T + S) for the float mask that hides
                evicted entries, 3 x LOGIT_BYTES for a block of logits, its log-softmax and soft-capped copy; with
                eager attention also 2 x 4 x Hq x c x (T + S) of scores and probabilities

with V the vocabulary, h the hidden size, I the MLP's, L layers, Hq query and Hkv KV heads of D dimensions, T the
prefix. A compressor's own working memory is not in it. The limit is ``memory.limit_gb`` where set, else what the
process holds now plus the machine's ``MemAvailable`` (``/proc/meminfo``); a window over it is refused with one line
naming both before the model is loaded or run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.core.rss import GB, resident_bytes
from kvbench.inputs.forward import LOGIT_BYTES, PREFILL_CHUNK, SCORE_CHUNK

#: bytes per weight as :class:`~kvbench.inputs.models.ModelHandle` loads them (float32)
WEIGHT_BYTES = 4
#: the interpreter with torch and transformers imported (0.30 GB measured with torch 2.13 and transformers 5.24)
RUNTIME_BYTES = 0.3e9


class WindowTooLarge(ValueError):
    """A window's estimated peak memory exceeds the limit."""


@dataclass(frozen=True)
class Footprint:
    """The terms of one window's estimated peak, in bytes (the module docstring gives each formula)."""

    runtime: float
    weights: float
    kv_float32: float
    kv_held: float
    working: float

    @property
    def total(self) -> float:
        return self.runtime + self.weights + self.kv_float32 + self.kv_held + self.working

    def describe(self) -> str:
        parts = {"runtime": self.runtime, "weights": self.weights, "float32 KV": self.kv_float32,
                 "held KV": self.kv_held, "working set": self.working}
        return " + ".join(f"{name} {b / GB:.2f}" for name, b in parts.items() if b)


@dataclass(frozen=True)
class Dims:
    """The sizes the estimate reads from a (text) config, named as in the module docstring."""

    V: int  # vocabulary
    h: int  # hidden size
    mlp: int  # the MLP's hidden size (I)
    L: int  # layers
    Hq: int  # query heads
    Hkv: int  # KV heads
    D: int  # head dimension
    tied: bool  # the LM head is the embedding matrix

    @classmethod
    def of(cls, config: Any) -> Dims:
        c = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        Hq = c.num_attention_heads
        return cls(c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers, Hq,
                   getattr(c, "num_key_value_heads", None) or Hq, getattr(c, "head_dim", None) or c.hidden_size // Hq,
                   bool(getattr(c, "tie_word_embeddings", True)))


def parameters(config: Any) -> int:
    """The model's parameter count from its config (the docstring's formula)."""
    d = Dims.of(config)
    per_layer = d.h * d.D * (d.Hq + 2 * d.Hkv) + d.Hq * d.D * d.h + 3 * d.h * d.mlp
    return d.V * d.h * (1 if d.tied else 2) + d.L * per_layer


def estimate(config: Any, prefix: int, scored: int, held_windows: int, cache_bytes: int,
             loaded: bool) -> Footprint:
    """The estimated peak of one window of ``prefix`` tokens with ``scored`` tokens fed on top, while
    ``held_windows`` windows are held in a ``cache_bytes``-per-element cache dtype; ``loaded``: the weights are
    already loaded into this process."""
    d = Dims.of(config)
    per_token = 2 * d.L * d.Hkv * d.D  # K and V elements of one token, all layers
    S = prefix + scored  # keys attended to at most
    c = min(prefix, PREFILL_CHUNK)  # tokens fed at once
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    masks = len(set(getattr(text, "layer_types", None) or ["full_attention"]))
    working = (4 * c * (4 * d.h + 4 * d.mlp + 4 * d.D * (d.Hq + d.Hkv)) + 2 * 4 * d.Hq * S * d.D + masks * c * S
               + 4 * d.Hq * SCORE_CHUNK * S + 3 * LOGIT_BYTES)
    if getattr(config, "_attn_implementation", None) == "eager":
        working += 2 * 4 * d.Hq * c * S
    weights = float(parameters(config) * WEIGHT_BYTES)
    runtime = max(resident_bytes() - (weights if loaded else 0.0), RUNTIME_BYTES)
    return Footprint(runtime, weights, float(4 * per_token * S), float(cache_bytes * per_token * prefix * held_windows),
                     float(working))


def available_bytes() -> float | None:
    """The machine's ``MemAvailable`` (``/proc/meminfo``), or None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024.0  # kB
    except OSError:
        pass
    return None


def limit(limit_gb: float | None) -> tuple[float | None, str]:
    """``(bytes, what they are)``: ``memory.limit_gb`` where set, else this process's resident memory plus the
    machine's available memory; ``(None, ...)`` where neither is known."""
    if limit_gb is not None:
        return float(limit_gb) * GB, f"memory.limit_gb={limit_gb:g}"
    free = available_bytes()
    if free is None:
        return None, "no MemAvailable in /proc/meminfo"
    held = resident_bytes()
    return held + free, f"MemAvailable {free / GB:.2f} GB + this process's {held / GB:.2f} GB; set memory.limit_gb to change it"


def check_fits(fp: Footprint, limit_gb: float | None, what: str) -> None:
    """Raise :class:`WindowTooLarge` if the estimated peak ``fp`` of ``what`` (the window, named as configured)
    exceeds the limit."""
    cap, source = limit(limit_gb)
    if cap is None or fp.total <= cap:
        return
    raise WindowTooLarge(f"{what} needs an estimated {fp.total / GB:.2f} GB at its peak ({fp.describe()} GB; "
                         f"kvbench/inputs/footprint.py) but the limit is {cap / GB:.2f} GB ({source}); nothing was "
                         "captured or measured: shorten the window, or measure fewer windows at once")
