"""TurboQuant (arXiv 2504.19874) against its theory: unit-vector distortion, inner-product bias, bits, errors."""

import math

import numpy as np
import pytest
import torch

from compressors.quantizers.rotation import RandomizedHadamard, RandomOrthogonal, fwht, hadamard_matrix
from compressors.quantizers.sphere_codebook import codebook, solve
from compressors.quantizers.turboquant import TurboQuant, split_bits
from kvbench.coding.bitstream import Bitstream
from kvbench.core.config import compose, make_compressor
from kvbench.core.kv import Context, KVSequence

# Lloyd-Max distortion of a unit-variance Gaussian at 1..4 bits (Max 1960), which the paper quotes for TQ_mse
GAUSSIAN_LLOYD_MAX = {1: 0.3634, 2: 0.1175, 3: 0.0345, 4: 0.0095}


def unit_vectors(n: int, d: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (x / x.norm(dim=1, keepdim=True)).float()  # (n, d), uniform on the sphere


def roundtrip(comp: TurboQuant, x: torch.Tensor) -> tuple[torch.Tensor, Bitstream]:
    """Quantize rows of ``x`` (N, d) as the keys (and values) of one head; decode from the bytes alone."""
    kv = KVSequence(x[None, None], x[None, None])  # (1, 1, N, d)
    bs = comp.encode(kv, Context.for_kv(kv))
    out = comp.decode(Bitstream.from_bytes(bs.data), Context.for_kv(kv))
    return out.k[0, 0].float(), bs


# ---- codebooks ----------------------------------------------------------------------------------------------


def test_codebook_is_uniform_and_exact_at_d3():
    # Archimedes: a coordinate of a random unit vector in R^3 is uniform on [-1, 1], whose Lloyd-Max quantizer is
    # the uniform one with per-coordinate error (2/K)^2/12, i.e. 3 * that = 4^-b over the whole vector.
    for b in (1, 2, 3, 5):
        c = solve(3, b)
        k = 1 << b
        np.testing.assert_allclose(c, -1 + (2 * np.arange(k) + 1) / k, atol=1e-10)
        assert codebook(3, b).unit_mse == pytest.approx(4.0**-b, rel=1e-9)


@pytest.mark.parametrize("d", [16, 64, 128, 1024])
def test_codebooks_are_symmetric_increasing_and_tend_to_gaussian(d):
    for b in range(1, 9):
        c = codebook(d, b).centroids
        assert len(c) == 1 << b and np.all(np.diff(c) > 0)
        np.testing.assert_allclose(c, -c[::-1], atol=1e-15)
    if d == 1024:  # N(0, 1/d) limit: the Gaussian Lloyd-Max distortions
        for b, ref in GAUSSIAN_LLOYD_MAX.items():
            assert codebook(d, b).unit_mse == pytest.approx(ref, rel=0.005)


def test_codebook_disk_cache_is_written_and_read(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    codebook.cache_clear()
    try:
        first = codebook(40, 3).centroids
        files = list((tmp_path / "codebooks").glob("*d40-b3*.npy"))
        assert len(files) == 1
        np.save(files[0], first + 1.0)  # a cached file is what the next process reads
        codebook.cache_clear()
        assert np.allclose(codebook(40, 3).centroids, first + 1.0)
    finally:
        codebook.cache_clear()


# ---- rotations ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [2, 8, 64, 256, 1024])
def test_fwht_matches_the_hadamard_matrix_at_every_radix(d):
    x = torch.randn(5, d, dtype=torch.float64)
    ref = x @ hadamard_matrix(d).double()
    for radix in (2, 8, 64):
        torch.testing.assert_close(fwht(x, max_radix=radix), ref)


@pytest.mark.parametrize("rot", [RandomizedHadamard, RandomOrthogonal])
@pytest.mark.parametrize("d", [64, 256])
def test_rotations_are_orthogonal_seeded_and_invertible(rot, d):
    x = torch.randn(100, d)
    r = rot(d, seed=3)
    y = r.forward(x)
    torch.testing.assert_close(y.norm(dim=1), x.norm(dim=1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r.inverse(y), x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rot(d, seed=3).forward(x), y)
    assert not torch.allclose(rot(d, seed=4).forward(x), y, atol=1e-3)


def test_hadamard_dense_and_factored_paths_agree():
    x = torch.randn(50, 128)
    dense, factored = RandomizedHadamard(128, 7, max_radix=128), RandomizedHadamard(128, 7, max_radix=4)
    assert dense.matrix is not None and factored.matrix is None
    torch.testing.assert_close(dense.forward(x), factored.forward(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense.inverse(x), factored.inverse(x), rtol=1e-5, atol=1e-5)


# ---- theory: distortion and inner products --------------------------------------------------------------------


@pytest.mark.parametrize("rotation", ["hadamard", "orthogonal"])
@pytest.mark.parametrize("d", [64, 128])
def test_tq_mse_distortion_matches_theory(d, rotation):
    x = unit_vectors(20_000, d, seed=d)
    for b, ref in GAUSSIAN_LLOYD_MAX.items():
        x_hat, _ = roundtrip(TurboQuant(bits=b, rotation=rotation), x)
        mse = float((x_hat - x).pow(2).sum(1).mean())
        upper = math.sqrt(3) * math.pi / 2 * 4.0**-b  # the paper's Theorem 1 bound
        assert mse < upper, (b, mse, upper)
        assert abs(mse / ref - 1) < 0.08, (b, mse, ref)
        # and it is what the exact-marginal codebook predicts, to sampling error
        assert mse == pytest.approx(codebook(d, b).unit_mse, rel=0.03)


def _inner_product_errors(variant: str, bits: float, d: int, n_seeds: int = 40, per_seed: int = 500):
    """Per-seed mean of <q, x̂> - <q, x> over random pairs; each seed is a fresh rotation (and QJL matrix).

    q is correlated with x (cosine ~0.7): for independent q, a symmetric q distribution would hide any bias.
    Unbiasedness is over the quantizer's randomness, so pairs are spread over many seeds and the standard error
    is taken over the per-seed means (pairs that share a seed share S and are not independent).
    """
    means = []
    for s in range(n_seeds):
        x = unit_vectors(per_seed, d, seed=10_000 + s)
        q = x + torch.randn(per_seed, d, generator=torch.Generator().manual_seed(s)) / math.sqrt(d)  # (n, d)
        x_hat, _ = roundtrip(TurboQuant(bits=bits, variant=variant, seed=s), x)
        means.append(float(((x_hat - x) * q).sum(1).mean()))
    m = np.array(means)
    return m.mean(), m.std(ddof=1) / math.sqrt(len(m))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_tq_prod_inner_products_are_unbiased(bits):
    mean, se = _inner_product_errors("prod", bits, d=64)
    assert abs(mean) < 3 * se, (mean, se)


@pytest.mark.parametrize("bits", [1, 2])
def test_tq_mse_inner_products_are_biased_at_low_bits(bits):
    mean, se = _inner_product_errors("mse", bits, d=64)
    assert mean < -3 * se, (mean, se)
    # the shrinkage is about the distortion times <q, x>/|x|^2 ~ 1 here: -0.36 at 1 bit, -0.11 at 2
    assert mean == pytest.approx(-codebook(64, bits).unit_mse, rel=0.1)


def test_tq_prod_costs_squared_error_for_its_unbiasedness():
    x = unit_vectors(5000, 64, seed=1)
    mse = {v: float((roundtrip(TurboQuant(bits=3, variant=v), x)[0] - x).pow(2).sum(1).mean()) for v in ("mse", "prod")}
    assert mse["prod"] > 2 * mse["mse"]


# ---- fractional bits, accounting, roundtrip --------------------------------------------------------------------


def test_fractional_bits_split_the_coordinates():
    assert split_bits(2.5, 64) == [(32, 3), (32, 2)]
    assert split_bits(3.25, 128) == [(32, 4), (96, 3)]
    assert split_bits(3, 64) == [(64, 3)]
    assert TurboQuant(bits=3.5).effective_bits(64) == 3.5
    assert TurboQuant(bits=2.5, variant="prod").effective_bits(64) == 2.5
    x = unit_vectors(4000, 64, seed=2)
    err = [float((roundtrip(TurboQuant(bits=b), x)[0] - x).pow(2).sum(1).mean()) for b in (2, 2.5, 3, 3.5, 4)]
    assert all(a > b for a, b in zip(err, err[1:])), err


@pytest.mark.parametrize(
    "kw, per_element",
    [
        ({"bits": 3}, 3 + 16 / 64),
        ({"bits": 2.5}, 2.5 + 16 / 64),
        ({"bits": 3, "norm_bits": 32}, 3 + 32 / 64),
        ({"bits": 3, "variant": "prod"}, 3 + 32 / 64),  # norm and residual norm
        ({"bits": 1, "variant": "prod"}, 1 + 32 / 64),  # 0-bit TQ_mse: the sketch alone
        ({"bits": 3.5, "variant": "prod"}, 3.5 + 32 / 64),
    ],
)
def test_bits_per_element_count_the_norms(random_kv, kw, per_element):
    kv = random_kv(L=2, H=3, T=50, D=64)
    comp = TurboQuant(**kw)
    bs = comp.encode(kv, Context.for_kv(kv))
    assert bs.parts["seed"] == 32
    payload = bs.num_bits - bs.parts["frame"] - bs.parts["seed"]
    assert payload / kv.n_elements == pytest.approx(per_element, abs=1e-12)
    n_vec = 2 * 3 * 50
    assert bs.parts["k.norm"] == n_vec * comp.norm_bits


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", ["mse", "prod"])
def test_roundtrip_from_bytes_is_deterministic(random_kv, dtype, variant):
    kv = random_kv(T=40, D=64, dtype=dtype)
    ctx = Context.for_kv(kv)
    comp = TurboQuant(bits=3, variant=variant, seed=5)
    bs = comp.encode(kv, ctx)
    assert comp.encode(kv, ctx).data == bs.data
    out = TurboQuant(bits=3, variant=variant, seed=99).decode(Bitstream.from_bytes(bs.data), ctx)  # seed read from the stream
    assert out.shape == kv.shape and out.k.dtype == dtype
    assert torch.equal(out.k, comp.decode(bs, ctx).k)
    rel = float((out.v.float() - kv.v.float()).pow(2).sum() / kv.v.float().pow(2).sum())
    assert rel < (0.05 if variant == "mse" else 0.25)


def test_zero_vectors_stay_zero_and_norms_are_kept(random_kv):
    kv = random_kv(T=20, D=64)
    kv.k[:, :, 3] = 0
    out = TurboQuant(bits=4).decode(TurboQuant(bits=4).encode(kv, Context.for_kv(kv)), Context.for_kv(kv))
    assert torch.all(out.k[:, :, 3] == 0)
    ratio = out.v.float().norm(dim=-1) / kv.v.float().norm(dim=-1)
    # the stored norm times a direction of squared length 1 - MSE on average (Lloyd centroids shrink)
    assert float(ratio.pow(2).mean()) == pytest.approx(1 - codebook(64, 4).unit_mse, abs=0.005)
    assert float((ratio - 1).abs().max()) < 0.1


def test_orthogonal_rotation_takes_any_head_dim(random_kv):
    kv = random_kv(T=30, D=48)
    comp = TurboQuant(bits=3, rotation="orthogonal")
    out = comp.decode(comp.encode(kv, Context.for_kv(kv)), Context.for_kv(kv))
    assert out.shape == kv.shape


# ---- bad input ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [0, 0.5, 8.5, 9, -1])
def test_bits_out_of_range_say_what_is_allowed(bits):
    cfg = compose(["+compressor=turboquant", f"compressor.bits={bits}"])
    with pytest.raises(ValueError, match=r"turboquant\.bits=.*1 <= bits <= 8"):
        make_compressor(cfg.compressor)


@pytest.mark.parametrize(
    "field, value, allowed",
    [("variant", "fast", "mse.*prod"), ("rotation", "random", "hadamard.*orthogonal"), ("norm_bits", 8, "16, 32")],
)
def test_unknown_choices_list_the_allowed_ones(field, value, allowed):
    with pytest.raises(ValueError, match=rf"turboquant\.{field}=.*{allowed}"):
        TurboQuant(**{field: value})


def test_non_numeric_bits_and_bad_seed_are_refused():
    with pytest.raises(ValueError, match="must be a number"):
        TurboQuant(bits="3")
    with pytest.raises(ValueError, match="seed"):
        TurboQuant(seed=-1)


def test_hadamard_refuses_a_non_power_of_two_head_dim(random_kv):
    kv = random_kv(T=10, D=48)
    with pytest.raises(ValueError, match=r"hadamard needs a power-of-two head_dim, got head_dim=48.*rotation=orthogonal"):
        TurboQuant().encode(kv, Context.for_kv(kv))


def test_non_finite_kv_is_refused(random_kv):
    kv = random_kv(T=10, D=64)
    kv.k[0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        TurboQuant().encode(kv, Context.for_kv(kv))


# ---- real trace -----------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_tq_mse_on_smollm2_matches_the_unit_vector_distortion():
    from kvbench.measure.run import measure

    cfg = compose(["+compressor=turboquant", "compressor.bits=3", "metrics.nll=false"])
    summary, _ = measure(cfg, make_compressor(cfg.compressor))
    unit = codebook(64, 3).unit_mse  # 0.0334 for head_dim 64
    assert summary["rel_mse_k"] == pytest.approx(unit, rel=0.15)
    assert summary["rel_mse_v"] == pytest.approx(unit, rel=0.15)
    # 3 code bits + a 16-bit norm per 64-dim vector; the per-sequence seed and frame add < 1e-4
    assert summary["bits_per_element"] == pytest.approx(3 + 16 / 64, abs=1e-4)
    assert summary["bits_per_element"] > 3 + 16 / 64


# ---- scalar coding helpers --------------------------------------------------------------------------------------


def test_pack_codes_is_an_lsb_first_bit_stream():
    # dequantize_packed reads this layout directly
    from kvbench.coding.packing import pack_codes

    for bits in range(1, 9):
        codes = torch.randint(0, 1 << bits, (29,), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
        stream = [(int(c) >> i) & 1 for c in codes for i in range(bits)]
        stream += [0] * (-len(stream) % 8)
        expected = bytes(sum(b << i for i, b in enumerate(stream[j : j + 8])) for j in range(0, len(stream), 8))
        assert pack_codes(codes, bits) == (expected, 29 * bits)


@pytest.mark.parametrize("bits", range(1, 9))
def test_quantize_and_dequantize_packed_match_the_plain_rules(bits):
    from compressors.quantizers.scalar_codes import dequantize_packed, quantize
    from kvbench.coding.packing import pack_codes

    cb = codebook(64, bits)
    thr, cen = torch.tensor(cb.thresholds, dtype=torch.float32), torch.tensor(cb.centroids, dtype=torch.float32)
    y = torch.cat([torch.randn(10_001) / 8, thr, -thr, torch.tensor([0.0, -0.0, 5.0, -5.0])])  # ties, zeros, tails
    codes = quantize(y, thr)
    assert codes.dtype == torch.uint8
    assert torch.equal(codes.long(), torch.bucketize(y, thr))  # count of boundaries strictly below
    raw, _ = pack_codes(codes, bits)
    assert torch.equal(dequantize_packed(raw, bits, len(y), cen), cen[codes.long()])


def test_a_norm_beyond_float16_asks_for_norm_bits_32(random_kv):
    kv = random_kv(T=10, D=64, dtype=torch.float32)
    kv.k[0, 0, 0] *= 10_000.0
    big = float(kv.k[0, 0, 0].norm())
    assert big > 65504
    with pytest.raises(ValueError, match="norm_bits=32"):
        TurboQuant().encode(kv, Context.for_kv(kv))
    out = TurboQuant(norm_bits=32).decode(TurboQuant(norm_bits=32).encode(kv, Context.for_kv(kv)), Context.for_kv(kv))
    assert float(out.k[0, 0, 0].norm()) == pytest.approx(big, rel=0.05)


# ---- entropy coding ---------------------------------------------------------------------------------------------

# entropy of the Lloyd-Max codes of a Gaussian (Max 1960's cell probabilities), which the d = 1024 cells approach
GAUSSIAN_LLOYD_MAX_ENTROPY = {1: 1.0, 2: 1.911, 3: 2.825, 4: 3.765}


@pytest.mark.parametrize("d", [64, 1024])
def test_cell_probabilities_are_a_symmetric_law_with_the_gaussian_limit(d):
    for b in range(1, 9):
        p = codebook(d, b).cell_probs
        assert len(p) == 1 << b and np.all(p >= 0) and p.sum() == pytest.approx(1, abs=1e-12)
        np.testing.assert_allclose(p, p[::-1], atol=1e-12)
    if d == 1024:
        for b, h in GAUSSIAN_LLOYD_MAX_ENTROPY.items():
            p = codebook(d, b).cell_probs
            assert float(-(p * np.log2(p)).sum()) == pytest.approx(h, abs=0.01)


def test_cell_probabilities_match_the_frequency_of_codes_on_the_sphere():
    x = unit_vectors(20_000, 64, seed=3)
    comp = TurboQuant(bits=3, rotation="orthogonal")
    y = comp._plan(64, 0).rotation.forward(x)  # (n, d) rotated unit vectors: coordinates follow f_d
    g = comp._plan(64, 0).groups[0]
    freq = np.bincount(torch.bucketize(y, g.thresholds).numpy().ravel(), minlength=8) / y.numel()
    np.testing.assert_allclose(freq, codebook(64, 3).cell_probs, atol=0.003)


@pytest.mark.parametrize("kw", [
    {"bits": 2}, {"bits": 3}, {"bits": 2.5}, {"bits": 4, "norm_bits": 32},
    {"bits": 3, "variant": "prod"}, {"bits": 1, "variant": "prod"}, {"bits": 3, "rotation": "orthogonal", "seed": 4},
])
def test_entropy_coding_gives_identical_reconstructions(random_kv, kw):
    kv = random_kv(L=2, H=3, T=80, D=64)
    ctx = Context.for_kv(kv)
    plain, coded = TurboQuant(**kw), TurboQuant(**kw, entropy_coding=True)
    a = plain.decode(Bitstream.from_bytes(plain.encode(kv, ctx).data), ctx)
    bs = coded.encode(kv, ctx)
    b = TurboQuant(**kw, entropy_coding=True).decode(Bitstream.from_bytes(bs.data), ctx)  # a fresh decoder
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    assert coded.encode(kv, ctx).data == bs.data


@pytest.mark.parametrize("bits", [2, 3])
def test_entropy_coding_stores_fewer_bits_close_to_the_model_estimate(bits):
    x = unit_vectors(8000, 64, seed=bits)
    plain, coded = TurboQuant(bits=bits), TurboQuant(bits=bits, entropy_coding=True)
    _, bs_plain = roundtrip(plain, x)
    x_hat, bs = roundtrip(coded, x)
    assert bs.num_bits < bs_plain.num_bits
    for kind in ("k", "v"):
        section = f"{kind}.codes{bits}"
        assert bs.parts[section] < bs_plain.parts[section] == 8000 * 64 * bits
        model = coded.stats()[f"{section}.model_bits"]
        assert bs.parts[section] == pytest.approx(model, rel=0.02)  # the coder adds at most a few words
        # and the model is f_d's: its estimate is the codes' entropy under the cell probabilities
        p = codebook(64, bits).cell_probs
        assert model / (8000 * 64) == pytest.approx(float(-(p * np.log2(p)).sum()), rel=0.01)
    # every other section is unchanged
    assert {k: v for k, v in bs.parts.items() if "codes" not in k and k != "frame"} == \
        {k: v for k, v in bs_plain.parts.items() if "codes" not in k and k != "frame"}


def test_entropy_coding_is_off_by_default_and_must_be_a_bool():
    assert make_compressor(compose(["+compressor=turboquant"]).compressor).entropy_coding is False
    assert make_compressor(compose(["+compressor=turboquant", "compressor.entropy_coding=true"]).compressor).entropy_coding
    with pytest.raises(ValueError, match=r"turboquant\.entropy_coding='yes' must be true or false"):
        TurboQuant(entropy_coding="yes")
