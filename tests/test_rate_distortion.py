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
