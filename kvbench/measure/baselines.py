"""In-loop baselines from the ecosystem for ``python -m kvbench latency``: caches another library ships, run in the
same process, on the same text and contexts and through the same decode loop as the plain ``DynamicCache`` and the
:class:`~kvbench.cache.compressed.CompressedCache` (``latency.baselines=[NAME, ...]``).

``transformers_quantized`` is transformers' ``QuantizedCache`` with the HQQ backend (Badri & Shaji, "Half-Quadratic
Quantization of Large Machine Learning Models", 2023, https://mobiusml.github.io/hqq_blog/). transformers' docstring
calls it "similar to" KIVI (Liu et al., arXiv 2402.02750); as transformers 5.24 builds it
(``transformers.cache_utils.QuantizedLayer.update``, ``HQQQuantizedLayer``) it differs from KIVI and from our
``CompressedCache`` in ways that move both bytes and time, so every row it writes carries a ``label`` and a ``note``:

* the whole prefill is quantized at once: none of it stays in 16 bit;
* decoded tokens gather in a 16-bit residual; once it would hold ``residual_length`` tokens, the whole history is
  dequantized, joined to it and quantized again (old tokens are re-quantized at every flush);
* every forward pass dequantizes the whole quantized history;
* keys and values are both grouped per token: HQQ axis 1 takes ``q_group_size`` consecutive channels of one token
  and head (KIVI groups keys per channel over tokens); HQQ's optimizer fits each group's scale and zero point, which
  are held in the dtype it is handed KV in (the run's cache dtype: the latency run converts at its boundary).

Bytes held are counted from the backend's own objects: every tensor reachable from each cache layer (packed codes,
HQQ's ``scale`` and ``zero``, the 16-bit residual keys and values), each storage once.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.core.checks import check_choice, check_range

#: the command that installs the backends of every baseline (pyproject.toml's optional extra ``hqq``)
INSTALL = "pip install -e '.[hqq]'"
#: the bit widths HQQ's quantizer takes (hqq.core.quantize.Quantizer.SUPPORTED_BITS, less 1.58)
HQQ_BITS = (1, 2, 3, 4, 8)


def held_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``'s attributes, looking inside tuples, lists and dicts (HQQ keeps ``(codes, meta)``)."""
    found: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)

    walk(list(vars(obj).values()))
    return found


def storage_nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each storage once (a view holds its whole storage)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            seen[(str(t.device), s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def quantized_cache_nbytes(cache: Any) -> int:
    """Bytes a transformers ``QuantizedCache`` holds: every tensor of every layer (codes, scales, zeros, residual)."""
    return storage_nbytes([t for layer in cache.layers for t in held_tensors(layer)])


def _head_dim(config: Any) -> int:
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else int(config.hidden_size) // int(config.num_attention_heads)


@dataclass(frozen=True)
class TransformersQuantized:
    """transformers' ``QuantizedCache(backend="hqq")`` with per-token groups (HQQ axis 1 for keys and values)."""

    nbits: int = 4
    q_group_size: int = 64
    residual_length: int = 128

    name = "transformers_quantized"

    def __post_init__(self) -> None:
        check_choice("latency.quantized_cache", "nbits", self.nbits, HQQ_BITS)
        check_range("latency.quantized_cache", "q_group_size", self.q_group_size, 1, 1 << 16, integer=True)
        check_range("latency.quantized_cache", "residual_length", self.residual_length, 0, 1 << 30, integer=True)

    def make(self, config: Any, store: torch.dtype | None = None) -> Any:
        """A new cache; ``store``: the dtype it is handed KV in (the run's cache dtype), whatever the model computes
        in, so that its 16-bit residual, scales and zeros are held in that dtype like every other cache's KV."""
        from transformers import QuantizedCache

        class Stored(QuantizedCache):
            def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
                dt = key_states.dtype
                k, v = super().update(key_states.to(store), value_states.to(store), layer_idx, *args, **kwargs)
                return k.to(dt), v.to(dt)

        cls = QuantizedCache if store is None else Stored
        return cls(backend="hqq", config=config, nbits=self.nbits, axis_key=1, axis_value=1,
                   q_group_size=self.q_group_size, residual_length=self.residual_length)

    def nbytes(self, cache: Any) -> int:
        return quantized_cache_nbytes(cache)

    def describe(self) -> dict[str, Any]:
        """What goes into each of its rows: the settings, a short label and a note on what it does."""
        return {
            "label": f"transformers QuantizedCache (HQQ {self.nbits}-bit, per-token groups of {self.q_group_size}, "
                     f"residual {self.residual_length})",
            "note": "prefill quantized whole; decoded tokens kept in 16 bit until residual_length of them, then the "
                    "whole history re-quantized; keys and values grouped per token (HQQ axis 1), unlike KIVI's "
                    "per-channel keys; each pass dequantizes the whole history; scale and zero per group in the "
                    "cache dtype (handed its KV in it)",
            "nbits": self.nbits,
            "q_group_size": self.q_group_size,
            "residual_length": self.residual_length,
        }


def _require_hqq() -> None:
    if importlib.util.find_spec("hqq") is None:
        raise ModuleNotFoundError(
            "latency.baselines=[transformers_quantized] needs the hqq package (transformers' QuantizedCache HQQ "
            f"backend), which is not installed; install it with: {INSTALL}")


def transformers_quantized(settings: Any, compressor: Any, residual: int | None, config: Any) -> TransformersQuantized:
    """The HQQ ``QuantizedCache`` matched to the run: ``settings`` (``latency.quantized_cache``) fields left null take
    the compressor's ``bits`` (else 4), the head dimension (one group per token and head) and the compressed cache's
    residual (``cache.residual``; null: the compressor's own recent window, else 0)."""
    _require_hqq()
    nbits = settings.get("nbits")
    if nbits is None:
        bits = getattr(compressor, "bits", None)
        nbits = 4 if bits is None else bits
        if bits is not None and bits not in HQQ_BITS:
            raise ValueError(f"latency.quantized_cache.nbits=null takes {compressor.name}.bits={bits!r}, which HQQ "
                             f"cannot quantize to; set latency.quantized_cache.nbits to one of {list(HQQ_BITS)}")
    head_dim = _head_dim(config)
    group = settings.get("q_group_size")
    group = head_dim if group is None else group
    check_range("latency.quantized_cache", "q_group_size", group, 1, head_dim, integer=True)
    if head_dim % int(group):
        raise ValueError(f"latency.quantized_cache.q_group_size={group} must divide head_dim={head_dim}, so that a "
                         "group holds channels of one token and head")
    length = settings.get("residual_length")
    if length is None:
        length = residual if residual is not None else compressor.recent_window()
    return TransformersQuantized(nbits=int(nbits), q_group_size=int(group), residual_length=int(length))


#: baseline name -> builder(settings of latency.quantized_cache, compressor, cache.residual, model config)
BASELINES = {"transformers_quantized": transformers_quantized}


def make_baselines(names: Any, settings: Any, compressor: Any, residual: int | None, config: Any) -> dict[str, Any]:
    """The baselines ``latency.baselines`` names, in its order; unknown or repeated names are refused."""
    names = [str(n) for n in (names or [])]
    for n in names:
        check_choice("latency", "baselines", n, BASELINES)
    if len(set(names)) != len(names):
        raise ValueError(f"latency.baselines={names} names a baseline twice; allowed: {sorted(BASELINES)}, each once")
    return {n: BASELINES[n](settings or {}, compressor, residual, config) for n in names}
