"""The fit's own variance in a verdict: a fitted coder refitted on other calibration draws, the same test windows
scored with each fit.

A fitted coder's ΔNLL is a draw: another set of calibration windows gives another codec, and the difference between
two coders can be smaller than the difference between two fits of one. ``metrics.fit_draws=K`` (default 1: the run's
own fit alone) refits the coder on ``K - 1`` further calibration draws of ``dataset.n_calib`` windows each, codes and
scores the run's evaluated windows with each fit, and files the spread of ΔNLL (and of the recall probe's) over all
``K`` fits, the run's own first: ``delta_nll_fit_spread`` and ``delta_nll_recall_fit_spread`` as ``{min, median,
max}``, the draws' values in ``delta_nll_fit_draws`` and ``delta_nll_recall_fit_draws``. The run's headline figures
stay those of its own fit (draw 0).

Where the draws come from: the dataset's seeded window order is dealt out to the test, dev, calibration and draw
roles in turn (:mod:`kvbench.inputs.layout`); draw ``k >= 1`` takes windows ``(k - 1) n_calib .. k n_calib - 1`` of the
draw role, so the draws are disjoint from each other and from every test, calibration and dev window as long as the
longer order begins with the very windows the trace and the dev split were cut from; that is checked (a text with
fewer documents than windows cuts them differently) and a run whose text cannot give such draws stops with an error
saying so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvbench.core.codec import prepare
from kvbench.core.compressor import Compressor, fits, rebuild
from kvbench.core.items import Source, coding_contexts
from kvbench.core.kv import KVSequence
from kvbench.core.timing import Stopwatch
from kvbench.inputs.capture import cache_dtype, capture_window, dataset_windows, eval_windows
from kvbench.inputs.layout import role_windows
from kvbench.inputs.models import ModelHandle
from kvbench.measure.metrics.paired_loss import recall_loss, task_loss
from kvbench.measure.metrics.task_loss import continuation_nlls
from kvbench.store.results import NLL_KEY


def fit_draws(metrics: Any) -> int:
    """``metrics.fit_draws``: how many calibration draws a fitted coder is fitted on (1: the run's own alone)."""
    k = metrics.get("fit_draws", 1) if hasattr(metrics, "get") else 1
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64:
        raise ValueError(f"metrics.fit_draws={k!r} must be an integer in [1, 64] (1: fit once on the run's own "
                         "calibration windows)")
    return k


def calibration_draws(ds: Any, tokenizer: Any, draws: int) -> list[torch.Tensor]:
    """Token windows ``(n_calib, seq_len + eval_len + 1)`` of draws ``1 .. draws - 1`` (draw 0 is the trace's own),
    each disjoint from the others and from the test, calibration and dev windows of ``ds``."""
    return _draws(ds, tokenizer, draws)[1]


def _draws(ds: Any, tokenizer: Any, draws: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The dataset's window order as far as the draws reach, and the draws' windows."""
    c = int(ds.n_calib)
    every = window_order(ds, tokenizer, (draws - 1) * c)
    return every, [every[role_windows("draws", c, (k - 1) * c)] for k in range(1, draws)]


def window_order(ds: Any, tokenizer: Any, calib_windows: int) -> torch.Tensor:
    """The dataset's seeded window order as far as ``calib_windows`` windows of the draw role reach, checked to begin
    with the very windows the test and dev splits are cut from."""
    if int(ds.n_calib) < 1:
        raise ValueError("metrics.fit_draws > 1 refits on further draws of dataset.n_calib windows; n_calib is 0")
    every = dataset_windows(ds, tokenizer, calib_windows)[0]
    captured = dataset_windows(ds, tokenizer)[0]
    if not torch.equal(every[: len(captured)], captured):
        raise ValueError(f"metrics.fit_draws: this text cuts its windows differently when {len(every)} are drawn, so "
                         f"further calibration draws could overlap the test and dev splits' windows; use a text with "
                         f"at least {len(every)} documents, or fewer draws or windows")
    return every


def spread(values: list[float]) -> dict[str, float]:
    """``{min, median, max}`` of the finite values (NaN each where none is)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return {"min": math.nan, "median": math.nan, "max": math.nan}
    return {"min": float(min(finite)), "median": float(np.median(finite)), "max": float(max(finite))}


def draw_spread(cfg: Any, compressor: Compressor, handle: ModelHandle, source: Source, summary: dict,
                recall_base: list[np.ndarray], recall_of: list[int], code: Callable, recall_probe: Callable) -> dict:
    """The summary fields of ``metrics.fit_draws`` (none where it is 1 or the coder fits nothing).

    ``summary`` is the run's own (draw 0): its ΔNLLs and per-token base NLLs; ``recall_base`` the recall probe's base
    NLLs and ``recall_of`` the scored item each probe belongs to, as the run scored them; ``code`` and
    ``recall_probe`` the run's own coding and probe (:mod:`kvbench.measure.run`), so that every draw is coded and
    probed as the run's own fit was.
    """
    draws = fit_draws(cfg.metrics)
    if draws == 1 or not fits(compressor):
        return {}
    ds = cfg.dataset
    scored = [it for it in source.items if it.continuation is not None]
    if len(scored) != len(source.items) or any(it.kv.tokens is None for it in scored):
        raise ValueError("metrics.fit_draws > 1 refits on further dataset windows and scores the run's windows with "
                         "each fit; this run's items are not scored dataset windows (metrics.nll=false, or a "
                         "workload's sessions)")
    every, draw_windows = _draws(ds, handle.tokenizer, draws)
    _check_trace(cfg, handle, source, every)
    config = handle.config if compressor.needs_config else None
    model_ref = handle if compressor.needs_model else None
    dtype, pre_rope, T = cache_dtype(cfg.dtype), bool(cfg.capture.pre_rope), int(ds.seq_len)
    span, start = int(cfg.metrics.get("recall_tokens", 0) or 0), float(cfg.metrics.get("recall_from", 0.1))
    probes = {i: recall_probe(scored[i].kv.tokens[: scored[i].score_from], start, span) for i in recall_of}
    base = summary[NLL_KEY][0]  # (base, compressed, recall arrays): the 16-bit NLLs, shared by every draw
    kvs = [it.kv for it in scored]
    docs = source.fields.get("eval_documents")
    nan2 = [math.nan, math.nan]
    delta, recall = [summary["delta_nll"]], [summary.get("delta_nll_recall", math.nan)]
    # each draw's interval and verdict as the run's own (same documents, blocks, resamples and seed), so a verdict
    # can be said to hold for every draw or to depend on the draw
    ci, verdict = [summary.get("delta_nll_ci", nan2)], [summary.get("delta_nll_verdict_1pct", "unresolved")]
    recall_ci = [summary.get("delta_nll_recall_ci", nan2)]
    for windows in draw_windows:
        calib = []
        for ids in windows:
            got = capture_window(handle.model, ids, T, dtype, pre_rope)
            calib.append(KVSequence(got["k"], got["v"], ids[:T], got.get("k_pre_rope")))
        codec = prepare(rebuild(compressor), lambda calib=calib: calib, cfg.device, None, config)
        outs, _, _ = code(codec, kvs, *coding_contexts(scored, model_ref, config), Stopwatch(cfg.device),
                          Stopwatch(cfg.device))
        prefixes = [kv_hat.slice_tokens(0, it.score_from) for it, kv_hat in zip(scored, outs)]
        comp = [continuation_nlls(handle.model, p, it.continuation) for it, p in zip(scored, prefixes)]
        rec = [continuation_nlls(handle.model, prefixes[i], probes[i]) for i in recall_of]
        got = task_loss(base, comp, cfg.metrics, docs)
        delta.append(got["delta_nll"])
        ci.append(got["delta_nll_ci"])
        verdict.append(got["delta_nll_verdict_1pct"])
        probe = recall_loss(recall_base, rec, cfg.metrics, docs, recall_of)
        recall.append(probe["delta_nll_recall"])
        recall_ci.append(probe["delta_nll_recall_ci"])
    every_draw = verdict[0] if len(set(verdict)) == 1 else "depends on the draw"
    return {"fit_draws": draws, "delta_nll_fit_draws": delta, "delta_nll_fit_spread": spread(delta),
            "delta_nll_ci_fit_draws": ci, "delta_nll_verdict_fit_draws": verdict,
            "delta_nll_verdict_every_draw": every_draw,
            "delta_nll_recall_fit_draws": recall, "delta_nll_recall_fit_spread": spread(recall),
            "delta_nll_recall_ci_fit_draws": recall_ci}


def _check_trace(cfg: Any, handle: ModelHandle, source: Source, every: torch.Tensor) -> None:
    """The run's evaluated windows must be the ones the dataset's window order ``every`` gives its split (else the
    draws' disjointness says nothing about them)."""
    ds = cfg.dataset
    order, T = eval_windows(ds), int(ds.seq_len)
    for i, it in enumerate(source.items):
        if not torch.equal(it.kv.tokens[:T].cpu(), every[order[i], :T]):
            raise ValueError(f"metrics.fit_draws > 1: evaluated window {i} of trace {source.fields.get('trace')} is not "
                             f"window {order[i]} of dataset {ds.name!r} as configured; run on the dataset's own trace")
