"""The Gaussian rate–distortion reference: reverse water-filling against closed forms, and the rate of sampled
Gaussian windows against their theory."""

import math

import pytest
import torch

from kvbench.measure.metrics.rate_distortion import gaussian_rd, layer_spectra, reverse_waterfill


def test_reverse_waterfilling_matches_its_closed_form():
    lam = torch.tensor([4.0, 1.0])
    # D = 1.5 < 2·1: the level θ = 0.75 lies below both variances, so both components are coded
    assert reverse_waterfill(lam, 1.5) == pytest.approx(0.5 * math.log2(4 / 0.75) + 0.5 * math.log2(1 / 0.75))
    # D = 3: θ = 2 covers the small component entirely (0 bits for it)
    assert reverse_waterfill(lam, 3.0) == pytest.approx(0.5 * math.log2(4 / 2))
    assert reverse_waterfill(lam, 5.0) == 0.0 and reverse_waterfill(lam, 7.0) == 0.0
    assert reverse_waterfill(lam, 0.0) == math.inf


def test_the_layer_spectrum_is_the_covariance_over_heads_and_the_energy_uncentred():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4000, 4, generator=g) * 2 + 1  # (L, H, T, D): variance 4, mean 1 per element
    eig, energy = layer_spectra([x[:, :, :1000], x[:, :, 1000:]])
    assert eig.shape == (2, 12)
    assert eig.mean().item() == pytest.approx(4.0, rel=0.05)
    assert energy == pytest.approx(2 * 12 * 5.0, rel=0.05)  # (4 + 1²) per element, 24 elements a token


def test_white_gaussian_windows_cost_half_log_of_the_inverse_relative_error():
    g = torch.Generator().manual_seed(1)
    ks = [torch.randn(2, 2, 2000, 8, generator=g) for _ in range(2)]
    vs = [torch.randn(2, 2, 2000, 8, generator=g) for _ in range(2)]
    got = gaussian_rd(ks, vs, 0.25, 0.0625)
    # unit-variance zero-mean components: D/d = rel, so R = ½ log2(1/rel) per element for each kind
    assert got["rd_bits_per_element"] == pytest.approx((1.0 + 2.0) / 2, rel=0.03)
    assert math.isnan(got["rd_bits_per_element_pre_rope"])  # no model config, no RoPE to undo


def test_correlated_heads_cost_less_than_independent_ones():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(1, 1, 3000, 8, generator=g)
    shared = base.expand(1, 4, 3000, 8) + 0.1 * torch.randn(1, 4, 3000, 8, generator=g)  # heads nearly copies
    alone = torch.randn(1, 4, 3000, 8, generator=g)
    assert gaussian_rd([shared], [shared], 0.05, 0.05)["rd_bits_per_element"] < \
        gaussian_rd([alone], [alone], 0.05, 0.05)["rd_bits_per_element"]


def test_the_weighted_rate_lets_keys_and_values_trade_error_at_the_coders_objective():
    g = torch.Generator().manual_seed(3)
    ks = [torch.randn(2, 2, 4000, 8, generator=g) * 3]  # variance 9: relative errors are over each kind's energy
    vs = [torch.randn(2, 2, 4000, 8, generator=g)]
    # white components: at weight 1 one water level gives both kinds the same relative error, the mean of the two
    # the cell measured (0.15625), at ½ log2(1/0.15625) bits per element
    got = gaussian_rd(ks, vs, 0.25, 0.0625)
    both = 0.5 * math.log2(1 / 0.15625)
    assert got["rd_bits_per_element_weighted"] == pytest.approx(both, rel=0.03)
    assert got["rd_bits_per_element_weighted"] < got["rd_bits_per_element"]  # the split it measured costs more
    # the cell's own split is the cheapest one when it meets the weighted level: equal weighted errors here
    even = gaussian_rd(ks, vs, 0.125, 0.125)
    assert even["rd_bits_per_element_weighted"] == pytest.approx(even["rd_bits_per_element"], rel=1e-6)
    # key weight w = 0.25: the optimum gives the keys four times the values' relative error, which is the split the
    # cell measured (0.25 against 0.0625), so the two rates agree
    weighted = gaussian_rd(ks, vs, 0.25, 0.0625, weights=(0.25, 1.0))
    assert weighted["rd_bits_per_element_weighted"] == pytest.approx(weighted["rd_bits_per_element"], rel=0.01)
    assert weighted["rd_key_weight"] == 0.25
    # scaling both weights changes nothing: only their ratio is the objective
    assert gaussian_rd(ks, vs, 0.25, 0.0625, weights=(0.5, 2.0))["rd_bits_per_element_weighted"] == \
        pytest.approx(weighted["rd_bits_per_element_weighted"], rel=1e-9)


def test_a_run_prices_the_error_by_its_coders_own_kind_weights():
    from compressors.transform.kvtc import Kvtc
    from compressors.transform.waterfill import Waterfill
    from kvbench.core.kv import KVSequence
    from kvbench.measure.metrics.distortion import DistortionAccumulator
    from kvbench.measure.run import rd_reference

    assert Kvtc(bits=2, key_weight=0.3).kind_weights() == (0.3, 1.0)
    assert Waterfill(bits=1, key_weight=0.7).kind_weights() == (0.7, 1.0)
    g = torch.Generator().manual_seed(4)
    kv = KVSequence(torch.randn(2, 2, 3000, 8, generator=g), torch.randn(2, 2, 3000, 8, generator=g))
    dist = DistortionAccumulator()
    dist.add("k", kv.k, kv.k * 0.5)  # relative error 0.25
    dist.add("v", kv.v, kv.v * 0.75)  # 0.0625
    plain, keyed = rd_reference([kv], dist, False, None), rd_reference([kv], dist, False, None, (0.25, 1.0))
    assert keyed["rd_key_weight"] == 0.25 and plain["rd_key_weight"] == 1.0
    assert keyed["rd_bits_per_element_weighted"] == pytest.approx(keyed["rd_bits_per_element"], rel=0.02)
    assert plain["rd_bits_per_element_weighted"] < keyed["rd_bits_per_element_weighted"]
    dropped = DistortionAccumulator()
    dropped.add("k", kv.k, kv.k, (torch.arange(3000) < 1500).expand(2, 2, 3000))
    dropped.add("v", kv.v, kv.v, (torch.arange(3000) < 1500).expand(2, 2, 3000))
    nan = rd_reference([kv], dropped, False, None, (0.25, 1.0))
    assert set(nan) == set(keyed) and all(math.isnan(nan[k]) for k in keyed if k != "rd_key_weight")
    assert nan["rd_key_weight"] == 0.25
