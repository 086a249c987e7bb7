"""A transformers ``Cache`` that holds the KV as compressed bitstreams plus a full-precision window.

The layout follows the streaming cache of KIVI (Liu et al., arXiv 2402.02750) and transformers' ``QuantizedCache``:
the most recent ``residual`` tokens stay in the 16-bit cache dtype, older tokens live only as bitstreams written
by any kvbench :class:`~kvbench.core.compressor.Compressor`. What is held between forward passes is bytes:

* after a prefill (any forward of more than one token) everything but the last ``residual`` tokens is coded as
  one segment;
* during decoding the window grows one token per step, and once it holds ``residual + chunk`` tokens its oldest
  ``chunk`` tokens are coded as a new segment;
* compressors that can only code a whole sequence (``mode="once"``, the default for ``needs_model`` compressors
  such as token recompute) code the prefill once and keep every later token in the window.

A segment covers all layers, because the compressor contract is a whole ``(L, H, T, D)`` sequence (predictors
and fitted codebooks may span layers). It is parsed once, when it is stored, by the decoder alone (a fresh instance
holding only the config and the codec's state bytes) into a :mod:`~kvbench.core.resident` segment: compressors that can
decode one layer alone (identity, KIVI) hold tensors and decode a layer when its attention reads it; the others
keep the bytes and decode the whole segment at the first read of a forward pass, dropping it when the pass ends.
Between steps :meth:`CompressedCache.nbytes` is what the cache holds.

A decoder that drops entries (token eviction) returns a kept mask; the cache hides the dropped entries from
attention per KV head at their original positions (:func:`kvbench.cache.eviction_mask.install`).

Batch size 1 only: a :class:`~kvbench.core.kv.KVSequence` is one sequence.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from transformers.cache_utils import Cache

from kvbench.cache.eviction_mask import install as install_mask
from kvbench.cache.window_layer import CompressedLayer
from kvbench.coding.bitstream import Bitstream
from kvbench.core.checks import check_choice, check_range
from kvbench.core.codec import decoder_for, state_bytes
from kvbench.core.compressor import Compressor
from kvbench.core.kv import SIXTEEN_BIT, Context, KVSequence
from kvbench.core.resident import Resident, Whole, restored
from kvbench.core.timing import Stopwatch

MODES = ("auto", "chunked", "once")
#: what the cache holds of a stored segment: what its decoder parses from the bytes (a resident cache's cost), or
#: the decoded KV (the same values, decoded once: for measuring accuracy, where only the values matter)
HOLDS = ("bytes", "decoded")


@dataclass(frozen=True)
class Segment:
    """One compressed run of tokens ``[start, start + length)`` over every layer: the size of its bitstream and
    what the cache holds of it (parsed once from those bytes)."""

    start: int
    length: int
    stored_bytes: int
    resident: Resident


class CompressedCache(Cache):
    """KV cache whose older tokens are stored as a compressor's bitstreams (see the module docstring).

    Args:
        compressor: any kvbench compressor, already ``fit``; ``None`` keeps every token in the 16-bit window (the
            uncompressed baseline with exactly the same arithmetic).
        residual: tokens kept in full precision. ``None`` takes the compressor's own recent window
            (:meth:`~kvbench.core.compressor.Compressor.recent_window`: KIVI's ``residual``), else 0. The cache's
            working copy is the compressor without that window: the cache's window replaces it, so it is not kept
            twice.
        chunk: tokens coded together once the window holds ``residual + chunk`` of them (a multiple of KIVI's
            ``group_size`` keeps every key in a quantization group).
        mode: ``chunked``, ``once`` (code the prefill once, keep later tokens in the window) or ``auto``
            (``once`` for compressors that need the model, since they code a sequence from its first token).
        model: the model (or a :class:`~kvbench.inputs.models.ModelHandle`); gives the layer count, is handed to
            ``needs_model`` decoders as ``ctx.model``, and lets the cache record the token ids it is fed.
        config: the model config, when no model is given.
        dtype: storage dtype; default the model's dtype when it is 16-bit, else float16.
        hold: ``bytes`` (what the decoder parses from the stored bytes, decoded when attention reads it: what a
            resident cache costs) or ``decoded`` (each segment decoded once when stored, from its bytes alone, and
            its KV held: the same values for accuracy measurements without a decode per generated token).
    """

    def __init__(self, compressor: Compressor | None, *, residual: int | None = None, chunk: int = 128, mode: str = "auto",
                 model: Any = None, config: Any = None, dtype: torch.dtype | None = None, hold: str = "bytes") -> None:
        check_choice("cache", "mode", mode, MODES)
        check_choice("cache", "hold", hold, HOLDS)
        self.hold = hold
        check_range("cache", "chunk", chunk, 1, 1 << 30, integer=True)
        if dtype is not None and dtype not in SIXTEEN_BIT:
            raise ValueError(f"cache dtype={dtype} is not allowed; the cache stores 16-bit KV: {list(SIXTEEN_BIT)}")
        if residual is None:
            residual = compressor.recent_window() if compressor is not None else 0
        check_range("cache", "residual", residual, 0, 1 << 30, integer=True)
        if compressor is not None:
            compressor = compressor.without_recent_window()
        module, self.model_ref = _model_parts(model)
        if compressor is not None and compressor.needs_model and self.model_ref is None:
            raise ValueError(f"compressor {compressor.name!r} decodes with the model: pass model= to CompressedCache")
        config = config if config is not None else getattr(module, "config", None)
        self.model_config = config
        if config is None:
            raise ValueError("CompressedCache needs model= or config= to know the number of layers")
        text = config.get_text_config(decoder=True)
        types = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
        odd = sorted(set(types) - {"full_attention", "sliding_attention"})
        if odd:
            raise ValueError(f"CompressedCache handles attention layers only; this model has layer types {odd}")
        super().__init__(layers=[CompressedLayer() for _ in types])
        for i, layer in enumerate(self.layers):
            layer.bind(self, i)
        self.compressor, self.residual, self.chunk = compressor, int(residual), int(chunk)
        # segments are decoded by a fresh instance that holds only the config and the encoder's state bytes
        self.decoder = decoder_for(compressor, state_bytes(compressor)) if compressor is not None else None
        self.mode = ("once" if compressor is not None and compressor.needs_model else "chunked") if mode == "auto" else mode
        self.dtype = dtype
        self.segments: list[Segment] = []
        self.tokens: list[int] = []
        self._read = False  # a layer read the segments in this forward pass
        self._once_done = False
        self._step_tokens = 0
        self._encode = self._decode = None
        self.n_encodes = self.n_decodes = 0
        if module is not None:
            self._hook_tokens(module)
            install_mask(module)

    # ------------------------------------------------------------------ transformers Cache API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError(f"CompressedCache holds one sequence (batch size 1); got batch size {key_states.shape[0]}")
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            if self.dtype is None:
                self.dtype = key_states.dtype if key_states.dtype in SIXTEEN_BIT else torch.float16
            if self._encode is None:
                dev = str(key_states.device)
                self._encode, self._decode = Stopwatch(dev), Stopwatch(dev)
            layer.lazy_initialization(key_states, value_states, self.dtype)
        prefix = self._layer_parts(layer_idx) if self.segments else None
        out = layer.update(key_states, value_states, prefix=prefix)
        if layer_idx == len(self.layers) - 1:
            self._end_step(key_states.shape[-2])
        return out

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def reset(self) -> None:
        super().reset()
        self._release()
        self.segments, self.tokens, self._read, self._once_done = [], [], False, False

    # ------------------------------------------------------------------ what kvbench adds
    def nbytes(self) -> int:
        """Bytes held between forward passes: what every segment holds (its bytes, or the tensors parsed from them)
        plus the 16-bit window."""
        held = sum(s.resident.nbytes for s in self.segments)
        for layer in self.layers:
            if layer.window_k is not None:
                held += layer.window_k.nbytes + layer.window_v.nbytes
        return held

    @property
    def compressed_tokens(self) -> int:
        return sum(s.length for s in self.segments)

    @property
    def window_tokens(self) -> int:
        return self.layers[0].window_len()

    def stats(self) -> dict[str, Any]:
        """Time spent coding and decoding, and what is held now."""
        return {
            "encode_s": self._encode.seconds if self._encode else 0.0,
            "decode_s": self._decode.seconds if self._decode else 0.0,
            "n_encodes": self.n_encodes,
            "n_decodes": self.n_decodes,
            "segments": len(self.segments),
            "compressed_tokens": self.compressed_tokens,
            "window_tokens": self.window_tokens,
            "segment_bytes": sum(s.stored_bytes for s in self.segments),
            "nbytes": self.nbytes(),
        }

    def record_tokens(self, ids: torch.Tensor) -> None:
        """Note the token ids fed to the model (encoders may read them; decoders get them only from bytes)."""
        ids = torch.as_tensor(ids)
        if ids.dim() == 2 and ids.shape[0] != 1:
            raise ValueError(f"CompressedCache holds one sequence (batch size 1); got token ids of shape {tuple(ids.shape)}")
        self.tokens.extend(int(t) for t in ids.reshape(-1).tolist())

    def load(self, source: Cache, tokens: torch.Tensor | None = None) -> CompressedCache:
        """Fill an empty cache from another cache's layers (a shared prefill), as the model's update calls would."""
        if self.get_seq_length() or self.segments:
            raise ValueError("CompressedCache.load needs an empty cache")
        if tokens is not None:
            self.record_tokens(tokens)
        for i, layer in enumerate(source.layers):
            self.update(layer.keys, layer.values, i)
        return self

    def clone(self) -> CompressedCache:
        """An independent copy (segments are immutable bytes and are shared; windows are copied)."""
        new = object.__new__(CompressedCache)
        new.__dict__.update(self.__dict__)
        new.layers = []
        for i, layer in enumerate(self.layers):
            twin = CompressedLayer()
            twin.__dict__.update({k: v for k, v in layer.__dict__.items() if k != "_owner"})
            twin.bind(new, i)
            new.layers.append(twin)
        new.segments, new.tokens, new._read = list(self.segments), list(self.tokens), False
        new._encode, new._decode = _copy_watch(self._encode), _copy_watch(self._decode)
        module = self.model_ref.model if self.model_ref is not None and getattr(self, "_hooked", False) else None
        if module is not None:
            new._hook_tokens(module)
        return new

    def flush(self) -> None:
        """Code everything but the last ``residual`` tokens now (unless this cache codes only once and did)."""
        if self.compressor is None or (self.mode == "once" and self._once_done):
            return
        n = self.window_tokens - self.residual
        if n > 0:
            self._compress(n)
        self._once_done = True

    # ------------------------------------------------------------------ internals
    def _end_step(self, n_new: int) -> None:
        if self._read:
            self.n_decodes += 1
        self._release()  # decoded tensors live for one forward pass only
        if self.compressor is None:
            return
        surplus = self.window_tokens - self.residual
        if self.mode == "once":
            if not self._once_done:
                self.flush()
        elif n_new > 1:
            self.flush()
        elif surplus >= self.chunk:
            self._compress(surplus // self.chunk * self.chunk)

    def _compress(self, n: int) -> None:
        start = self.compressed_tokens
        k = torch.cat([layer.window_k[:, :, :n] for layer in self.layers])  # (L, H, n, D)
        v = torch.cat([layer.window_v[:, :, :n] for layer in self.layers])  # (L, H, n, D)
        toks = self.tokens[start : start + n]
        kv = KVSequence(k.cpu(), v.cpu(), torch.tensor(toks, dtype=torch.long) if len(toks) == n else None)
        with self._encode():
            bs = self.compressor.encode(kv, self._context(start, n))
        self.n_encodes += 1
        self.segments.append(self._store(start, n, bytes(bs.data)))
        for layer in self.layers:
            layer.window_k = layer.window_k[:, :, n:].contiguous()
            layer.window_v = layer.window_v[:, :, n:].contiguous()
            layer.prefix_len = start + n

    def _context(self, start: int, n: int) -> Context:
        L = len(self.layers)
        _, H, _, D = self.layers[0].window_k.shape
        return Context(L, H, n, D, self.dtype, self.model_ref, config=self.model_config, start=start)

    def _store(self, start: int, n: int, data: bytes) -> Segment:
        """Parse a segment's bytes once, on the decoder alone (checksum and frame checked here)."""
        ctx = self._context(start, n)
        with self._decode():
            if self.hold == "decoded":
                resident = restored(self._decode_whole(data, ctx))
            else:
                resident = self.decoder.resident(Bitstream.from_bytes(data), ctx)
        if resident is None:
            resident = Whole(data, lambda raw: self._decode_whole(raw, ctx))
        return Segment(start, n, len(data), resident)

    def _decode_whole(self, data: bytes, ctx: Context) -> KVSequence:
        kv = self.decoder.decode(Bitstream.from_bytes(data), ctx)
        if kv.shape != ctx.shape:
            raise RuntimeError(f"{self.compressor.name} decoded {tuple(kv.shape)}; expected {ctx.shape}")
        return kv

    def _layer_parts(self, layer_idx: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every segment's keys and values of one layer, ``(1, H, Ts, D)`` each as decoded, in token order."""
        ks, vs = [], []
        dev = self.layers[layer_idx].device
        with self._decode():
            for seg in self.segments:
                k, v, _ = seg.resident.layer(layer_idx)  # (H, Ts, D) each
                if k.shape[-2] != seg.length or v.shape[-2] != seg.length:
                    raise RuntimeError(f"{self.compressor.name} decoded {k.shape[-2]} tokens of layer {layer_idx}; "
                                       f"the segment holds {seg.length}")
                ks.append(k.unsqueeze(0).to(device=dev))
                vs.append(v.unsqueeze(0).to(device=dev))
        self._read = True
        return ks, vs

    def kept_mask(self, layer_idx: int) -> torch.Tensor | None:
        """Which held entries of one layer attention may see, ``(H_kv, tokens held)`` bool; None: all of them.

        Read by the attention pre-hook of :func:`kvbench.cache.eviction_mask.install` before the layer's update."""
        masks = [seg.resident.kept(layer_idx) for seg in self.segments]
        if all(m is None for m in masks):
            return None
        layer = self.layers[layer_idx]
        H = layer.window_k.shape[1]
        parts = [torch.ones(H, seg.length, dtype=torch.bool) if m is None else m.cpu() for seg, m in zip(self.segments, masks)]
        parts.append(torch.ones(H, layer.window_len(), dtype=torch.bool))
        self._read = True
        return torch.cat(parts, dim=1)  # (H, prefix + window)

    def _release(self) -> None:
        for seg in self.segments:
            seg.resident.release()
        self._read = False

    def _hook_tokens(self, module: torch.nn.Module) -> None:
        """Record the ids of every forward pass that writes to this cache (generate() included)."""
        ref = weakref.ref(self)

        def hook(_mod, args, kwargs):
            cache = ref()
            if cache is None or kwargs.get("cache", kwargs.get("past_key_values")) is not cache:
                return
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None:
                cache.record_tokens(ids)

        handle = module.register_forward_pre_hook(hook, with_kwargs=True)
        weakref.finalize(self, handle.remove)
        self._hooked = True


def _model_parts(model: Any) -> tuple[torch.nn.Module | None, Any]:
    """``(module, ctx.model handle)`` from a model, a ModelHandle or None."""
    if model is None:
        return None, None
    if isinstance(model, torch.nn.Module):
        return model, SimpleNamespace(model=model, tokenizer=None)
    return model.model, model


def _copy_watch(w: Stopwatch | None) -> Stopwatch | None:
    if w is None:
        return None
    c = Stopwatch.__new__(Stopwatch)
    c.__dict__.update(w.__dict__)
    return c
