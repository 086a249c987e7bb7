"""Task accuracy with a compressed cache, paired against the 16-bit baseline on identical examples."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np
import torch

from kvbench.core.codec import prepare
from kvbench.core.compressor import Compressor
from kvbench.inputs.capture import cache_dtype, calib_windows
from kvbench.inputs.models import ModelHandle
from kvbench.measure.evaluation import ruler
from kvbench.measure.evaluation.lm import CompressedKVLM
from kvbench.measure.evaluation.stats import paired_binary
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


def _quiet_lm_eval() -> None:
    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.WARNING)


def evaluate(cfg: Any, compressor: Compressor, handle: ModelHandle | None = None, progress: bool = True,
             specs: list[dict] | None = None) -> tuple[dict, list[dict]]:
    """Run every task with ``compressor`` and with the baseline; return ``(summary, rows)`` (one row per example).

    ``specs`` replaces the tasks named in ``cfg.tasks`` with ready lm-eval task configs.
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    _quiet_lm_eval()
    handle = handle or ModelHandle(cfg.model, cfg.device)
    torch.manual_seed(int(cfg.seed))
    config = handle.model.config if compressor.needs_config else None
    fit_s = prepare(compressor, lambda: calib_windows(cfg, handle), cfg.device, config=config).fit_s
    specs = specs if specs is not None else task_specs(list(cfg.tasks), cfg, handle.tokenizer)
    lm = CompressedKVLM(handle, compressor, residual=cfg.cache.residual, chunk=int(cfg.cache.chunk), mode=str(cfg.cache.mode),
                        dtype=cache_dtype(cfg.dtype), progress=progress)
    limit = None if cfg.limit is None else int(cfg.limit)
    common = {"tasks": specs, "limit": limit, "log_samples": True, "bootstrap_iters": int(cfg.bootstrap_iters),
              "random_seed": int(cfg.seed), "numpy_random_seed": int(cfg.seed), "torch_random_seed": int(cfg.seed),
              "fewshot_random_seed": int(cfg.seed)}
    t0 = time.perf_counter()
    comp = simple_evaluate(model=lm, task_manager=TaskManager(include_defaults=False), **common)
    eval_s = time.perf_counter() - t0
    base = simple_evaluate(model=lm.replay(), task_manager=TaskManager(include_defaults=False), **common)

    rows, per_task = [], {}
    for spec in specs:
        name = spec["task"]
        metric, filt = primary(spec)
        b_samples = {s["doc_id"]: s for s in base["samples"][name] if s["filter"] == filt}
        c_samples = {s["doc_id"]: s for s in comp["samples"][name] if s["filter"] == filt}
        ids = sorted(b_samples)
        if sorted(c_samples) != ids:
            raise RuntimeError(f"task {name}: the baseline and compressed passes saw different examples")
        b = np.array([float(b_samples[i][metric]) for i in ids])
        c = np.array([float(c_samples[i][metric]) for i in ids])
        key = f"{metric},{filt}"
        same = sum(b_samples[i]["filtered_resps"] == c_samples[i]["filtered_resps"] for i in ids)
        # a multiple-choice example is right by chance one time in its number of choices; generated answers never
        chance = float(np.mean([1 / max(len(b_samples[i]["resps"]), 1) for i in ids])) if spec["output_type"] == "multiple_choice" and ids else 0.0
        per_task[name] = {
            "metric": metric,
            **paired_binary(b, c),
            "chance": chance,
            "near_chance": bool(ids) and float(b.mean()) < chance + NEAR_CHANCE_MARGIN,
            # raw responses (log-likelihoods, generated text) equal to the baseline's, not only the metric
            "identical_responses": int(same),
            "lm_eval_base": {key: base["results"][name].get(key), "stderr": base["results"][name].get(f"{metric}_stderr,{filt}")},
            "lm_eval_comp": {key: comp["results"][name].get(key), "stderr": comp["results"][name].get(f"{metric}_stderr,{filt}")},
        }
        for i, bi, ci in zip(ids, b, c):
            doc = b_samples[i]["doc"]
            rows.append({"task": name, "doc_id": int(i), "metric": metric, "base": float(bi), "comp": float(ci),
                         "length": doc.get("length"), "depth": doc.get("depth"),
                         "resp_base": str(b_samples[i]["filtered_resps"]), "resp_comp": str(c_samples[i]["filtered_resps"])})

    acc = lm.accounting
    elements = acc["compressed_tokens"] * lm.kv_elements_per_token
    summary = {
        "compressor": compressor.name,
        "model": cfg.model.name,
        "kind": "eval",
        "tasks": per_task,
        "overall": paired_binary(np.array([r["base"] for r in rows]), np.array([r["comp"] for r in rows])),
        # pooled over the tasks whose 16-bit accuracy is clear of chance: a task the model cannot do cannot lose
        "near_chance_tasks": sorted(t for t, v in per_task.items() if v["near_chance"]),
        "overall_informative": paired_binary(*(np.array([r[side] for r in rows if not per_task[r["task"]]["near_chance"]])
                                               for side in ("base", "comp"))),
        "limit": limit,
        "n_examples": len(rows),
        "cache": {"residual": cfg.cache.residual, "chunk": int(cfg.cache.chunk), "mode": str(cfg.cache.mode), "dtype": cfg.dtype},
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
        "generated_tokens": int(acc["generated_tokens"]),
        "compressor_params": compressor.describe(),
        # as the cache runs it: a compressor's own `residual` window is handed to the cache (see kvbench.cache.compressed)
        "cache_compressor_params": lm._cache(compressor).compressor.describe(),
        "dtype": cfg.dtype,
        "device": cfg.device,
        "git_sha": git_sha(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return summary, rows


def format_eval(s: dict) -> str:
    """Per-task table for the terminal."""
    lines = [f"  {s['compressor']} vs 16-bit baseline on {s['model']}  ({s['n_examples']} examples, limit {s['limit']}/task, "
             f"{s['bits_per_element']:.3f} bits/element held for {s['compressed_fraction']:.0%} of context tokens)",
             f"  {'task':<16} {'n':>4}  {'baseline':>14}  {'compressed':>14}  {'diff [95% CI]':>24}  {'McNemar p':>9}"]
    pooled = [("all", s["overall"])]
    if s.get("near_chance_tasks"):
        pooled.append(("clear of chance", s.get("overall_informative", {})))
    for name, t in [*s["tasks"].items(), *pooled]:
        if not t.get("n"):
            continue
        name = f"{name} (near chance)" if t.get("near_chance") else name
        lines.append(f"  {name:<16} {t['n']:>4}  {t['acc_base']:.3f} ± {t['stderr_base']:.3f}  {t['acc_comp']:.3f} ± {t['stderr_comp']:.3f}  "
                     f"{t['diff']:+.3f} [{t['ci95_low']:+.3f}, {t['ci95_high']:+.3f}]  {t['mcnemar_p']:>9.3g}")
    return "\n".join(lines)
