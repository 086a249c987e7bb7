"""A valid stored stream of every configured compressor, and the parties that read it.

Shared by the contract suite (tests/test_compressors_base.py, and tests/test_architectures.py on every architecture
conftest builds), the fuzz tests (tests/test_fuzz_streams.py) and scripts/reliability.py. Compressors that need a
model run on conftest's tiny random Llama (``needs_model``: its KV, token ids and weights in the context); the others
on random 16-bit KV with channel outliers, fitted on another draw. The decoder is always another instance: rebuilt
from the config, it knows the fitted state only as bytes. :func:`check_roundtrip` and :func:`check_distortion` are
the contract a decoded case must meet.

``KVBENCH_TEST_DEVICE`` (default ``cpu``; ``cuda`` or ``cuda:N`` where torch sees that GPU) is where the tiny model
runs: its captures and the model-backed coders' forward passes (scripts/device_check.sh runs the contract suite so
on a GPU). The KV itself stays in host memory, as a captured trace holds it.
"""

from __future__ import annotations

import copy
import functools
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from compressors.eviction.evict import Eviction, n_kept
from kvbench.coding.bitstream import Bitstream
from kvbench.core.codec import decoder_for, state_bytes
from kvbench.core.compressor import Compressor, SetCompressor
from kvbench.core.config import available, compose, make_compressor
from kvbench.core.kv import Context, KVSequence
from kvbench.measure.metrics.distortion import DistortionAccumulator

ALL = available("compressor")
#: other coders and compositions behind the same configs, whose streams have parsers of their own
VARIANTS = {
    "turboquant/entropy_coding": ("turboquant", ("compressor.entropy_coding=true",)),
    "turboquant/prod": ("turboquant", ("compressor.variant=prod",)),
    "delta/bits": ("delta", ("compressor.bits=4",)),
    "delta/laplace": ("delta", ("compressor.exact_coder=laplace", "compressor.predictor=linear")),
    "lossless/zlib": ("lossless", ("compressor.coder=zlib",)),
    "lossless/lzma": ("lossless", ("compressor.coder=lzma",)),
    "knorm/turboquant": ("knorm", ("compressor.inner=turboquant",)),
    # rows of unequal counts, each coded alone by the inner coder (an inner stream per layer and KV head)
    "adakv/kivi": ("adakv", ("compressor.scorer=knorm", "+compressor.inner={name:kivi,residual:16}")),
    "pipeline/kivi": ("pipeline", ("compressor.inner={name:kivi,residual:16}",)),
    "fp8/window": ("fp8", ("compressor.window=32",)),  # the README's example, keeping an exact window
}


@functools.cache
def _spec(name: str, overrides: tuple[str, ...]) -> dict:
    """``configs/compressor/NAME.yaml`` with ``overrides`` as a plain dict: composed once per process (a compose
    takes longer than building most cases)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(compose([f"+compressor={name}", *overrides]).compressor, resolve=True)


def instantiate(name: str, overrides: tuple[str, ...] = ()) -> Compressor:
    """A fresh instance of ``configs/compressor/NAME.yaml`` with ``overrides``."""
    return make_compressor(copy.deepcopy(_spec(name, tuple(overrides))))


def needs_model(name: str) -> bool:
    """Whether the class ``configs/compressor/NAME.yaml`` targets declares ``needs_model`` (read without building
    it: a wrapper whose inner stage needs the model says so on the instance, and none of the configs has one)."""
    from kvbench.core.config import compressor_class

    return bool(compressor_class(name).needs_model)


def random_kv(L=2, H=2, T=160, D=64, dtype=torch.float16, seed=0) -> KVSequence:
    """conftest's ``random_kv``: keys with a linear ramp of channel offsets (outlier channels), token ids."""
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(L, H, T, D, generator=g) * 2 + torch.linspace(-3, 3, D)).to(dtype)  # (L, H, T, D)
    v = torch.randn(L, H, T, D, generator=g).to(dtype)  # (L, H, T, D)
    return KVSequence(k, v, torch.randint(0, 128, (T,), generator=g))


def config_for(kv: KVSequence) -> Any:
    """A tiny Llama config matching ``kv``'s shapes: the free model config a ``needs_config`` compressor reads."""
    from transformers import LlamaConfig

    L, H, _, D = kv.shape
    return LlamaConfig(vocab_size=128, hidden_size=H * D, intermediate_size=128, num_hidden_layers=L,
                       num_attention_heads=H, num_key_value_heads=H, head_dim=D, max_position_embeddings=512)


def device_under_test() -> str:
    """``KVBENCH_TEST_DEVICE``, checked as the run config's ``device`` is: a GPU torch does not see is an error, never
    a run on the CPU filed as the GPU's."""
    from kvbench.sweep.config_check import check_device

    device = os.environ.get("KVBENCH_TEST_DEVICE", "").strip() or "cpu"
    try:
        check_device(device)
    except ValueError as e:
        raise ValueError(f"KVBENCH_TEST_DEVICE: {e}") from None
    return device


@functools.cache
def tiny_model(arch: str = "llama") -> Any:
    """conftest's tiny random model of architecture ``arch``, built once per process, on the device under test."""
    from conftest import tiny_arch

    return tiny_arch(arch).to(device_under_test())


def model_kv(T: int, seed: int = 0, arch: str = "llama") -> KVSequence:
    """The tiny model's 16-bit cache of ``T`` random token ids, with the ids."""
    from kvbench.inputs.capture import capture_window

    ids = torch.randint(0, 128, (T,), generator=torch.Generator().manual_seed(seed))
    got = capture_window(tiny_model(arch), ids, T, torch.float16)
    return KVSequence(got["k"], got["v"], ids)


def shared_prefix_sessions(base: KVSequence, n: int = 3, prefix: int = 64) -> list[KVSequence]:
    """``n`` sessions whose first ``prefix`` tokens (ids and KV) are ``base``'s, each with its own tail: what a
    dedup stage shares (session j's tail is ``base`` shifted by j tokens)."""
    out = [base]
    for j in range(1, n):
        tail = base.slice_tokens(prefix - j * 8, base.n_tokens - j * 8)
        out.append(KVSequence(torch.cat([base.k[:, :, :prefix], tail.k], dim=2),
                              torch.cat([base.v[:, :, :prefix], tail.v], dim=2),
                              torch.cat([base.tokens[:prefix], (tail.tokens + 1) % 128])))
    return out


@dataclass
class Case:
    """One compressor's valid stream: the fitted encoder, a decoder rebuilt from its state bytes, the sequences
    and their contexts, and what the decoder makes of the stream."""

    name: str
    encoder: Compressor
    decoder: Compressor
    kvs: list[KVSequence]
    ctxs: list[Context]
    stream: Bitstream
    decoded: list[KVSequence] = field(default_factory=list)

    @property
    def is_set(self) -> bool:
        return isinstance(self.encoder, SetCompressor)

    def encode(self, comp: Compressor | None = None) -> Bitstream:
        comp = comp or self.encoder
        return comp.encode_set(self.kvs, self.ctxs) if self.is_set else comp.encode(self.kvs[0], self.ctxs[0])

    def decode(self, data: bytes, comp: Compressor | None = None) -> list[KVSequence]:
        """Decode stored bytes on the decoder (or ``comp``): one sequence per context."""
        comp = comp or self.decoder
        bs = Bitstream(bytes(data), 8 * len(data), {}, "")  # as read from disk: nothing but the bytes
        return comp.decode_set(bs, self.ctxs) if self.is_set else [comp.decode(bs, self.ctxs[0])]


def _sequences(comp: Compressor) -> tuple[list[KVSequence], list[Context], Any]:
    if comp.needs_model:
        kv = model_kv(96)
        handle = SimpleNamespace(model=tiny_model(), tokenizer=None)
        config = tiny_model().config
        return [kv], [Context.for_kv(kv, handle, config=config)], config
    kv = random_kv(T=160, D=64)
    config = config_for(kv) if comp.needs_config else None
    kvs = shared_prefix_sessions(kv) if isinstance(comp, SetCompressor) else [kv]
    return kvs, [Context.for_kv(s, config=config) for s in kvs], config


def _fit(comp: Compressor, config: Any) -> None:
    calib = random_kv(T=160, D=64, seed=9)
    if comp.needs_config and config is not None:
        from kvbench.core.rope import Rotary

        calib.k_pre_rope = Rotary(config).undo(calib.k).to(calib.k.dtype)  # as capture.pre_rope=true gives them
    comp.fit([calib], config=config)


@functools.cache
def build(name: str) -> Case:
    """The case of ``configs/compressor/NAME.yaml``, or of a :data:`VARIANTS` key, built once per process."""
    config, overrides = VARIANTS.get(name, (name, ()))
    comp = instantiate(config, overrides)
    kvs, ctxs, config = _sequences(comp)
    if comp.needs_model:  # fitted on another window of the same model's cache
        comp.fit([model_kv(160, seed=9)], config=config)
    else:
        _fit(comp, config)
    case = Case(name, comp, decoder_for(comp, state_bytes(comp)), kvs, ctxs, Bitstream(b"", 0))
    case.stream = case.encode()
    case.decoded = case.decode(case.stream.data)
    return case


def check_roundtrip(case: Case, outs: list[KVSequence]) -> None:
    """The shape contract: every decoded sequence has the cache's shape and dtype, a lossless one its exact K and V,
    decoded token ids are the cache's, dropped entries are zeros and an eviction method's kept ones exact."""
    comp = case.encoder
    assert len(outs) == len(case.kvs)
    for out, kv, ctx in zip(outs, case.kvs, case.ctxs):
        assert out.shape == kv.shape == ctx.shape and out.k.dtype == out.v.dtype == kv.k.dtype
        if comp.lossless:
            assert torch.equal(out.k, kv.k) and torch.equal(out.v, kv.v)
        if out.tokens is not None:  # a decoder that returns token ids decoded them from its own stream
            assert torch.equal(out.tokens, kv.tokens)
        if out.kept is not None:  # dropped entries are zero; an eviction method keeps the rest at 16 bits
            kept = out.kept.unsqueeze(-1).expand_as(out.k)  # (L, H, T, D)
            assert kept.any() and (out.k[~kept] == 0).all() and (out.v[~kept] == 0).all()
            if isinstance(comp, Eviction) and comp.inner is None:  # a coder that drops tiers (waterfill) is lossy
                assert torch.equal(out.k[kept], kv.k[kept]) and torch.equal(out.v[kept], kv.v[kept])


def check_distortion(case: Case) -> None:
    """The decoded cache against what the class declares of its default configuration: a relative MSE of K and of
    V (measured as the harness does, on the entries the decoder keeps) under ``max_rel_mse``; an eviction method
    keeps its kept entries exact and drops exactly ``T - floor(keep * T)`` of every (layer, KV head), or, under a
    budget rule that shares them out otherwise (PyramidKV, AdaKV, KVzip), the same total in the shares its
    :meth:`budgets` declare; a compressor that keeps every token drops none."""
    comp = case.encoder
    bound = type(comp).max_rel_mse
    assert bound is not None, f"{type(comp).__name__} declares no max_rel_mse"
    dist = DistortionAccumulator()
    for kv, out in zip(case.kvs, case.decoded):
        dist.add("k", kv.k, out.k, out.kept)
        dist.add("v", kv.v, out.v, out.kept)
        if isinstance(comp, Eviction):
            assert out.kept is not None, f"{case.name} evicted nothing"
            kept = out.kept.unsqueeze(-1).expand_as(out.k)  # (L, H, T, D)
            if comp.inner is None:
                assert torch.equal(out.k[kept], kv.k[kept]) and torch.equal(out.v[kept], kv.v[kept]), \
                    f"{case.name}: a kept entry is not the cache's"
            per_head = out.kept.sum(-1)  # (L, H)
            L, H, T = out.kept.shape
            want = n_kept(comp.name, comp.keep, T) if comp.keep_tokens is None else min(comp.keep_tokens, T)
            budget = f"keep={comp.keep}" if comp.keep_tokens is None else f"keep_tokens={comp.keep_tokens}"
            if comp.equal_counts:
                assert (per_head == want).all(), \
                    f"{case.name} kept {per_head.tolist()} per head; {budget} declares {want} of {T}"
            # a budget rule shares the same total out as it declares: per head, per layer or over the whole cache
            pool = {"head": lambda x: x, "layer": lambda x: x.sum(1), "cache": lambda x: x.sum()}[comp.budget_pool]
            declared = comp.budgets(L, H, T)  # (L, H)
            assert torch.equal(pool(per_head), pool(declared)), \
                f"{case.name} kept {per_head.tolist()} per head; its budgets are {declared.tolist()}"
            assert int(per_head.sum()) == L * H * want, \
                f"{case.name} kept {int(per_head.sum())} entries; {budget} declares {want} per head of {T}"
        elif comp.always_kept(kv.n_tokens) is None:
            assert out.kept is None or bool(out.kept.all()), f"{case.name} dropped tokens but declares it keeps all"
    for kind in ("k", "v"):
        got = dist.rel_mse(kind)
        assert got <= bound, (f"{case.name}: relative MSE of {kind.upper()} is {got:.4g} on the tiny model's cache, "
                              f"over the {bound} {type(comp).__name__}.max_rel_mse declares")


#: tokens of the tiny model's cache that a configuration's distortion is measured on: longer than every default's
#: exact window (KIVI's and KVTC's 128 recent tokens), so that each one codes part of it
DISTORTION_TOKENS = 256


@functools.cache
def model_case(name: str, n_tokens: int = DISTORTION_TOKENS, arch: str = "llama") -> Case:
    """``configs/compressor/NAME.yaml`` on the cache of conftest's tiny model of architecture ``arch``, as the
    harness runs it: fitted on another window of that cache, the model in the context only for a compressor that
    ``needs_model``, the model's config only for one that ``needs_config``; decoded by an instance rebuilt from the
    state bytes."""
    comp = instantiate(name)
    model = tiny_model(arch)
    kv = model_kv(n_tokens, arch=arch)
    config = model.config if comp.needs_config else None
    handle = SimpleNamespace(model=model, tokenizer=None) if comp.needs_model else None
    kvs = shared_prefix_sessions(kv) if isinstance(comp, SetCompressor) else [kv]
    comp.fit([model_kv(n_tokens, seed=9, arch=arch)], config=config)
    case = Case(name, comp, decoder_for(comp, state_bytes(comp)), kvs,
                [Context.for_kv(s, handle, config=config) for s in kvs], Bitstream(b"", 0))
    case.stream = case.encode()
    case.decoded = case.decode(case.stream.data)
    return case
