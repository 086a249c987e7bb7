"""What a compressor says of itself for tables and caches: its family, label, the tokens it keeps exact or always
keeps, and the recent window a resident cache takes over; and the README's example compressor keeping a window."""

import torch

from compressors.eviction.adakv import AdaKV
from compressors.eviction.h2o import H2O
from compressors.eviction.random_eviction import RandomEviction
from compressors.eviction.snapkv import SnapKV
from compressors.eviction.streaming_llm import StreamingLLM
from compressors.quantizers.fp8 import FP8
from compressors.quantizers.kivi import KIVI
from compressors.quantizers.turboquant import TurboQuant
from compressors.transform.aquakv import AquaKV
from compressors.transform.kvtc import Kvtc
from kvbench.coding.bitstream import Bitstream
from kvbench.core.compressor import Kept, rebuild
from kvbench.core.kv import Context


def test_kept_text():
    assert Kept().text() == "none"
    assert Kept(4, 128).text() == "4 sinks + 128 recent"
    assert Kept(0, 64, "last").text() == "64 last"


def test_coders_state_the_tokens_they_store_exactly():
    assert KIVI(residual=128).facts(1024) == {"family": "quantizer", "label": "kivi", "exact_tokens": "128 recent",
                                              "always_kept": None, "quality_reference": False}
    assert Kvtc(sinks=4, window=128).facts(1024)["exact_tokens"] == "4 sinks + 128 recent"
    assert Kvtc(window=0).label() == "kvtc (no window)" and Kvtc().label() == "kvtc"
    assert AquaKV(sinks=4).exact_tokens(1024) == Kept(sinks=4)
    assert TurboQuant(entropy_coding=True).label() == "turboquant (range-coded)"
    assert TurboQuant().facts(1024)["exact_tokens"] == "none"


def test_eviction_methods_state_what_they_always_keep_and_how_they_store_the_rest():
    assert SnapKV(keep=0.5, window=64).facts(1024)["always_kept"] == "64 last"
    assert H2O(keep=0.5, recent=0.5).always_kept(1024) == Kept(0, 256)  # half of the 512 kept tokens
    assert StreamingLLM(keep=0.25, sinks=4).always_kept(1024).text() == "4 sinks + 252 recent"
    snap = SnapKV(keep=0.5, inner="turboquant")
    assert snap.label() == "snapkv + turboquant 3-bit" and snap.facts(1024)["kept_coding"] == "turboquant 3-bit"
    assert SnapKV().facts(1024)["kept_coding"] == "16-bit" and SnapKV().family == "eviction"
    # a budget rule's label names its scorer and, when one codes the kept KV, the inner coder: a curve of its own
    assert AdaKV(scorer="knorm", keep=0.5).label() == "adakv (knorm)"
    assert AdaKV(scorer="knorm", keep=0.5, inner="kivi").label() == "adakv (knorm) + kivi 2-bit"
    assert RandomEviction().facts(1024)["random_baseline"] and not SnapKV().facts(1024)["random_baseline"]


def test_only_a_compressor_with_a_streaming_window_hands_it_to_the_cache():
    kivi = KIVI(residual=128)
    assert kivi.recent_window() == 128 and kivi.without_recent_window().residual == 0
    assert KIVI(residual=0).without_recent_window().residual == 0
    fp8 = FP8(window=16)  # its window is part of each stored segment, not the cache's
    assert fp8.recent_window() == 0 and fp8.without_recent_window() is fp8
    assert fp8.facts(64)["quality_reference"] is True  # the recall axis's yardstick, read by the report


def test_the_readme_example_keeps_its_window_exact_and_counts_it(random_kv):
    kv = random_kv(T=64, D=64)
    ctx = Context.for_kv(kv)
    comp = FP8(window=16)
    bs = comp.encode(kv, ctx)
    assert sum(bs.parts.values()) == bs.num_bits
    assert bs.parts["k"] == bs.parts["v"] == 8 * kv.k[:, :, :48].numel()
    assert bs.parts["k.exact"] == bs.parts["v.exact"] == 16 * kv.k[:, :, 48:].numel()
    out = rebuild(comp).decode(Bitstream.from_bytes(bs.data), ctx)  # a fresh decoder, from the bytes alone
    assert torch.equal(out.k[:, :, 48:], kv.k[:, :, 48:]) and torch.equal(out.v[:, :, 48:], kv.v[:, :, 48:])
    rounded = kv.k[:, :, :48].to(torch.float8_e4m3fn).to(kv.k.dtype)
    assert torch.equal(out.k[:, :, :48], rounded)
    assert comp.facts(64)["exact_tokens"] == "16 recent" and FP8(window=128).exact_tokens(64) == Kept(recent=64)
    # no window: the stream is what it always was, 8 bits per element and no exact sections
    plain = FP8().encode(kv, ctx)
    assert "k.exact" not in plain.parts and plain.parts["k"] == 8 * kv.k.numel()
