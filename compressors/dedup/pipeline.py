"""Composition: a dedup stage wrapped around any inner compressor, so the unique KV is stored compressed.

``python -m kvbench run +compressor=pipeline compressor.inner=kivi workload=shared_system`` stores each session's
KV beyond its shared prefix with KIVI; the bits are the trie's index and labels plus exactly the inner
compressor's bits on those segments (each segment is one inner bitstream, counted to the bit).

``inner`` is a compressor config name (``configs/compressor/NAME.yaml``), a node ``{name: NAME, FIELD: VALUE}``
that overrides that config's fields, a full node with ``_target_``, or a Compressor. ``dedup`` is the dedup stage,
a :class:`~compressors.dedup.trie.Trie` (node or name).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compressors.dedup.trie import Trie
from kvbench.coding.bitstream import Bitstream
from kvbench.core.compressor import Compressor, Section, SetCompressor
from kvbench.core.kv import Context, KVSequence
from kvbench.core.prefix_cache import PrefixCache


def resolve_compressor(spec: Any, where: str) -> Compressor:
    """A Compressor from a config name, a ``{name: ..., field: ...}`` node, a ``_target_`` node or an object."""
    from omegaconf import OmegaConf

    from kvbench.core.config import CONFIG_DIR, available, make_compressor

    if isinstance(spec, Compressor):
        return spec
    if OmegaConf.is_config(spec):
        spec = OmegaConf.to_container(spec, resolve=True)
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict):
        raise ValueError(f"{where}={spec!r} is not a compressor; give a name from {available('compressor')} or a node")
    if "_target_" not in spec:
        name = spec.get("name")
        if name not in available("compressor"):
            raise ValueError(f"{where}={name!r} is not a compressor config; available: {available('compressor')}")
        base = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "compressor" / f"{name}.yaml"), resolve=True)
        spec = {**base, **{k: v for k, v in spec.items() if k != "name"}}
    return make_compressor(spec)


@dataclass
class Pipeline(SetCompressor):
    """``dedup`` (exact prefix trie) around ``inner``: shared prefixes once, every stored segment coded by
    ``inner``. Lossless exactly when ``inner`` is."""

    inner: Any = "identity"
    dedup: Any = "trie"

    name = "pipeline"
    family = "dedup"
    max_rel_mse = 0.0  # inner identity

    def __post_init__(self) -> None:
        self.inner = resolve_compressor(self.inner, "pipeline.inner")
        self.dedup = resolve_compressor(self.dedup, "pipeline.dedup")
        if not isinstance(self.dedup, Trie):
            raise ValueError(f"pipeline.dedup must be a trie (compressors.dedup.trie.Trie); got {self.dedup.name!r}")
        if isinstance(self.inner, SetCompressor):
            raise ValueError(f"pipeline.inner={self.inner.name!r} is itself a set compressor; give a per-sequence one")
        # instance attributes: what the harness expects depends on the inner stage
        self.lossless = bool(self.inner.lossless and self.dedup.lossless)
        self.needs_model = bool(self.inner.needs_model)
        self.needs_config = bool(self.inner.needs_config)

    def fit(self, calib: Sequence[KVSequence], config: Any = None) -> None:
        self.inner.fit(calib, config=config)

    def state(self) -> dict[str, Section]:
        return {f"inner/{k}": v for k, v in self.inner.state().items()}

    def load_state(self, sections: Mapping[str, bytes]) -> None:
        stray = sorted(k for k in sections if not k.startswith("inner/"))
        if stray:
            raise ValueError(f"pipeline state sections must belong to the inner compressor; got {stray}")
        self.inner.load_state({k.removeprefix("inner/"): v for k, v in sections.items()})

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def prefix_cache(self) -> PrefixCache:
        return self.dedup.prefix_cache()

    def encode_set(self, kvs: Sequence[KVSequence], ctxs: Sequence[Context]) -> Bitstream:
        return self.dedup.encode_set(kvs, ctxs, inner=self.inner, name=self.name)

    def decode_set(self, bs: Bitstream, ctxs: Sequence[Context]) -> list[KVSequence]:
        return self.dedup.decode_set(bs, ctxs, inner=self.inner, name=self.name)
