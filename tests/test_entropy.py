import numpy as np
import pytest

from kvbench import entropy


def test_laplace_roundtrip_and_rate_near_model_estimate():
    rng = np.random.default_rng(0)
    x = np.clip(np.round(rng.laplace(0, 4.0, 50_000)), -300, 300).astype(np.int32)
    scale = np.full(x.size, 4.0)
    raw, nbits = entropy.encode_laplace(x, scale, -300, 300)
    assert np.array_equal(entropy.decode_laplace(raw, x.size, scale, -300, 300), x)
    ideal = entropy.ideal_bits_laplace(x, scale)
    assert nbits == 8 * len(raw)
    assert ideal <= nbits <= ideal * 1.01 + 64


def test_laplace_rejects_out_of_range():
    with pytest.raises(ValueError, match="outside the coder range"):
        entropy.encode_laplace(np.array([5, 400]), 1.0, -300, 300)


def test_categorical_per_symbol_rows_roundtrip_and_rate():
    rng = np.random.default_rng(1)
    probs = rng.dirichlet(np.full(50, 0.3), size=4000)
    x = np.array([rng.choice(50, p=p) for p in probs])
    raw, nbits = entropy.encode_categorical(x, probs)
    assert np.array_equal(entropy.decode_categorical(raw, x.size, probs), x)
    ideal = entropy.ideal_bits_categorical(x, probs)
    assert ideal <= nbits <= ideal * 1.02 + 64


def test_categorical_shared_row():
    p = np.array([0.7, 0.2, 0.1])
    x = np.array([0, 0, 1, 2, 0, 0, 0, 1] * 100)
    raw, _ = entropy.encode_categorical(x, p)
    assert np.array_equal(entropy.decode_categorical(raw, x.size, p), x)
