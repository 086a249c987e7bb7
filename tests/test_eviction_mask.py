"""Evicted entries are hidden from attention per layer and KV head, at their original positions."""

import numpy as np
import pytest
import torch
from conftest import tiny_llama

from kvbench.core.kv import KVSequence
from kvbench.inputs.capture import capture_window
from kvbench.measure.metrics.distortion import DistortionAccumulator
from kvbench.measure.metrics.task_loss import build_cache, continuation_nlls


@pytest.fixture(scope="module")
def setup():
    model = tiny_llama()
    ids = torch.randint(0, 128, (97,), generator=torch.Generator().manual_seed(5))
    got = capture_window(model, ids, 80, torch.float32)
    return model, KVSequence(got["k"], got["v"], ids[:80]), ids[79:]


def test_evicting_the_same_tokens_in_every_head_equals_removing_them_at_original_positions(setup):
    model, kv, cont = setup
    drop = torch.zeros(80, dtype=torch.bool)
    drop[10:30] = True
    drop[55] = True
    kept = (~drop).expand(kv.shape[0], kv.shape[1], 80).clone()  # (L, H, T)
    masked = continuation_nlls(model, KVSequence(kv.k, kv.v, kv.tokens, kept=kept), cont)
    short = KVSequence(kv.k[:, :, ~drop], kv.v[:, :, ~drop])
    with torch.no_grad():
        out = model(cont[:-1].unsqueeze(0), cache=build_cache(model, short), use_cache=True,
                    position_ids=torch.arange(80, 80 + len(cont) - 1).unsqueeze(0))
    ref = torch.nn.functional.cross_entropy(out.logits[0].float(), cont[1:], reduction="none").double().numpy()
    np.testing.assert_allclose(masked, ref, rtol=1e-5, atol=1e-5)
    assert not np.allclose(masked, continuation_nlls(model, kv, cont), atol=1e-4)


def test_masks_are_per_kv_head(setup):
    model, kv, cont = setup
    kept = torch.ones(kv.shape[:3], dtype=torch.bool)
    kept[:, 0, 5:60] = False  # only KV head 0 (query heads 0 and 1) drops these
    one_head = continuation_nlls(model, KVSequence(kv.k, kv.v, kept=kept), cont)
    kept[:, 1, 5:60] = False
    both = continuation_nlls(model, KVSequence(kv.k, kv.v, kept=kept), cont)
    full = continuation_nlls(model, kv, cont)
    assert not np.allclose(one_head, full, atol=1e-4) and not np.allclose(one_head, both, atol=1e-4)
    # the hooks are gone afterwards: the model is unchanged
    np.testing.assert_array_equal(continuation_nlls(model, kv, cont), full)


def test_distortion_counts_kept_entries_and_the_dropped_share():
    x = torch.randn(2, 2, 10, 4)
    x_hat = x.clone()
    x_hat[:, :, :5] = 0  # "evicted": stored as zeros
    kept = torch.ones(2, 2, 10, dtype=torch.bool)
    kept[:, :, :5] = False
    d = DistortionAccumulator()
    d.add("k", x, x_hat, kept)
    assert d.rel_mse("k") == 0.0 and d.dropped_fraction("k") == pytest.approx(0.5) and d.cosine("k") == pytest.approx(1.0)


def test_a_malformed_kept_mask_is_refused():
    with pytest.raises(ValueError, match="bool mask of shape"):
        KVSequence(torch.zeros(2, 2, 4, 8), torch.zeros(2, 2, 4, 8), kept=torch.ones(2, 2, 5, dtype=torch.bool))


def test_a_model_mask_that_cannot_be_lined_up_with_the_kept_entries_is_refused():
    from types import SimpleNamespace

    from kvbench.cache.eviction_mask import _mask_hook

    module = SimpleNamespace(layer_idx=3, num_key_value_groups=2)
    kept = torch.ones(2, 5, dtype=torch.bool)
    kept[0, 1] = False
    hook = _mask_hook(lambda layer, cache: kept)
    hidden = torch.zeros(1, 3, 8)
    with pytest.raises(ValueError, match=r"layer 3: the model's attention mask covers 7 keys .* kept mask 8 keys \(5 held \+ 3 new\)"):
        hook(module, (), {"hidden_states": hidden, "attention_mask": torch.zeros(1, 1, 3, 7)})
    with pytest.raises(ValueError, match="is a dict"):
        hook(module, (), {"hidden_states": hidden, "attention_mask": {"full": None}})
    # a mask of the right size still applies: the model's own exclusions and the evicted entry both
    own = torch.zeros(1, 1, 3, 8)
    own[..., 0] = torch.finfo(torch.float32).min
    _, kwargs = hook(module, (), {"hidden_states": hidden, "attention_mask": own})
    visible = kwargs["attention_mask"][0] == 0  # (Hq, q, S)
    assert not visible[:, :, 0].any() and not visible[:2, :, 1].any() and visible[2:, :, 1].all()
