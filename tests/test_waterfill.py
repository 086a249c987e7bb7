"""Waterfill: joint token x coefficient allocation by reverse water-filling (tiers, water level, dropped tiers, rate)."""

import numpy as np
import pytest
import torch
from conftest import tiny_windows

from compressors.transform.waterfill import Waterfill
from compressors.transform.waterfill_allocation import assign_tiers, tier_sizes, water_level, widths_at
from kvbench.coding.bitstream import Bitstream, BitstreamError
from kvbench.core.codec import decoder_for, state_bytes
from kvbench.core.kv import Context, KVSequence


@pytest.fixture(scope="module")
def trace():
    """A tiny random Llama, two calibration windows and one evaluated window with its token ids (float16 KV)."""
    model, (a, b, scored) = tiny_windows([192, 192, 128])
    return model, [a, b], scored


def _fitted(model, calib, **fields) -> Waterfill:
    comp = Waterfill(**fields)
    comp.fit(calib, config=model.config)
    return comp


def _roundtrip(comp, model, kv):
    bs = comp.encode(kv, Context.for_kv(kv, model, model.config))
    dec = decoder_for(comp, state_bytes(comp))
    return bs, dec.decode(Bitstream.from_bytes(bs.data), Context.for_kv(kv, None, model.config))


def test_tiers_halve_and_follow_importance():
    assert tier_sizes(100, 4) == [50, 25, 13, 12] and sum(tier_sizes(7, 3)) == 7 and tier_sizes(9, 1) == [9]
    a = torch.tensor([[5.0, 1.0, 3.0, 2.0, 4.0, 0.5, 6.0, 7.0]])  # (1, 8)
    tiers = assign_tiers(a, 3)  # sizes 4, 2, 2
    assert tiers.tolist() == [[1, 0, 0, 0, 1, 0, 2, 2]]


def test_water_level_spends_at_most_the_budget_and_more_weight_gets_more_bits():
    rng = np.random.default_rng(0)
    # distortion falls by 4x a bit (6 dB a bit) from per-component variances
    var = np.sort(rng.uniform(0.1, 4.0, (2, 6)))[:, ::-1]  # (U, C)
    dist = var[:, :, None] * 4.0 ** -np.arange(9)  # (U, C, W + 1)
    weights = np.array([[0.1, 1.0, 10.0], [0.1, 1.0, 10.0]])  # (U, G)
    counts = np.array([[50, 25, 25], [50, 25, 25]])
    budget = 2.0 * counts.sum() * 6
    lam = water_level(dist, weights, counts, budget)
    w = widths_at(dist, weights, float(lam))  # (U, G, C)
    assert (w.sum(axis=2) * counts).sum() <= budget
    assert (w.sum(axis=2) * counts).sum() > 0.9 * budget  # the water level is the least that fits
    assert (np.diff(w.sum(axis=2), axis=1) >= 0).all()  # heavier tiers never get fewer bits
    # reverse water-filling: one more bit for a component saves at most lam in weighted distortion
    for u, g, c in np.ndindex(w.shape):
        if w[u, g, c] < 8:
            saved = weights[u, g] * (dist[u, c, w[u, g, c]] - dist[u, c, w[u, g, c] + 1])
            assert saved <= lam * (1 + 1e-6)


@pytest.mark.parametrize(("importance", "distortion"), [("attention", "energy"), ("uniform", "energy"),
                                                        ("all", "query"), ("attention", "query_output")])
def test_roundtrip_rate_and_decoder_from_bytes(trace, importance, distortion):
    model, calib, kv = trace
    comp = _fitted(model, calib, bits=1.0, importance=importance, distortion=distortion, obs_window=16)
    bs, out = _roundtrip(comp, model, kv)
    assert out.shape == kv.shape and out.k.dtype == kv.k.dtype
    assert torch.equal(out.k[:, :, :4], kv.k[:, :, :4]) and torch.equal(out.v[:, :, :4], kv.v[:, :, :4])
    # the budget covers coefficients; tiers, the allocation and the frame add a little; the coder may
    # differ from the calibrated width by a fraction of a bit on a window it was not fitted on
    assert 0.5 < bs.num_bits / kv.n_elements < 1.5
    if out.kept is not None:
        keep = out.kept.unsqueeze(-1).expand_as(out.k)
        assert (out.k[~keep] == 0).all() and (out.v[~keep] == 0).all() and out.kept[:, :, :4].all()
    again = comp.decode(Bitstream.from_bytes(bs.data), Context.for_kv(kv, None, model.config))
    assert torch.equal(again.k, out.k) and torch.equal(again.v, out.v)


def test_more_bits_less_error(trace):
    model, calib, kv = trace
    errs = []
    for bits in (1.0, 2.0, 4.0):  # 4 exact sinks of 128 tokens alone take 0.5 bits per element
        _, out = _roundtrip(_fitted(model, calib, bits=bits, importance="uniform"), model, kv)
        errs.append(float(sum((a.float() - b.float()).pow(2).mean() for a, b in ((out.k, kv.k), (out.v, kv.v)))))
    assert errs[0] > errs[1] > errs[2]


def test_a_low_budget_drops_the_least_attended_tokens(trace, monkeypatch):
    model, calib, kv = trace
    # the tiny model has 64 elements per token and layer, so its tiers' side information is a large fixed cost and a
    # budget low enough to drop tiers is refused (tests/test_bad_inputs.py); the dropping itself is tested past it
    monkeypatch.setattr(Waterfill, "_check_budget", lambda *args: None)
    comp = _fitted(model, calib, bits=0.25, tiers=4, obs_window=16)
    _, out = _roundtrip(comp, model, kv)
    assert out.kept is not None and not out.kept.all()
    # one selection per layer (tiers are per layer and token), the same for every KV head
    assert (out.kept == out.kept[:, :1]).all()
    assert comp.stats()["dropped_fraction"] > 0


def test_corruption_and_wrong_shapes_are_refused(trace):
    model, calib, kv = trace
    comp = _fitted(model, calib, obs_window=16)
    bs = comp.encode(kv, Context.for_kv(kv, model, model.config))
    bad = bytearray(bs.data)
    bad[len(bad) // 2] ^= 0x10
    with pytest.raises(BitstreamError, match="checksum"):
        comp.decode(Bitstream.from_bytes(bytes(bad)), Context.for_kv(kv, None, model.config))
    small = KVSequence(kv.k[:1], kv.v[:1], kv.tokens)
    with pytest.raises(ValueError, match="fitted on 2 layers"):
        comp.encode(small, Context.for_kv(small, model, model.config))
    with pytest.raises(ValueError, match="no fitted state"):
        Waterfill().encode(kv, Context.for_kv(kv, model, model.config))


@pytest.mark.parametrize(("field", "value", "match"), [
    ("bits", 0, r"waterfill\.bits=0 is out of range"),
    ("bits", "one", r"waterfill\.bits='one' must be a number"),
    ("tiers", 0, r"waterfill\.tiers=0 is out of range"),
    ("importance", "norm", r"waterfill\.importance='norm' is not allowed"),
    ("distortion", "mse", r"waterfill\.distortion='mse' is not allowed"),
    ("kernel", 4, r"waterfill\.kernel=4 must be odd"),
    ("power", -1, r"waterfill\.power=-1 is out of range"),
])
def test_bad_fields_say_what_is_allowed(field, value, match):
    with pytest.raises(ValueError, match=match):
        Waterfill(**{field: value})


def test_the_distortion_field_keys_runs_from_before_it_as_the_same_cell():
    # runs published before the field existed were measured at distortion=energy and keyed without it
    assert "distortion" not in Waterfill().keyed() and Waterfill().describe()["distortion"] == "energy"
    assert Waterfill(distortion="query").keyed()["distortion"] == "query"
    assert {k: v for k, v in Waterfill().describe().items() if k != "distortion"} == Waterfill().keyed()


def test_every_querys_importance_is_the_mean_attention_a_key_receives(trace):
    model, calib, kv = trace
    comp = Waterfill(importance="all", kernel=1)  # no pooling: the importance itself
    qs = comp._queries(kv, Context.for_kv(kv, model, model.config))
    assert qs.first == 0
    got = comp._importance(kv, qs, 0)  # (L, T)
    L, H, T, D = kv.shape
    want = torch.zeros(L, T, dtype=torch.float64)
    for layer in range(L):  # by hand: every query's causal softmax, summed per key, over the queries that see it
        keys = kv.k[layer].double().repeat_interleave(qs.q.shape[1] // H, dim=0)  # (Hq, T, D)
        for i in range(T):
            logits = torch.einsum("hd,htd->ht", qs.q[layer, :, i].double(), keys[:, : i + 1]) * qs.scaling[layer]
            want[layer, : i + 1] += torch.softmax(logits, dim=-1).mean(0)
        want[layer] /= torch.arange(T, 0, -1, dtype=torch.float64)
    want /= want.mean(dim=1, keepdim=True)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)
