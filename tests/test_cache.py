"""CompressedCache with the tiny random Llama: exactness with identity, accounting, chunking, generate()."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from compressors.exact.identity import Identity
from compressors.quantizers.kivi import KIVI
from kvbench.cache.compressed import CompressedCache
from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.coding.packing import tensor_from_bytes, tensor_to_bytes
from kvbench.core.compressor import Compressor
from kvbench.core.config import available, compose, make_compressor
from kvbench.core.kv import Context, KVSequence


@pytest.fixture(scope="module")
def bf16_model():
    from conftest import tiny_llama

    # computing in the cache dtype makes the 16-bit cache exact, so logits can be compared with torch.equal
    return tiny_llama(seed=3).to(torch.bfloat16)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _decode_logits(model, cache, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Prefill ``ids``, then feed ``steps`` fixed tokens one at a time; the logits of every pass."""
    out = [model(ids, cache=cache, use_cache=True).logits]
    for t in range(steps):
        out.append(model(torch.tensor([[(7 * t + 3) % 128]]), cache=cache, use_cache=True).logits)
    return out


def test_identity_logits_equal_dynamic_cache(bf16_model):
    ids = _ids(70)
    cache = CompressedCache(Identity(), residual=8, chunk=16, model=bf16_model)
    ref = _decode_logits(bf16_model, DynamicCache(), ids, 24)
    got = _decode_logits(bf16_model, cache, ids, 24)
    assert cache.n_encodes >= 2 and cache.n_decodes == 24  # the prefix really went through bitstreams
    for step, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), f"logits differ at step {step}"


def test_identity_equals_uncompressed_baseline_in_float32(tiny_model):
    """With a float32 model both caches round to 16 bit the same way, so identity is still exact."""
    ids = _ids(50, seed=1)
    base = _decode_logits(tiny_model, CompressedCache(None, model=tiny_model), ids, 20)
    got = _decode_logits(tiny_model, CompressedCache(Identity(), residual=4, chunk=8, model=tiny_model), ids, 20)
    dyn = _decode_logits(tiny_model, DynamicCache(), ids, 20)
    for a, b, d in zip(base, got, dyn):
        assert torch.equal(a, b)
        assert torch.allclose(a, d, atol=1e-3)  # float16 rounding of the stored KV only


def test_greedy_generate_is_token_identical(bf16_model):
    ids = _ids(40, seed=2)
    ref = bf16_model.generate(ids, max_new_tokens=20, do_sample=False)
    cache = CompressedCache(Identity(), residual=4, chunk=8, model=bf16_model)
    got = bf16_model.generate(ids, max_new_tokens=20, do_sample=False, cache=cache)
    assert torch.equal(ref, got)
    assert cache.compressed_tokens > 40
    # generate() fed the prompt and every new token but the last; the cache recorded them for its encoders
    assert cache.tokens == ref[0, :-1].tolist()


def test_nbytes_is_segments_plus_window(tiny_model):
    L, H, D = 2, 2, 16
    cache = CompressedCache(Identity(), residual=8, chunk=16, model=tiny_model)
    _decode_logits(tiny_model, cache, _ids(70), 20)
    # prefill: 62 coded, 8 kept; 20 steps later the window reached 8 + 16 once and 16 more were coded
    assert [s.length for s in cache.segments] == [62, 16]
    assert cache.window_tokens == 12 and cache.get_seq_length() == 90
    window = 2 * L * H * 12 * D * 2  # K and V, float16
    assert cache.nbytes() == sum(s.resident.nbytes for s in cache.segments) + window
    # an identity segment holds its two 16-bit tensors; its bitstream is those plus the frame the harness charges
    for s in cache.segments:
        assert s.resident.nbytes == 2 * L * H * s.length * D * 2
        bs = Identity().encode(KVSequence(torch.zeros(L, H, s.length, D, dtype=torch.float16),
                                          torch.zeros(L, H, s.length, D, dtype=torch.float16)), None)
        assert s.stored_bytes == len(bs.data) and bs.parts["k"] == 16 * L * H * s.length * D
    assert cache.stats()["nbytes"] == cache.nbytes()
    assert cache.stats()["segment_bytes"] == sum(s.stored_bytes for s in cache.segments)


def test_kivi_changes_logits_a_little(tiny_model):
    ids = _ids(96, seed=4)
    plain = CompressedCache(None, model=tiny_model)
    base = _decode_logits(tiny_model, plain, ids, 8)
    cache = CompressedCache(KIVI(bits=2, group_size=16), residual=0, chunk=16, model=tiny_model)
    got = _decode_logits(tiny_model, cache, ids, 8)
    # 2-bit codes + 16-bit scale and zero per 16 values = 4 bits of 16 for the 96 coded tokens, 8 in the window
    assert cache.nbytes() < 0.4 * plain.nbytes()
    later = torch.cat([b[:, -1] for b in base[1:]]), torch.cat([g[:, -1] for g in got[1:]])
    diff = (later[0] - later[1]).abs().max()
    assert diff > 0, "2-bit KIVI left the logits bit-identical"
    assert diff < 0.5 * later[0].abs().max(), f"2-bit KIVI moved the logits too far ({diff:.3f})"
    assert torch.equal(base[0], got[0])  # the prefill attends to its own fresh KV, not the stored one


def test_kivi_residual_moves_into_the_cache(tiny_model):
    cache = CompressedCache(KIVI(bits=2, residual=128), model=tiny_model)
    assert cache.residual == 128 and cache.compressor.residual == 0
    assert CompressedCache(KIVI(bits=2), residual=16, model=tiny_model).residual == 16


def test_long_prefill_is_bytes_after_the_step(tiny_model):
    cache = CompressedCache(KIVI(bits=2, group_size=16), residual=16, model=tiny_model)
    with torch.no_grad():
        tiny_model(_ids(200), cache=cache, use_cache=True)
    full = 2 * 2 * 2 * 200 * 16 * 2
    assert cache.compressed_tokens == 184 and cache.window_tokens == 16
    assert cache.nbytes() < full / 3
    assert cache.nbytes() == sum(s.resident.nbytes for s in cache.segments) + 2 * 2 * 2 * 16 * 16 * 2


@dataclass
class _TokensOnly(Compressor):
    """A model-needing stand-in for token recompute: stores the token ids and regenerates KV with ctx.model."""

    name = "tokens_only"
    lossless = False
    needs_model = True

    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream:
        if kv.tokens is None or ctx.model is None:
            raise ValueError("needs token ids and the model")
        return Bitstream.pack(self.name, {"tokens": tensor_to_bytes(kv.tokens.to(torch.int32))})

    @torch.no_grad()
    def decode(self, bs: Bitstream, ctx: Context) -> KVSequence:
        toks = tensor_from_bytes(bs.sections(expect=self.name)["tokens"], torch.int32, (ctx.n_tokens,)).long()
        out = ctx.model.model(toks[None], cache=DynamicCache(), use_cache=True).cache
        k = torch.cat([layer.keys for layer in out.layers]).to(ctx.dtype)  # (L, H, T, D)
        v = torch.cat([layer.values for layer in out.layers]).to(ctx.dtype)  # (L, H, T, D)
        return KVSequence(k, v)


def test_whole_sequence_compressor_codes_once_and_keeps_decode_tokens(tiny_model):
    ids = _ids(30, seed=5)
    cache = CompressedCache(_TokensOnly(), residual=2, chunk=4, model=tiny_model)
    assert cache.mode == "once"
    got = tiny_model.generate(ids, max_new_tokens=12, do_sample=False, cache=cache)
    ref = tiny_model.generate(ids, max_new_tokens=12, do_sample=False,
                              cache=CompressedCache(None, model=tiny_model))
    assert torch.equal(got, ref)  # recomputation is exact here (same kernels, same rounding)
    assert [s.length for s in cache.segments] == [28]
    assert cache.window_tokens == 2 + 11
    with pytest.raises(ValueError, match="pass model="):
        CompressedCache(_TokensOnly(), config=tiny_model.config)


def test_clone_crop_and_bad_input(tiny_model):
    cache = CompressedCache(Identity(), residual=4, chunk=8, model=tiny_model)
    with torch.no_grad():
        tiny_model(_ids(20), cache=cache, use_cache=True)
        twin = cache.clone()
        tiny_model(_ids(3, seed=9), cache=twin, use_cache=True)
    assert cache.get_seq_length() == 20 and twin.get_seq_length() == 23
    twin.crop(-2)
    assert twin.get_seq_length() == 21
    with pytest.raises(ValueError, match="window"):
        twin.crop(-10)
    with pytest.raises(ValueError, match="batch size"):
        tiny_model(torch.zeros(2, 3, dtype=torch.long), cache=CompressedCache(Identity(), model=tiny_model), use_cache=True)
    with pytest.raises(ValueError, match="model= or config="):
        CompressedCache(Identity())
    with pytest.raises(ValueError, match="mode"):
        CompressedCache(Identity(), mode="sometimes", model=tiny_model)


def test_load_from_a_shared_prefill(tiny_model):
    ids = _ids(40, seed=6)
    with torch.no_grad():
        pre = tiny_model(ids[:, :-1], cache=DynamicCache(), use_cache=True).cache
        loaded = CompressedCache(Identity(), model=tiny_model).load(pre, ids[0, :-1])
        direct = CompressedCache(Identity(), model=tiny_model)
        tiny_model(ids[:, :-1], cache=direct, use_cache=True)
        a = tiny_model(ids[:, -1:], cache=loaded, use_cache=True).logits
        b = tiny_model(ids[:, -1:], cache=direct, use_cache=True).logits
    assert torch.equal(a, b) and loaded.tokens == direct.tokens


@pytest.mark.parametrize("name", available("compressor"))
def test_every_registered_compressor_runs_in_the_loop(name, tiny_model, random_kv):
    """Every configured compressor, as its config builds it, stores the tiny model's cache and decodes it back in
    the loop; compressors that need the model get it in the context, set compressors code a set of one. Nothing
    is skipped: an encoder that refuses these shapes fails the test like anything else raised here."""
    comp = make_compressor(compose([f"+compressor={name}"]).compressor)
    comp.fit([random_kv(L=2, H=2, T=64, D=16, seed=s) for s in (11, 12)], config=tiny_model.config)
    # a first chunk long enough that a fixed cost (exact sinks at 16 bits) fits a configured budget of 1 bit
    ids = _ids(160, seed=7)
    base = _decode_logits(tiny_model, CompressedCache(None, model=tiny_model), ids, 4)
    cache = CompressedCache(comp, residual=0, chunk=128, model=tiny_model)
    got = _decode_logits(tiny_model, cache, ids, 4)
    assert cache.compressed_tokens == 160
    for a, b in zip(base, got):
        assert b.shape == a.shape and torch.isfinite(b).all()
        if comp.lossless:
            assert torch.equal(a, b)


@dataclass
class _Flipping(Identity):
    """Identity whose stored bytes get one byte flipped after they were framed (storage corruption)."""

    def encode(self, kv, ctx):
        bs = super().encode(kv, ctx)
        flipped = bytearray(bs.data)
        flipped[len(flipped) // 2] ^= 0xFF
        return SimpleNamespace(data=bytes(flipped))


def test_a_corrupted_segment_fails_when_it_is_stored(tiny_model):
    cache = CompressedCache(_Flipping(), residual=4, chunk=8, model=tiny_model)
    with torch.no_grad(), pytest.raises(BitstreamError, match="checksum"):
        tiny_model(_ids(20), cache=cache, use_cache=True)


@dataclass
class _KiviWhole(KIVI):
    """KIVI without its per-layer read: the cache decodes whole segments from bytes."""

    def resident(self, bs, ctx):
        return None


def test_kivi_per_layer_reads_equal_whole_segment_decoding(tiny_model):
    ids = _ids(90, seed=11)
    layered = CompressedCache(KIVI(bits=2, group_size=16), residual=8, chunk=16, model=tiny_model)
    whole = CompressedCache(_KiviWhole(bits=2, group_size=16), residual=8, chunk=16, model=tiny_model)
    a, b = _decode_logits(tiny_model, layered, ids, 20), _decode_logits(tiny_model, whole, ids, 20)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert type(layered.segments[0].resident).__name__ == "Layered" and type(whole.segments[0].resident).__name__ == "Whole"
    # both hold less than their bitstreams' 16-bit equivalent; the whole-segment cache holds exactly its bytes
    assert whole.nbytes() - sum(s.stored_bytes for s in whole.segments) == layered.nbytes() - sum(s.resident.nbytes for s in layered.segments)
    assert all(s.resident._kv is None for s in whole.segments)  # decoded tensors do not outlive the forward pass


def test_evicted_entries_stay_hidden_per_head_in_the_decode_loop(tiny_model):
    """The cache's logits equal scoring the decoded sequence with its kept mask, and differ from attending to the
    zeros at the evicted entries."""
    from compressors.eviction.knorm import KNorm
    from kvbench.cache.eviction_mask import hide_evicted
    from kvbench.measure.metrics.task_loss import build_cache

    ids = _ids(64, seed=12)
    comp = KNorm(keep=0.5)
    cache = CompressedCache(comp, residual=0, chunk=1 << 20, mode="once", model=tiny_model)
    steps = [torch.tensor([[(5 * t + 1) % 128]]) for t in range(4)]
    with torch.no_grad():
        tiny_model(ids, cache=cache, use_cache=True)
        got = [tiny_model(s, cache=cache, use_cache=True).logits for s in steps]
        kv = comp.decode(Bitstream.from_bytes(bytes(comp.encode(_kv_of(tiny_model, ids), None).data)), _ctx(tiny_model, 64))
        assert kv.kept is not None and not bool(kv.kept.all())
        heads_differ = (kv.kept[:, 0] != kv.kept[:, 1]).any()
        assert heads_differ, "KNorm kept the same positions in both heads; the test needs per-head masks"
        ref_cache, plain_cache = build_cache(tiny_model, kv), build_cache(tiny_model, kv)
        with hide_evicted(tiny_model, kv.kept):
            ref = [tiny_model(s, cache=ref_cache, use_cache=True).logits for s in steps]
        plain = [tiny_model(s, cache=plain_cache, use_cache=True).logits for s in steps]
    for g, r, p in zip(got, ref, plain):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(g, p, atol=1e-3)
    assert cache.kept_mask(0).shape == (2, 64 + 4)  # the prefix and the four tokens fed since


def _kv_of(model, ids: torch.Tensor) -> KVSequence:
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    k = torch.cat([layer.keys for layer in cache.layers]).to(torch.float16)  # (L, H, T, D)
    v = torch.cat([layer.values for layer in cache.layers]).to(torch.float16)
    return KVSequence(k, v, ids[0])


def _ctx(model, T: int) -> Context:
    c = model.config
    return Context(c.num_hidden_layers, c.num_key_value_heads, T, c.hidden_size // c.num_attention_heads, torch.float16, None,
                   config=c)


def test_a_model_decoder_restores_each_segment_once_not_every_step(tiny_model, monkeypatch):
    from compressors.exact.recompute import Recompute

    calls = []
    original = Recompute.decode
    monkeypatch.setattr(Recompute, "decode", lambda self, bs, ctx: calls.append(ctx.n_tokens) or original(self, bs, ctx))
    ids = _ids(30, seed=13)
    base = _decode_logits(tiny_model, CompressedCache(None, model=tiny_model), ids, 4)
    cache = CompressedCache(Recompute(), residual=0, model=tiny_model)
    got = _decode_logits(tiny_model, cache, ids, 4)
    assert calls == [30] and cache.mode == "once"  # restored when stored; the four steps read the held KV
    assert cache.nbytes() == 2 * 2 * 2 * 34 * 16 * 2  # it holds 16-bit KV after restoring, and says so
    for a, b in zip(base, got):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_kivi_segment_shorter_than_a_key_group_is_all_tail(tiny_model):
    ids = _ids(5, seed=14)
    cache = CompressedCache(KIVI(bits=2, group_size=16), residual=0, model=tiny_model)
    base = _decode_logits(tiny_model, CompressedCache(None, model=tiny_model), ids, 2)
    got = _decode_logits(tiny_model, cache, ids, 2)
    assert cache.segments[0].length == 5 and torch.isfinite(got[-1]).all()
    assert torch.equal(base[0], got[0])


def test_holding_decoded_segments_gives_the_same_logits_with_one_decode_per_segment(tiny_model, monkeypatch):
    from compressors.quantizers.turboquant import TurboQuant

    calls = []
    original = TurboQuant.decode
    monkeypatch.setattr(TurboQuant, "decode", lambda self, bs, ctx: calls.append(ctx.n_tokens) or original(self, bs, ctx))
    ids = _ids(40, seed=15)
    comp = TurboQuant(bits=3)
    by_bytes = _decode_logits(tiny_model, CompressedCache(comp, residual=0, chunk=8, model=tiny_model), ids, 10)
    per_step = len(calls)
    calls.clear()
    cache = CompressedCache(comp, residual=0, chunk=8, model=tiny_model, hold="decoded")
    decoded = _decode_logits(tiny_model, cache, ids, 10)
    for a, b in zip(by_bytes, decoded):
        assert torch.equal(a, b)
    assert len(calls) == len(cache.segments) < per_step  # once per stored segment, not once per step
    with pytest.raises(ValueError, match="hold"):
        CompressedCache(comp, model=tiny_model, hold="tensors")
