"""Task accuracy with a compressed cache, paired against the 16-bit baseline on identical examples.

:func:`evaluate` runs in named steps: :func:`build_lm` (fit the compressor, wrap the model), :func:`run_passes` (the
compressed pass through lm-eval, then the baseline's answers replayed through it), :func:`pair_task` (per task, the
paired scores and their statistics) and :func:`summarise`. The protocol (``protocol=context_only``, the default, or
``query_aware``) decides what is compressed: see :mod:`kvbench.measure.evaluation.lm`.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from kvbench.core.codec import prepare
from kvbench.core.compressor import Compressor
from kvbench.core.machine import conditions
from kvbench.inputs.capture import cache_dtype, calib_windows
from kvbench.inputs.models import ModelHandle, model_fields, model_identity
from kvbench.measure.evaluation import ruler
from kvbench.measure.evaluation.chance import chance_scores
from kvbench.measure.evaluation.lm import CompressedKVLM
from kvbench.measure.evaluation.prefill_store import PrefillStore
from kvbench.measure.evaluation.stats import paired_scores
from kvbench.measure.evaluation.tasks import task_specs
from kvbench.store.results import git_sha

# the per-example metric each task is judged by, and the lm-eval filter it comes out of
PRIMARY = {"generate_until": ("exact_match", "first_number"), "multiple_choice": ("acc", "none"), "loglikelihood": ("acc", "none")}
# RULER tasks score generations with their own string match (a fraction of the expected values found)
PRIMARY_RULER = (ruler.METRIC, "none")
#: a task whose 16-bit accuracy is below chance + this margin is flagged and left out of the pooled verdict
NEAR_CHANCE_MARGIN = 0.1


def primary(spec: dict) -> tuple[str, str]:
    """The ``(metric, filter)`` a task's per-example scores are read from."""
    return PRIMARY_RULER if spec["task"].startswith(ruler.PREFIX) else PRIMARY[spec["output_type"]]


def protocol_of(cfg: Any) -> str:
    """``cfg.protocol``; configs written before it existed ran ``context_only``'s default."""
    got = OmegaConf.select(cfg, "protocol", default=None) if OmegaConf.is_config(cfg) else getattr(cfg, "protocol", None)
    return str(got or "context_only")


def _quiet_lm_eval() -> None:
    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.WARNING)


def build_lm(cfg: Any, compressor: Compressor, handle: ModelHandle, progress: bool = True) -> tuple[CompressedKVLM, float]:
    """The compressor fitted on the run trace's calibration windows (if it fits) and the lm-eval model that runs
    it; returns ``(lm, fit seconds)``."""
    torch.manual_seed(int(cfg.seed))
    config = handle.model.config if compressor.needs_config else None
    fit_s = prepare(compressor, lambda: calib_windows(cfg, handle), cfg.device, config=config).fit_s
    lm = CompressedKVLM(handle, compressor, protocol=protocol_of(cfg), residual=cfg.cache.residual,
                        chunk=int(cfg.cache.chunk), mode=str(cfg.cache.mode), dtype=cache_dtype(cfg.dtype), progress=progress,
                        store=prefill_store(cfg, handle))
    return lm, fit_s


def prefill_store(cfg: Any, handle: ModelHandle) -> PrefillStore | None:
    """``paths.prefills``: ``auto`` keeps each example's 16-bit prefill and baseline answer under
    ``KVBENCH_HOME/prefills``, a folder keeps them there, null keeps none (every cell prefills every context)."""
    where = OmegaConf.select(cfg, "paths.prefills", default=None) if OmegaConf.is_config(cfg) else None
    if where is None or str(where).lower() in ("null", "none", "false"):
        return None
    model = model_identity(handle)
    if model is None:  # a model built in this process: nothing to key its prefills by
        return None
    root = None if str(where) == "auto" else Path(str(where)).expanduser()
    return PrefillStore.for_model(model, cache_dtype(cfg.dtype), str(cfg.device), root)


@dataclass
class Passes:
    """lm-eval's results of the compressed pass and of the baseline's replayed answers, on the same requests."""

    comp: dict
    base: dict
    eval_s: float  # the compressed pass's wall time, baseline scoring included (prefills are shared)


def run_passes(lm: CompressedKVLM, specs: list[dict], cfg: Any) -> Passes:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    _quiet_lm_eval()
    seed = int(cfg.seed)
    common = {"tasks": specs, "limit": None if cfg.limit is None else int(cfg.limit), "log_samples": True,
              "bootstrap_iters": int(cfg.bootstrap_iters), "random_seed": seed, "numpy_random_seed": seed,
              "torch_random_seed": seed, "fewshot_random_seed": seed}
    t0 = time.perf_counter()
    comp = simple_evaluate(model=lm, task_manager=TaskManager(include_defaults=False), **common)
    eval_s = time.perf_counter() - t0
    base = simple_evaluate(model=lm.replay(), task_manager=TaskManager(include_defaults=False), **common)
    return Passes(comp, base, eval_s)


def chance(spec: dict, docs: list[dict], b_samples: list[dict]) -> tuple[float, dict[str, float]]:
    """``(chance, score of each content-free answerer)`` on these examples: a multiple-choice answer is right one
    time in its number of choices; RULER: the better answerer of :mod:`~kvbench.measure.evaluation.chance`; a random
    five-digit passkey matches one time in 90,000; a last word is never scored right without the model."""
    if not docs:
        return 0.0, {}
    if spec["output_type"] == "multiple_choice":
        return float(np.mean([1 / max(len(s["resps"]), 1) for s in b_samples])), {}
    if spec["task"].startswith(ruler.PREFIX):
        scores = chance_scores(docs)
        return max(scores.values(), default=0.0), scores
    if spec["task"].startswith("passkey"):
        return 1 / 90000, {"random_value": 1 / 90000}
    return 0.0, {}


def pair_task(spec: dict, passes: Passes, lm: CompressedKVLM) -> tuple[dict, list[dict]]:
    """One task's paired statistics and its rows (one per example), read from both passes' logged samples."""
    name = spec["task"]
    metric, filt = primary(spec)
    b_samples = {s["doc_id"]: s for s in passes.base["samples"][name] if s["filter"] == filt}
    c_samples = {s["doc_id"]: s for s in passes.comp["samples"][name] if s["filter"] == filt}
    ids = sorted(b_samples)
    if sorted(c_samples) != ids:
        raise RuntimeError(f"task {name}: the baseline and compressed passes saw different examples")
    b = np.array([float(b_samples[i][metric]) for i in ids])
    c = np.array([float(c_samples[i][metric]) for i in ids])
    key = f"{metric},{filt}"
    shapes = [lm.shapes.get((name, i), (math.nan, math.nan)) for i in ids]
    floor, answerers = chance(spec, [b_samples[i]["doc"] for i in ids], [b_samples[i] for i in ids])
    stats = {
        "metric": metric,
        **paired_scores(b, c),
        "chance": floor,
        "chance_answerers": answerers,
        "near_chance": bool(ids) and float(b.mean()) < floor + NEAR_CHANCE_MARGIN,
        # raw responses (log-likelihoods, generated text) equal to the baseline's, not only the metric
        "identical_responses": int(sum(b_samples[i]["filtered_resps"] == c_samples[i]["filtered_resps"] for i in ids)),
        # tokens compressed, and fed on top 16-bit (the question and answer prefix under context_only)
        "context_tokens_mean": float(np.mean([s[0] for s in shapes])) if ids else math.nan,
        "query_tokens_mean": float(np.mean([s[1] for s in shapes])) if ids else math.nan,
        "lm_eval_base": {key: passes.base["results"][name].get(key), "stderr": passes.base["results"][name].get(f"{metric}_stderr,{filt}")},
        "lm_eval_comp": {key: passes.comp["results"][name].get(key), "stderr": passes.comp["results"][name].get(f"{metric}_stderr,{filt}")},
        # per example, so that two cells on the same examples can be paired with each other (a coder against the
        # reference cache: kvbench.measure.metrics.reference_diff)
        "doc_ids": [int(i) for i in ids],
        "scores_base": b.tolist(),
        "scores_comp": c.tolist(),
    }
    rows = []
    for i, bi, ci, (n_ctx, n_q) in zip(ids, b, c, shapes):
        doc = b_samples[i]["doc"]
        rows.append({"task": name, "doc_id": int(i), "metric": metric, "base": float(bi), "comp": float(ci),
                     "length": doc.get("length"), "depth": doc.get("depth"), "context_tokens": n_ctx, "query_tokens": n_q,
                     "resp_base": str(b_samples[i]["filtered_resps"]), "resp_comp": str(c_samples[i]["filtered_resps"])})
    return stats, rows


def pooled(per_task: dict, rows: list[dict]) -> dict:
    """The pooled comparisons, stratified by task: over every example, and over the tasks whose 16-bit accuracy is
    clear of chance (a task the model cannot do cannot lose)."""
    def pool(rs: list[dict]) -> dict:
        return paired_scores(*(np.array([r[k] for r in rs]) for k in ("base", "comp")), task=[r["task"] for r in rs])

    return {"overall": pool(rows), "near_chance_tasks": sorted(t for t, v in per_task.items() if v["near_chance"]),
            "overall_informative": pool([r for r in rows if not per_task[r["task"]]["near_chance"]])}


def summarise(cfg: Any, compressor: Compressor, lm: CompressedKVLM, per_task: dict, rows: list[dict], fit_s: float,
              eval_s: float) -> dict:
    acc = lm.accounting
    elements = acc["compressed_tokens"] * lm.kv_elements_per_token
    return {
        "compressor": compressor.name,
        "model": cfg.model.name,
        **model_fields(lm.handle, cfg),
        "kind": "eval",
        "protocol": lm.protocol,
        "tasks": per_task,
        **pooled(per_task, rows),
        "limit": None if cfg.limit is None else int(cfg.limit),
        "n_examples": len(rows),
        "cache": {"residual": cfg.cache.residual, "chunk": int(cfg.cache.chunk), "mode": lm.cache_kw["mode"], "dtype": cfg.dtype},
        "contexts_compressed": int(acc["contexts"]),
        "compressed_tokens": int(acc["compressed_tokens"]),
        "window_tokens": int(acc["window_tokens"]),
        # held bits of the coded prefix per KV element, counted from the stored segments (frames included)
        "bits_per_element": acc["segment_bits"] / elements if elements else math.nan,
        "compressed_fraction": acc["compressed_tokens"] / max(acc["compressed_tokens"] + acc["window_tokens"], 1),
        "encode_s": acc["encode_s"],
        "decode_s": acc["decode_s"],
        "fit_s": fit_s,
        "eval_s": eval_s,
        # eval_s covers prefilling the contexts not loaded from the store (paths.prefills) and the baseline's answers
        # not kept in this process or the store: a cell that loads them costs less per example
        "contexts_prefilled": int(acc["contexts"] - acc["stored_prefills"]),
        "contexts_from_store": int(acc["stored_prefills"]),
        "generated_tokens": int(acc["generated_tokens"]),
        "compressor_params": compressor.describe(),
        # what the report says of the compressor (its label, exact tokens, whether it is the quality reference), for
        # a context of the mean length coded here
        "compressor_facts": compressor.facts(round(acc["compressed_tokens"] / acc["contexts"]) if acc["contexts"] else 0),
        # as the cache runs it: a compressor's own `residual` window is handed to the cache (see kvbench.cache.compressed)
        "cache_compressor_params": lm.cache_compressor.describe(),
        "dtype": cfg.dtype,
        "device": cfg.device,
        "git_sha": git_sha(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def evaluate(cfg: Any, compressor: Compressor, handle: ModelHandle | None = None, progress: bool = True,
             specs: list[dict] | None = None) -> tuple[dict, list[dict]]:
    """Run every task with ``compressor`` and with the baseline; return ``(summary, rows)`` (one row per example).

    ``specs`` replaces the tasks named in ``cfg.tasks`` with ready lm-eval task configs.
    """
    measuring = conditions()  # the load before this run adds its own
    handle = handle or ModelHandle(cfg.model, cfg.device)
    lm, fit_s = build_lm(cfg, compressor, handle, progress)
    specs = specs if specs is not None else task_specs(list(cfg.tasks), cfg, handle.tokenizer)
    passes = run_passes(lm, specs, cfg)
    per_task, rows = {}, []
    for spec in specs:
        per_task[spec["task"]], task_rows = pair_task(spec, passes, lm)
        rows += task_rows
    return {**summarise(cfg, compressor, lm, per_task, rows, fit_s, passes.eval_s), **measuring}, rows


def format_eval(s: dict) -> str:
    """Per-task table for the terminal."""
    lines = [f"  {s['compressor']} vs 16-bit baseline on {s['model']}  ({s['n_examples']} examples, limit {s['limit']}/task, "
             f"{s.get('protocol', 'query_aware')}, {s['bits_per_element']:.3f} bits/element held for "
             f"{s['compressed_fraction']:.0%} of context tokens)",
             f"  {'task':<16} {'n':>4}  {'baseline':>14}  {'compressed':>14}  {'diff [95% CI]':>24}  {'p':>9}  {'detectable':>10}"]
    pooled_rows = [("all", s["overall"])]
    if s.get("near_chance_tasks"):
        pooled_rows.append(("clear of chance", s.get("overall_informative", {})))
    for name, t in [*s["tasks"].items(), *pooled_rows]:
        if not t.get("n"):
            continue
        name = f"{name} (near chance)" if t.get("near_chance") else name
        lines.append(f"  {name:<16} {t['n']:>4}  {t['acc_base']:.3f} ± {t['stderr_base']:.3f}  {t['acc_comp']:.3f} ± {t['stderr_comp']:.3f}  "
                     f"{t['diff']:+.3f} [{t['ci95_low']:+.3f}, {t['ci95_high']:+.3f}]  "
                     f"{t.get('p_value', t.get('mcnemar_p', math.nan)):>9.3g}  {t.get('detectable_diff', math.nan):>10.3f}")
    return "\n".join(lines)
