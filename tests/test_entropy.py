import numpy as np
import pytest

from kvbench.coding import entropy


def _laplace(x, scale, lo, hi):
    enc = entropy.StreamEncoder()
    enc.laplace(x, scale, lo, hi)
    return enc.finish()


def _categorical(x, probs):
    enc = entropy.StreamEncoder()
    enc.categorical(x, probs)
    return enc.finish()


def test_laplace_roundtrip_and_rate_near_model_estimate():
    rng = np.random.default_rng(0)
    x = np.clip(np.round(rng.laplace(0, 4.0, 50_000)), -300, 300).astype(np.int32)
    scale = np.full(x.size, 4.0)
    raw, nbits = _laplace(x, scale, -300, 300)
    assert np.array_equal(entropy.StreamDecoder(raw).laplace(x.size, scale, -300, 300), x)
    ideal = entropy.ideal_bits_laplace(x, scale)
    assert nbits == 8 * len(raw)
    assert ideal <= nbits <= ideal * 1.01 + 64


def test_laplace_rejects_out_of_range():
    with pytest.raises(ValueError, match="outside the coder range"):
        _laplace(np.array([5, 400]), 1.0, -300, 300)


def test_categorical_per_symbol_rows_roundtrip_and_rate():
    rng = np.random.default_rng(1)
    probs = rng.dirichlet(np.full(50, 0.3), size=4000)
    x = np.array([rng.choice(50, p=p) for p in probs])
    raw, nbits = _categorical(x, probs)
    assert np.array_equal(entropy.StreamDecoder(raw).categorical(x.size, probs), x)
    ideal = entropy.ideal_bits_categorical(x, probs)
    assert ideal <= nbits <= ideal * 1.02 + 64


def test_categorical_shared_row():
    p = np.array([0.7, 0.2, 0.1])
    x = np.array([0, 0, 1, 2, 0, 0, 0, 1] * 100)
    raw, _ = _categorical(x, p)
    assert np.array_equal(entropy.StreamDecoder(raw).categorical(x.size, p), x)


def test_several_batches_share_one_stream():
    x, y = np.array([0, 1, 2, 1] * 50), np.array([3, -2, 0, 7] * 50)
    enc = entropy.StreamEncoder()
    enc.categorical(x, np.array([0.5, 0.3, 0.2]))
    enc.laplace(y, 2.0, -10, 10)
    dec = entropy.StreamDecoder(enc.finish()[0])
    assert np.array_equal(dec.categorical(x.size, np.array([0.5, 0.3, 0.2])), x)
    assert np.array_equal(dec.laplace(y.size, 2.0, -10, 10), y)
