"""The attention error the model's own queries see (kvbench/measure/metrics/attention_error.py): zero on the exact
cache, equal to a brute-force computation from queries read another way, blind to key error no query looks at,
evicted entries out of the decoded softmax, and in every run's summary and rows."""

import math
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from conftest import tiny_arch, tiny_llama

from kvbench.core.kv import KVSequence
from kvbench.inputs.capture import capture_window
from kvbench.measure import run as runner
from kvbench.measure.metrics.attention_error import AttentionError, ScoredQueries, continuation_queries, scored_picks
from kvbench.measure.metrics.distortion import DistortionAccumulator

T, E = 24, 9  # prefix tokens; scored positions (the continuation holds E + 1 ids)


def _tiny_gemma3():
    return tiny_arch("gemma3", num_hidden_layers=3, head_dim=32,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def _tiny_gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
                       query_pre_attn_scalar=20, attn_logit_softcapping=0.3)
    return Gemma2ForCausalLM(cfg).eval()


def _window(model, seed: int) -> tuple[KVSequence, torch.Tensor]:
    """The exact float32 prefix cache of ``T`` random ids and a continuation of ``E + 1`` more."""
    ids = torch.randint(0, 128, (T + E + 1,), generator=torch.Generator().manual_seed(seed))
    got = capture_window(model, ids, T, torch.float32)
    return KVSequence(got["k"], got["v"], ids[:T]), ids[T:]


def _decoded(kv: KVSequence, seed: int, noise: float = 0.5, evict: float = 0.25, garbage: float = 0.0) -> KVSequence:
    """``kv`` with noise on K (a tenth of it on V, so that the output error is mostly the softmax's) and a share
    ``evict`` of its entries dropped (``garbage`` left in them)."""
    g = torch.Generator().manual_seed(seed)
    k = kv.k + noise * kv.k.std() * torch.randn(kv.k.shape, generator=g)
    v = kv.v + noise / 10 * kv.v.std() * torch.randn(kv.v.shape, generator=g)
    kept = torch.rand(kv.k.shape[:3], generator=g) >= evict  # (L, H, T)
    k, v = k.masked_fill(~kept.unsqueeze(-1), garbage), v.masked_fill(~kept.unsqueeze(-1), garbage)
    return KVSequence(k, v, kv.tokens, kept=kept)


def test_scored_positions_are_evenly_spaced_and_all_when_few():
    assert scored_picks(9, 5).tolist() == [0, 2, 4, 6, 8]
    assert scored_picks(4, 128).tolist() == [0, 1, 2, 3]
    assert scored_picks(9, 0).numel() == 0


def test_the_exact_cache_has_no_attention_error():
    model = tiny_llama()
    acc = AttentionError()
    for seed in (1, 2):
        kv, cont = _window(model, seed)
        acc.add(continuation_queries(model, kv, cont, 5), kv, KVSequence(kv.k.clone(), kv.v.clone(), kv.tokens))
    s = acc.summary()
    assert s["attn_logit_rel_mse"] == 0.0 and s["attn_output_rel_err"] == 0.0 and s["attn_queries"] == 5
    assert (acc.sums[1] > 0).all() and (acc.sums[3] > 0).all()  # something was measured in every layer and head


def _queries_read_another_way(model, kv: KVSequence, cont: torch.Tensor) -> list[torch.Tensor]:
    """Per layer ``(Hq, E, D)``: post-RoPE queries of the scored positions from one forward pass over prefix and
    continuation (no cache), read off ``q_norm`` (or ``q_proj``) and rotated with the model's own cos/sin."""
    import importlib

    rope = importlib.import_module(type(model).__module__).apply_rotary_pos_emb
    layers = model.model.layers
    D = layers[0].self_attn.head_dim
    raw, angles = {}, {}
    hooks = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        tapped = attn.q_norm if getattr(attn, "q_norm", None) is not None else attn.q_proj
        hooks.append(tapped.register_forward_hook(lambda m, a, out, i=i: raw.__setitem__(i, out)))
        hooks.append(attn.register_forward_pre_hook(
            lambda m, a, kw, i=i: angles.__setitem__(i, kw["position_embeddings"]), with_kwargs=True))
    with torch.no_grad():
        model(torch.cat([kv.tokens, cont[:-1]]).unsqueeze(0))
    for h in hooks:
        h.remove()
    out = []
    for i in range(len(layers)):
        q = raw[i] if raw[i].dim() == 4 else raw[i].view(1, raw[i].shape[1], -1, D).transpose(1, 2)  # (1, Hq, S, D)
        cos, sin = angles[i]
        out.append(rope(q, q, cos, sin)[0][0, :, T:])  # (Hq, E, D)
    return out


def _attend(q, keys, values, ts: list[int], s: float, cap: float | None) -> torch.Tensor:
    """One query's attention output over the keys ``ts``: softmax of the scaled (and capped) logits, times values."""
    if not ts:
        return torch.zeros(values.shape[1], dtype=torch.float64)
    x = torch.stack([q @ keys[t] * s for t in ts])
    x = torch.tanh(x / cap) * cap if cap else x
    return torch.softmax(x, 0) @ torch.stack([values[t] for t in ts])


def _logits(q, keys, ts: list[int], s: float, cap: float | None) -> torch.Tensor:
    x = torch.stack([q @ keys[t] * s for t in ts])
    return torch.tanh(x / cap) * cap if cap else x


def _brute_force(model, windows) -> tuple[list[float], ...]:
    """Per-layer logit relative MSE, output relative error, logit MSE in softmax units and KL (NaN where a seen key
    was evicted) by explicit loops over layers, heads, queries and keys, pooled over ``windows``
    (``[(kv, cont, kv_hat)]``), at the scored positions 0, 2, 4, 6, 8."""
    cfg = model.config
    L, Hq, Hkv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    scale = getattr(cfg, "query_pre_attn_scalar", None) or model.model.layers[0].self_attn.head_dim
    s, cap = scale**-0.5, getattr(cfg, "attn_logit_softcapping", None)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * L
    sums = torch.zeros(L, 8, dtype=torch.float64)
    for kv, cont, kv_hat in windows:
        Q = _queries_read_another_way(model, kv, cont)
        for layer in range(L):
            window = cfg.sliding_window if types[layer] == "sliding_attention" else None
            for j in range(Hq):
                h = j // (Hq // Hkv)
                K, V = kv.k[layer, h].double(), kv.v[layer, h].double()
                Kh, Vh, kept = kv_hat.k[layer, h].double(), kv_hat.v[layer, h].double(), kv_hat.kept[layer, h]
                for p in (0, 2, 4, 6, 8):
                    q = Q[layer][j, p].double()
                    seen = [t for t in range(T) if window is None or (T + p) - t < window]
                    if not seen:
                        continue
                    for t in seen:
                        if kept[t]:
                            sums[layer, 0] += float(q @ (Kh[t] - K[t])) ** 2
                            sums[layer, 1] += float(q @ K[t]) ** 2
                    o, o_hat = _attend(q, K, V, seen, s, cap), _attend(q, Kh, Vh, [t for t in seen if kept[t]], s, cap)
                    sums[layer, 2] += float((o_hat - o).square().sum())
                    sums[layer, 3] += float(o.square().sum())
                    kept_seen = [t for t in seen if kept[t]]
                    if kept_seen:
                        sums[layer, 4] += float((_logits(q, Kh, kept_seen, s, cap)
                                                 - _logits(q, K, kept_seen, s, cap)).square().sum())
                        sums[layer, 5] += len(kept_seen)
                    if len(kept_seen) < len(seen):
                        sums[layer, 6] = math.nan
                    else:
                        lp = torch.log_softmax(_logits(q, K, seen, s, cap), 0)
                        lp_hat = torch.log_softmax(_logits(q, Kh, seen, s, cap), 0)
                        sums[layer, 6] += float((lp.exp() * (lp - lp_hat)).sum())
                    sums[layer, 7] += 1
    return ((sums[:, 0] / sums[:, 1]).tolist(), (sums[:, 2] / sums[:, 3]).sqrt().tolist(),
            (sums[:, 4] / sums[:, 5]).tolist(), (sums[:, 6] / sums[:, 7]).tolist())


@pytest.mark.parametrize(("make", "gain", "evict"), [(tiny_llama, 8, 0.25), (_tiny_gemma3, 1, 0.25),
                                                     (_tiny_gemma2, 40, 0.25), (tiny_llama, 8, 0.0)],
                         ids=["llama-gqa", "gemma3-sliding-qknorm-scale", "gemma2-softcap", "llama-nothing-evicted"])
def test_the_metrics_equal_a_brute_force_computation(make, gain, evict):
    model = make()
    model.set_attn_implementation("eager")
    with torch.no_grad():  # larger queries: attention as peaked as a trained model's, so scale and soft-capping matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight *= gain
    windows = []
    for seed in (3, 4):
        kv, cont = _window(model, seed)
        windows.append((kv, cont, _decoded(kv, seed, evict=evict)))
    acc = AttentionError()
    for kv, cont, kv_hat in windows:
        qs = continuation_queries(model, kv, cont, 5)
        assert qs.positions.tolist() == [T, T + 2, T + 4, T + 6, T + 8]
        acc.add(qs, kv, kv_hat)
    got, want = acc.per_layer(), _brute_force(model, windows)
    for name, g, w in zip(("logit rel MSE", "output rel err", "logit MSE", "KL"), got, want):
        assert g.tolist() == pytest.approx(w, rel=2e-3, nan_ok=True), name
    s = acc.summary()
    assert s["attn_logit_rel_mse"] == pytest.approx(sum(want[0]) / len(want[0]), rel=2e-3)
    assert s["attn_output_rel_err"] == pytest.approx(sum(want[1]) / len(want[1]), rel=2e-3)
    assert s["attn_logit_mse"] == pytest.approx(sum(want[2]) / len(want[2]), rel=2e-3)
    if evict:
        assert math.isnan(s["attn_kl"])  # an evicted key some query sees: no finite divergence
    else:
        assert s["attn_kl"] == pytest.approx(sum(want[3]) / len(want[3]), rel=2e-3) and s["attn_kl"] > 0


def test_key_error_orthogonal_to_every_query_is_no_logit_error_although_its_relative_mse_is_not_zero():
    model = tiny_llama()  # 4 query heads on 2 KV heads, head_dim 16: 2 heads x 4 queries span 8 of 16 directions
    kv, cont = _window(model, 5)
    qs = continuation_queries(model, kv, cont, 4)
    L, H, _, D = kv.shape
    g = torch.Generator().manual_seed(0)
    blind, seen = kv.k.clone(), kv.k.clone()
    for layer in range(L):
        for h in range(H):
            rows = qs.q[layer, 2 * h : 2 * h + 2].float().reshape(-1, D)  # (8, D) the queries of this KV head
            basis = torch.linalg.qr(rows.T).Q  # (D, 8)
            z = torch.randn(T, D, generator=g) * kv.k[layer, h].std()  # (T, D)
            across = z - z @ basis @ basis.T  # orthogonal to every query
            along = z @ basis @ basis.T
            blind[layer, h] += across
            seen[layer, h] += along * across.norm() / along.norm()  # the same energy, in the queries' span
    dist, orthogonal, aligned = DistortionAccumulator(), AttentionError(), AttentionError()
    dist.add("k", kv.k, blind)
    orthogonal.add(qs, kv, KVSequence(blind, kv.v, kv.tokens))
    aligned.add(qs, kv, KVSequence(seen, kv.v, kv.tokens))
    assert dist.rel_mse("k") > 0.3
    assert orthogonal.summary()["attn_logit_rel_mse"] < 1e-10
    assert orthogonal.summary()["attn_output_rel_err"] < 1e-5
    assert aligned.summary()["attn_logit_rel_mse"] > 0.1 and aligned.summary()["attn_output_rel_err"] > 1e-3


def test_evicted_entries_are_left_out_of_the_decoded_softmax():
    model = tiny_llama()
    kv, cont = _window(model, 6)
    qs = continuation_queries(model, kv, cont, 5)
    figures = []
    for garbage in (0.0, 1e3):  # whatever a decoder leaves in an evicted entry
        acc = AttentionError()
        acc.add(qs, kv, _decoded(kv, 0, noise=0.0, evict=0.3, garbage=garbage))
        figures.append(acc.summary())
    assert figures[0] == figures[1]
    assert figures[0]["attn_logit_rel_mse"] == 0.0  # every kept key is exact: the logits it has are right
    assert figures[0]["attn_output_rel_err"] > 0.01  # but the softmax lost mass to the dropped ones
    # one query head and query by hand: the kept keys' softmax, renormalised, against the full one
    one = AttentionError()
    single = ScoredQueries(qs.q[:, :1, :1], qs.positions[:1], qs.scaling, qs.sliding, qs.softcap)
    mask = torch.ones(kv.shape[:3], dtype=torch.bool)
    mask[:, 0, ::2] = False  # every other token of KV head 0 evicted
    one.add(single, KVSequence(kv.k[:, :1], kv.v[:, :1], kv.tokens),
            KVSequence(kv.k[:, :1], kv.v[:, :1], kv.tokens, kept=mask[:, :1]))
    q = single.q[0, 0, 0].float()
    p = torch.softmax(kv.k[0, 0] @ q * qs.scaling[0], 0)  # (T,)
    o, o_kept = p @ kv.v[0, 0], torch.softmax(kv.k[0, 0, 1::2] @ q * qs.scaling[0], 0) @ kv.v[0, 0, 1::2]
    assert float(one.per_layer()[1][0]) == pytest.approx(float((o_kept - o).norm() / o.norm()), rel=1e-4)


def test_a_run_reports_both_figures_in_its_summary_and_rows(tiny_cfg, tiny_handle):
    from omegaconf import OmegaConf

    from kvbench.core.config import make_compressor
    from kvbench.store.results import reuse_or_measure

    cfg = tiny_cfg("+compressor=kivi", "compressor.bits=2", "compressor.residual=0", "compressor.group_size=16")
    comp = make_compressor(cfg.compressor)
    summary, rows = runner.measure(cfg, comp, tiny_handle)
    assert summary["attn_queries"] == 16  # the whole 16-token continuation: fewer than the default 128
    assert 0 < summary["attn_logit_rel_mse"] < 1 and 0 < summary["attn_output_rel_err"] < 1
    assert "attn logit / output err" in runner.format_summary(summary)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    run_dir = reuse_or_measure("run", cfg_dict, comp.name, comp.describe(), lambda: (summary, rows), resume=False).path
    df = pd.read_parquet(run_dir / "rows.parquet")
    per_layer = df.groupby("layer")[["attn_logit_rel_mse", "attn_output_rel_err"]].agg(["min", "max"])
    assert len(df) == 4 and (per_layer.xs("min", axis=1, level=1) == per_layer.xs("max", axis=1, level=1)).all().all()
    assert df["attn_logit_rel_mse"].groupby(df["layer"]).first().mean() == pytest.approx(summary["attn_logit_rel_mse"])
    exact, _ = runner.measure(tiny_cfg("+compressor=identity", "metrics.attn_queries=4"),
                              make_compressor(tiny_cfg("+compressor=identity").compressor), tiny_handle)
    assert exact["attn_logit_rel_mse"] == 0.0 and exact["attn_output_rel_err"] == 0.0 and exact["attn_queries"] == 4


def test_without_queries_both_figures_are_nan_and_the_run_still_works(tiny_cfg, tiny_handle):
    from kvbench.core.config import make_compressor

    cfg = tiny_cfg("+compressor=kivi", "compressor.residual=0", "metrics.attn_queries=0")
    summary, rows = runner.measure(cfg, make_compressor(cfg.compressor), tiny_handle)
    assert math.isnan(summary["attn_logit_rel_mse"]) and math.isnan(summary["attn_output_rel_err"])
    assert summary["attn_queries"] == 0 and all(math.isnan(r["attn_output_rel_err"]) for r in rows)
    assert summary["delta_nll"] == summary["delta_nll"]  # the rest of the run is measured


def test_a_windows_queries_are_computed_once_per_process_and_the_store_is_bounded(monkeypatch):
    made = []

    def fake(model, kv, cont, n):
        made.append(n)
        return ScoredQueries(torch.zeros(1, 1, n, 250, dtype=torch.float16), torch.arange(n), [1.0], [None], [None])

    monkeypatch.setattr(runner, "_BASE_QUERIES", {})
    monkeypatch.setattr(runner, "continuation_queries", fake)
    monkeypatch.setattr(runner, "QUERY_CACHE_BYTES", 2 * 2 * 250 * 4)  # two windows of 4 queries
    it = SimpleNamespace(kv=SimpleNamespace(slice_tokens=lambda a, b: None), score_from=8, continuation=torch.zeros(5))
    h = SimpleNamespace(cfg={"name": "smollm2_135m", "path": None}, device="cpu", model="model")
    for _ in range(3):
        runner._base_queries(h, "/traces/a", 0, it, 4)
    assert made == [4]
    runner._base_queries(h, "/traces/a", 0, it, 2)  # another count: other queries
    runner._base_queries(h, "/traces/a", 1, it, 4)
    assert len(made) == 3 and len(runner._BASE_QUERIES) == 2  # the oldest went when a third would not fit
    runner._base_queries(h, "/traces/a", 0, it, 4)
    assert len(made) == 4
