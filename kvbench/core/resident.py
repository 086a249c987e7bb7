"""A stored segment of a :class:`~kvbench.cache.compressed.CompressedCache`, parsed once and read one layer at a time.

A resident cache pays for two things at every decoding step: the arithmetic that turns what it holds into the
keys and values attention reads, and whatever the harness adds around it. The second must be nothing, so a
segment is parsed from its bytes once, when it is stored, into what the decoder needs, and each layer asks for its
own keys and values only when its attention runs (as transformers' ``QuantizedCache`` dequantises one layer's
tensors in that layer's ``update``).

Two kinds of segment:

* :class:`Layered`: a compressor that can decode one layer alone from tensors it holds (its ``resident`` method
  returns one) — identity holds the 16-bit tensors themselves, KIVI its packed codes, scales and zero points.
  Between steps the cache holds exactly :attr:`Layered.nbytes`.
* :class:`Whole`: every other compressor (predictors and fitted bases may span layers): the stored bytes are kept
  and the whole segment is decoded at the first layer's read in a forward pass, then dropped when the pass ends.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping

import torch

from kvbench.core.kv import KVSequence

#: one layer's ``(k (H, T, D), v (H, T, D), kept (H, T) bool or None)``
LayerKV = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


class Resident(abc.ABC):
    """What the cache holds for one segment between forward passes."""

    @abc.abstractmethod
    def layer(self, i: int) -> LayerKV:
        """Layer ``i``'s keys, values and kept mask (None: every entry kept)."""

    @abc.abstractmethod
    def kept(self, i: int) -> torch.Tensor | None:
        """Layer ``i``'s kept mask ``(H, T)`` (None: every entry kept), read before the layer's attention runs."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes held between forward passes."""

    def release(self) -> None:
        """End of a forward pass: drop anything decoded for it."""


class Layered(Resident):
    """Tensors parsed from the segment's bytes, and a function that decodes one layer from them."""

    def __init__(self, held: Mapping[str, torch.Tensor], decode_layer: Callable[[Mapping[str, torch.Tensor], int], LayerKV]):
        self.held = dict(held)
        self._decode_layer = decode_layer

    def layer(self, i: int) -> LayerKV:
        return self._decode_layer(self.held, i)

    def kept(self, i: int) -> torch.Tensor | None:
        return self.held["kept"][i] if "kept" in self.held else None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.held.values())


class Whole(Resident):
    """The stored bytes, decoded as one sequence when a forward pass first reads the segment."""

    def __init__(self, data: bytes, decode: Callable[[bytes], KVSequence]):
        self.data = data
        self._decode = decode
        self._kv: KVSequence | None = None

    def layer(self, i: int) -> LayerKV:
        if self._kv is None:
            self._kv = self._decode(self.data)
        kv = self._kv
        return kv.k[i], kv.v[i], None if kv.kept is None else kv.kept[i]

    def kept(self, i: int) -> torch.Tensor | None:
        return self.layer(i)[2]

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def release(self) -> None:
        self._kv = None


def restored(kv: KVSequence) -> Layered:
    """A decoded sequence held as it is: its tensors (and kept mask) are the segment, a layer is a view.

    Identity's segments are their 16-bit tensors already. Coders that run the model to decode (token recompute,
    model-predicted residuals) decode a stored segment once, as a system restoring a session would, rather than
    re-running the model at every step; what they hold afterwards is 16-bit KV, and it is counted as such."""
    held = {"k": kv.k, "v": kv.v} if kv.kept is None else {"k": kv.k, "v": kv.v, "kept": kv.kept}
    return Layered(held, lambda h, i: (h["k"][i], h["v"][i], h["kept"][i] if "kept" in h else None))
