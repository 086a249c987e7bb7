"""Waterfill's distortion as a later query sees it: the rotation-averaged query metric, o_proj's metric on values,
and the per-layer scales (compressors/transform/waterfill_metric.py), checked against closed forms."""

import numpy as np
import torch
from conftest import tiny_llama

from compressors.transform.waterfill_metric import output_metric, quadratic_forms, query_metric, relative
from kvbench.core.rope import Rotary


def test_queries_along_a_fast_rotary_pair_spread_over_it_and_a_slow_pair_keeps_its_direction():
    model = tiny_llama()  # head_dim 16: rotate_half pairs dimension i with i + 8, dimension 0 turning fastest
    D, T = 16, 1024
    q = torch.zeros(2, 4, T, D)  # (L, Hq, T, D): 4 query heads over 2 KV heads
    q[..., 0] = 1.0  # the fastest pair (1 radian a position): a uniform distance spreads it evenly over (0, 8)
    q[..., 7] = 1.0  # the slowest pair: turns less than a radian over the sequence, stays mostly on dimension 7
    m = query_metric(q, Rotary(model.config), n_kv_heads=2)  # (L, H, D, D)
    assert m.shape == (2, 2, D, D)
    diag = m.diagonal(dim1=-2, dim2=-1)  # (L, H, D)
    # two query heads per KV head, each with E[cos²] = E[sin²] = 1/2 over the distances
    assert torch.allclose(diag[..., 0], torch.full((2, 2), 1.0, dtype=torch.float64), atol=0.02)
    assert torch.allclose(diag[..., 8], torch.full((2, 2), 1.0, dtype=torch.float64), atol=0.02)
    assert (diag[..., 7] > 1.5).all() and (diag[..., 15] < 0.5).all()
    others = [i for i in range(D) if i not in (0, 7, 8, 15)]
    assert diag[..., others].abs().max() == 0


def test_the_value_metric_is_what_o_proj_passes_on_to_the_output():
    model = tiny_llama()  # 4 query heads of dimension 16 over 2 KV heads
    g = output_metric(model, n_kv_heads=2, head_dim=16)  # (L, H, D, D)
    e = torch.randn(16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for layer, block in enumerate(model.model.layers):
        w = block.self_attn.o_proj.weight.detach().double()  # (hidden, 4 * 16)
        for h in range(2):  # KV head h serves query heads 2h and 2h + 1
            direct = sum(float((w[:, j * 16 : (j + 1) * 16] @ e).pow(2).sum()) for j in (2 * h, 2 * h + 1))
            assert abs(float(e @ g[layer, h] @ e) - direct) < 1e-9 * direct


def test_scales_are_one_for_an_isotropic_metric_and_follow_the_metric_otherwise():
    L, H, D = 2, 2, 4
    basis = torch.eye(H * D).expand(L, H * D, H * D)  # (U, d, r): one component per coordinate
    sigma = np.ones((L, H * D))
    iso = quadratic_forms(torch.eye(D, dtype=torch.float64).expand(L, H, D, D), basis)
    assert torch.equal(relative(iso, sigma), torch.ones(L, H * D, dtype=torch.float64))
    metric = torch.zeros(L, H, D, D, dtype=torch.float64)
    metric[:, 0, 0, 0] = 3.0  # only the first coordinate of KV head 0 is read, three times as hard
    metric[:, 1, 1, 1] = 1.0
    scales = relative(quadratic_forms(metric, basis), sigma)
    # the σ²-weighted mean is (3 + 1) / 8 = 0.5: coordinate 0 scales to 6, head 1's coordinate 1 to 2, the rest to 0
    want = torch.zeros(L, H * D, dtype=torch.float64)
    want[:, 0], want[:, D + 1] = 6.0, 2.0
    assert torch.allclose(scales, want)
    # a component with most of the layer's energy weighs the mean: σ² = 4 on coordinate 0 gives a mean of 13 / 11
    heavy = sigma.copy()
    heavy[:, 0] = 2.0
    assert torch.allclose(relative(quadratic_forms(metric, basis), heavy)[:, 0], torch.full((L,), 3.0 * 11 / 13,
                                                                                          dtype=torch.float64))
