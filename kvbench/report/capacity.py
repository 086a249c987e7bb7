"""``python -m kvbench capacity``: what a memory budget holds of each coder's KV cache, and how fast a batch that
fills it would decode. A PROJECTION from measured figures: nothing is run; the figures are read from committed
evidence (``results/evidence/``) and carried to the model's geometry by the formulas below.

Measured (each row names the run it comes from):

- **stream bits per KV element**: per coder (its curve label) and measured model, the cell of study
  ``capacity.study`` (the frontier's) with the fewest stream bits whose held-out NLL change lies within 1% of the
  base NLL (the study's own verdict); as measured on the study's windows, the coder's exact 16-bit tokens (its
  recent window, its sinks) included at their share of those windows, and on the measured model's head_dim, which
  a per-vector coder's scale or norm overhead depends on (the row says whether it is the target's). The codec's
  fitted parameters, a fixed size per model and not per token, are left out;
- **resident decode-step cost against DynamicCache**: in study ``capacity.latency_study``, the coder's
  CompressedCache's median decode step over DynamicCache's at the same context of the same run
  (``python -m kvbench latency``), at the measured context nearest the projected one, on the same model where it
  was measured there. A coder with no latency run has none ("not measured", with the command that would measure it).

Modelled (``configs/capacity.yaml`` states every figure assumed; GB are 10^9 bytes)::

    KV bytes per token   = 2 * layers * kv_heads * head_dim * bits_per_element / 8
    weights              = params * bytes of model.dtype            (or capacity.weights_gb)
    reserve              = reserve_fraction * memory                 (activations, workspaces, runtime)
    KV tokens            = floor((memory - weights - reserve) / KV bytes per token)
    contexts at L        = floor(KV tokens / L)                      (0 past the model's positions)
    decode step at L     = (weights + B * L * KV bytes per token) / bandwidth * r,    B = contexts at L
    decode tokens/s      = B / decode step

a memory-bound step at a batch that fills memory: it reads the weights and every context's KV once. ``r`` is 1
for the 16-bit cache (DynamicCache itself) and the coder's measured step-cost ratio otherwise;
``tokens_per_s_memory`` is the same step at r = 1, what the coder's bytes alone would allow. The step-cost ratios
were measured on a CPU with a small model, where a step is not memory-bound: carried to an accelerator they say how
much work a coder adds per step, not how a kernel for it would run. Published figures (``capacity.references``)
are quoted beside the projection as their sources state them.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench.core.checks import check_choice
from kvbench.inputs.assets import Geometry
from kvbench.inputs.geometry import geometry_of
from kvbench.report.collect import Collection, fact, numeric, plain
from kvbench.report.evidence import load
from kvbench.store.paths import repo_root, results_root
from kvbench.store.results import cell_key, git_sha, run_dir, write

LABEL = "PROJECTION (modelled from measured bits and step costs; not measured)"
KIND = "capacity"
#: the bits of the cache every ratio is measured against
BASELINE_BITS = 16
BASELINE_LABEL = "16-bit (DynamicCache)"
#: the latency rows' caches: the plain one, and the coder's
DYNAMIC, COMPRESSED = "dynamic", "compressed"
#: bytes per parameter of each model.dtype
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: a packaged model's null model.dtype: what it loads in on a GPU
GPU_DTYPE = "bfloat16"
#: a reference row's fields (capacity.references)
REFERENCE_FIELDS = ("source", "url", "setting", "published_model", "hardware", "kv_capacity_x",
                    "throughput_of_baseline", "metric")


# ---- the model ---------------------------------------------------------------------------------------------------
def kv_bytes_per_token(geom: Geometry, bits_per_element: float) -> float:
    """Bytes one token's K and V take at ``bits_per_element``: ``2 * layers * kv_heads * head_dim * bits / 8``."""
    return geom.kv_elements_per_token * bits_per_element / 8


def kv_tokens(kv_budget_bytes: float, bytes_per_token: float) -> int:
    """KV tokens that fit in the budget."""
    return int(kv_budget_bytes // bytes_per_token)


def concurrent(tokens: int, context: int, max_positions: int) -> int:
    """Contexts of ``context`` tokens that fit at once (none past the model's positions)."""
    return tokens // context if context <= max_positions else 0


def step_seconds(weights_bytes: float, batch: int, context: int, bytes_per_token: float, bandwidth: float,
                 ratio: float = 1.0) -> float:
    """A memory-bound decode step of ``batch`` contexts: the weights and their KV read once at ``bandwidth``
    (bytes/s), times the coder's step-cost ratio."""
    return (weights_bytes + batch * context * bytes_per_token) / bandwidth * ratio


def decode_tokens_per_s(batch: int, step_s: float) -> float:
    return batch / step_s if batch > 0 else math.nan


# ---- the fields ----------------------------------------------------------------------------------------------------
def _number(field: str, value: Any, above: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= above:
        raise ValueError(f"capacity.{field}={value!r} is not allowed; give a number above {above:g}")
    return float(value)


def weights_gb(cap: Any, model: Any, geom: Geometry) -> tuple[float, str]:
    """What the weights take (GB) and how that was decided."""
    if cap.get("weights_gb") is not None:
        return _number("weights_gb", cap.weights_gb), "capacity.weights_gb"
    dtype = str(model.get("dtype") or GPU_DTYPE)
    check_choice("model", "dtype", dtype, DTYPE_BYTES)
    if geom.params is None:
        raise ValueError(f"capacity.weights_gb=None is not allowed for model={model.get('name')}: its config gives no "
                         "parameter count; give capacity.weights_gb=GB (what the weights take)")
    return geom.params * DTYPE_BYTES[dtype] / 1e9, f"{geom.params:,} params x {DTYPE_BYTES[dtype]} bytes ({dtype})"


def check_fields(cap: Any, weights: float) -> tuple[float, float, list[int]]:
    """``(memory_gb, reserve_gb, contexts)`` once every field is allowed; a ValueError naming the field else."""
    memory = _number("memory_gb", cap.memory_gb)
    frac = cap.reserve_fraction
    if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0 <= frac < 1:
        raise ValueError(f"capacity.reserve_fraction={frac!r} is not allowed; give a share of memory_gb, 0 <= x < 1")
    reserve = memory * float(frac)
    if memory <= weights + reserve:
        raise ValueError(f"capacity.memory_gb={cap.memory_gb!r} is not allowed: it must exceed the weights "
                         f"({weights:.2f} GB) plus the reserve ({reserve:.2f} GB, capacity.reserve_fraction="
                         f"{frac}); give memory_gb > {(weights / (1 - frac)):.2f}")
    _number("bandwidth_gb_per_s", cap.bandwidth_gb_per_s)
    contexts = list(cap.contexts) if cap.contexts is not None and not isinstance(cap.contexts, str | int) else None
    if not contexts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in contexts):
        raise ValueError(f"capacity.contexts={cap.contexts!r} is not allowed; give a list of whole numbers of "
                         "tokens, each at least 1")
    return memory, reserve, [int(c) for c in contexts]


# ---- the measured figures ----------------------------------------------------------------------------------------
def measured_points(got: Collection) -> tuple[pd.DataFrame, list[str]]:
    """Per coder (its curve label) and measured model, the cell with the fewest stream bits within 1% NLL; and the
    curves that have none, as ``label on model``."""
    d = got.table
    if d.empty:
        return d, []
    label = fact(d, "label")
    d = d.assign(label=label.where(label.notna(), d["compressor"].astype(str)), exact_tokens=fact(d, "exact_tokens"),
                 stream_bits=numeric(d, "stream_bits_per_element"))
    ok = d[(d["nll_verdict"] == "within") & d["stream_bits"].notna()]
    best = ok.loc[ok.groupby(["model", "label"])["stream_bits"].idxmin()] if not ok.empty else ok
    seen = set(zip(best["model"], best["label"]))
    left_out = sorted({f"{lab} on {m}" for m, lab in zip(d["model"], d["label"]) if (m, lab) not in seen})
    return best.sort_values(["model", "stream_bits"], kind="stable").reset_index(drop=True), left_out


def step_costs(got: Collection) -> pd.DataFrame:
    """Per latency run and context, the coder's decode step over DynamicCache's (medians of the same run)."""
    lat = got.latency
    rows = []
    if lat.empty:
        return pd.DataFrame(rows)
    for (run, ctx), g in lat.groupby(["run_id", "context"], sort=True):
        dyn, comp = g[g["cache"] == DYNAMIC], g[g["cache"] == COMPRESSED]
        if len(dyn) != 1 or len(comp) != 1:
            continue
        r = comp.iloc[0]
        rows.append({"compressor": r["compressor"], "model": r["model"], "context": int(ctx), "run_id": run,
                     "ratio": float(r["decode_median_ms"]) / float(dyn.iloc[0]["decode_median_ms"]),
                     "params": r.get("params", ""), "device": r.get("device"), "model_dtype": r.get("model_dtype")})
    return pd.DataFrame(rows)


def step_cost_for(steps: pd.DataFrame, compressor: str, model: str, context: int) -> dict | None:
    """The measured step cost a coder's row is projected with: its compressor's latency runs, those on the model
    its bits were measured on if any, at the context nearest ``context`` (the longer on a tie)."""
    if steps.empty:
        return None
    mine = steps[steps["compressor"] == compressor]
    if mine.empty:
        return None
    if (mine["model"] == model).any():
        mine = mine[mine["model"] == model]
    far = (mine["context"].astype(float) / context).map(lambda x: abs(math.log(x)))
    best = mine.assign(far=far, neg=-mine["context"]).sort_values(["far", "neg", "model", "run_id"]).iloc[0]
    return best.drop(["far", "neg"]).to_dict()


# ---- the rows ------------------------------------------------------------------------------------------------------
def _plain(v: Any) -> Any:
    """A value as JSON takes it (numpy scalars as Python numbers, NaN as None)."""
    if hasattr(v, "item"):
        v = v.item()
    return None if isinstance(v, float) and math.isnan(v) else v


def _coder(p: pd.Series, geom: Geometry, heads: dict[str, int]) -> dict:
    """What a coder's row says of the cell its bits come from."""
    params = {k.removeprefix("compressor_params."): _plain(p[k]) for k in p.index
              if k.startswith("compressor_params.") and _plain(p[k]) is not None}
    head_dim = heads.get(str(p["model"]))
    return {"compressor": str(p["compressor"]), "label": str(p["label"]), "compressor_params": params,
            "exact_tokens": _plain(p.get("exact_tokens")), "measured_model": str(p["model"]),
            "measured_head_dim": head_dim, "head_dim_matches": head_dim == geom.head_dim,
            "measured_context": _plain(p.get("context_len")), "bits_run": str(p["run_id"]),
            "stream_bits_per_element": float(p["stream_bits"]), "delta_nll": _plain(p.get("delta_nll")),
            "delta_nll_ci": [_plain(x) for x in _interval(p.get("delta_nll_ci"))],
            "nll_base": _plain(p.get("nll_base")), "eval_documents_n": _plain(p.get("eval_documents_n"))}


def _interval(v: Any) -> list:
    import json

    try:
        return list(json.loads(v) if isinstance(v, str) else v)
    except (TypeError, ValueError):
        return [None, None]


def project(geom: Geometry, weights: float, memory: float, reserve: float, contexts: list[int], bandwidth: float,
            points: pd.DataFrame, steps: pd.DataFrame, heads: dict[str, int]) -> list[dict]:
    """One row per coder (the 16-bit cache first) and context: what fits, and the projected decode."""
    budget, w_bytes, bw = (memory - weights - reserve) * 1e9, weights * 1e9, bandwidth * 1e9
    coders = [{"compressor": DYNAMIC, "label": BASELINE_LABEL, "stream_bits_per_element": float(BASELINE_BITS),
               "exact_tokens": "all"}]
    coders += [_coder(p, geom, heads) for _, p in points.iterrows()]
    base_bpt = kv_bytes_per_token(geom, BASELINE_BITS)
    base_tokens = kv_tokens(budget, base_bpt)
    rows = []
    for c in coders:
        bpt = kv_bytes_per_token(geom, c["stream_bits_per_element"])
        tokens = kv_tokens(budget, bpt)
        for L in contexts:
            batch = concurrent(tokens, L, geom.max_positions)
            row = {"row": "projected", **c, "kv_bytes_per_token": bpt, "kv_tokens": tokens,
                   "capacity_x": tokens / base_tokens, "context": L, "fits_positions": L <= geom.max_positions,
                   "concurrent": batch}
            if c["compressor"] == DYNAMIC:
                row |= {"step_ratio": 1.0, "step_source": "DynamicCache itself"}
            else:
                s = step_cost_for(steps, c["compressor"], c["measured_model"], L)
                if s is None:
                    row |= {"step_ratio": None, "step_source": "not measured",
                            "step_measure": f"python -m kvbench latency +compressor={c['compressor']}"}
                else:
                    row |= {"step_ratio": s["ratio"], "step_source": "measured", "step_run": s["run_id"],
                            "step_model": s["model"], "step_context": s["context"], "step_params": s["params"],
                            "step_device": s["device"], "step_model_dtype": s["model_dtype"],
                            "step_params_match": s["params"] == _params_text(c["compressor_params"])}
            memory_step = step_seconds(w_bytes, batch, L, bpt, bw)
            row["tokens_per_s_memory"] = _plain(decode_tokens_per_s(batch, memory_step))
            r = row["step_ratio"]
            row["tokens_per_s"] = None if r is None else _plain(decode_tokens_per_s(batch, memory_step * r))
            rows.append(row)
    base = {r["context"]: r["tokens_per_s"] for r in rows if r["compressor"] == DYNAMIC}
    for r in rows:
        b = base.get(r["context"])
        r["vs_16bit"] = None if r["tokens_per_s"] is None or not b else r["tokens_per_s"] / b
    return rows


def _params_text(params: dict) -> str:
    """A compressor's parameters as the report's ``params`` column writes them."""
    return " ".join(f"{k}={plain(v)}" for k, v in sorted(params.items()) if k != "name" and v is not None)


def references(cap: Any) -> list[dict]:
    """The published figures of ``capacity.references``, one row each."""
    out = []
    for i, ref in enumerate(cap.get("references") or []):
        missing = [f for f in REFERENCE_FIELDS if f not in ref]
        if missing:
            raise ValueError(f"capacity.references[{i}] lacks {missing}; each gives {list(REFERENCE_FIELDS)}")
        out.append({"row": "published", "compressor": str(ref["setting"]), **{f: ref[f] for f in REFERENCE_FIELDS}})
    return out


def evidence_folder(cap: Any) -> Path:
    """The results folder whose committed evidence is read."""
    return results_root(cap.evidence) if cap.get("evidence") else repo_root() / "results"


def compute(cfg: Any) -> dict:
    """The capacity summary of a composed config (``configs/capacity.yaml``): its rows and what they rest on; a
    ValueError naming the field where one is not allowed."""
    from kvbench.inputs.assets import MODELS

    cap, model = cfg.capacity, cfg.model
    geom = geometry_of(model)
    weights, weights_from = weights_gb(cap, model, geom)
    memory, reserve, contexts = check_fields(cap, weights)
    root = evidence_folder(cap)
    bits, lat = load(str(cap.study), root), load(str(cap.latency_study), root)
    points, left_out = measured_points(bits.got)
    heads = {name: m.geometry.head_dim for name, m in MODELS.items() if m.geometry is not None}
    rows = project(geom, weights, memory, reserve, contexts, float(cap.bandwidth_gb_per_s), points,
                   step_costs(lat.got), heads)
    return {"compressor": "(per row)", "model": str(model.name), "projection": LABEL, "memory_gb": memory,
            "weights_gb": weights, "weights_from": weights_from, "reserve_gb": reserve,
            "reserve_fraction": float(cap.reserve_fraction), "kv_budget_gb": memory - weights - reserve,
            "bandwidth_gb_per_s": float(cap.bandwidth_gb_per_s), "contexts": contexts,
            "geometry": {"n_layers": geom.n_layers, "n_kv_heads": geom.n_kv_heads, "head_dim": geom.head_dim,
                         "params": geom.params, "max_positions": geom.max_positions,
                         "native_positions": geom.native_positions, "note": geom.note},
            "kv_elements_per_token": geom.kv_elements_per_token,
            "evidence": {e.study: {"commit": e.commit, "runs": e.runs} for e in (bits, lat)},
            "left_out": left_out, "rows": rows + references(cap)}


# ---- the command ---------------------------------------------------------------------------------------------------
def _n(v: Any, fmt: str = ",.0f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def format_capacity(s: dict) -> str:
    """The summary as the terminal shows it: one line per coder, its contexts and projected tokens/s per context."""
    g, contexts = s["geometry"], s["contexts"]
    ev = "; ".join(f"{k} at commit {v['commit']} ({v['runs']} runs)" for k, v in s["evidence"].items())
    lines = [f"  {s['model']}: {g['n_layers']} layers x {g['n_kv_heads']} KV heads x head_dim {g['head_dim']} = "
             f"{s['kv_elements_per_token']:,} KV elements per token; {s['memory_gb']:g} GB = weights "
             f"{s['weights_gb']:.2f} ({s['weights_from']}) + reserve {s['reserve_gb']:.2f} + KV {s['kv_budget_gb']:.2f}",
             f"  measured: stream bits/elt and decode-step cost vs DynamicCache, from evidence: {ev}",
             f"  {s['projection']}: a memory-bound decode step at {s['bandwidth_gb_per_s']:,.0f} GB/s, at the batch of "
             "contexts that fills the KV memory, times the measured step cost"]
    if g.get("note"):
        lines.append(f"  note: {g['note']}")
    coders = [r for r in s["rows"] if r["row"] == "projected"]
    by: dict[tuple, dict[int, dict]] = {}
    for r in coders:
        bits = r.get("compressor_params", {}).get("bits")
        by.setdefault((r["label"], r.get("measured_model"), "" if bits is None else plain(bits)), {})[r["context"]] = r
    w = max(len(k[0]) + len(k[2]) + 1 for k in by)
    head = "".join(f" {f'@{c}':>7}" for c in contexts)
    tps = "".join(f" {f'tok/s@{c}':>12}" for c in contexts)
    lines.append(f"  {'coder':<{w}} {'bits measured on':<24} {'bits/elt':>8} {'KV tokens':>11} {'x16':>5}{head}"
                 f" {'step x':>6}{tps}  step cost from")
    for (label, measured, nominal), per in by.items():
        r = per[contexts[0]]
        on = "-" if measured is None else f"{measured} ({r['measured_head_dim']}" + \
            ("" if r["head_dim_matches"] else f" vs {g['head_dim']}") + ")"
        step = r["step_ratio"]
        src = {"measured": lambda r: f"{r['step_run']} at {r['step_context']} ({r['step_params'] or '-'}"
                                     f"{'' if r['step_params_match'] else ': other params'}, {r['step_model']}, "
                                     f"{r['step_device']})",
               "not measured": lambda r: f"not measured: {r['step_measure']}"}.get(r["step_source"],
                                                                                 lambda r: r["step_source"])(r)
        lines.append(f"  {(label + ' ' + nominal).strip():<{w}} {on:<24} {r['stream_bits_per_element']:>8.3f} "
                     f"{r['kv_tokens']:>11,} {r['capacity_x']:>5.2f}"
                     + "".join(f" {per[c]['concurrent']:>7,}" for c in contexts)
                     + f" {_n(step, '.2f'):>6}" + "".join(f" {_n(per[c]['tokens_per_s']):>12}" for c in contexts)
                     + f"  {src}")
    if s.get("left_out"):
        lines.append(f"  no cell within 1% NLL (left out): {', '.join(s['left_out'])}")
    lines.append("  published, for comparison (not measured here):")
    for r in (r for r in s["rows"] if r["row"] == "published"):
        cap = "-" if r["kv_capacity_x"] is None else f"{r['kv_capacity_x']:g}x KV capacity"
        tput = "-" if r["throughput_of_baseline"] is None else f"{r['throughput_of_baseline']:.1%} of the baseline"
        lines.append(f"    {r['setting']} on {r['published_model']}, {r['hardware']}: {cap}, {tput} ({r['metric']}); "
                     f"{r['source']}")
    return "\n".join(lines)


def file_run(summary: dict, cfg_dict: dict, root: Path, sha: str | None = None) -> Path:
    """Write the capacity run under ``root``/runs, as every command files its runs, and return its directory
    (``sha``: the code version it records; default this checkout's)."""
    key, sha = cell_key(cfg_dict), sha or git_sha()
    path = run_dir(root, KIND, summary["model"], key, sha)
    rows = summary["rows"]
    write(path, KIND, {**summary, "kind": KIND, "cell_key": key, "git_sha": sha,
                       "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": cfg_dict}, rows, cfg_dict)
    return path


def main(cfg: Any) -> None:
    """``python -m kvbench capacity``: compute, print and file the capacity run of the composed config."""
    from omegaconf import OmegaConf

    from kvbench.report.evidence import MixedCodeVersions

    try:
        summary = compute(cfg)
        cfg_dict = OmegaConf.to_container(cfg, resolve=True)
        path = file_run(summary, cfg_dict, results_root(cfg.paths.results))
    except (ValueError, MixedCodeVersions, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(format_capacity(summary))
    print(f"  -> {path / 'capacity.json'}")


# ---- the check ---------------------------------------------------------------------------------------------------
def _agree(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_agree(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_agree(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool) or not (isinstance(a, int | float) and isinstance(b, int | float)):
        return a == b
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)


def recompute(run: str | Path) -> tuple[list[str], list[str]]:
    """``(problems, notes)`` of a committed capacity run (``<results>/evidence/<study>/<run>``): its rows computed
    again from the evidence of the studies it names, in the same results folder, and every figure they state
    otherwise; a note where that evidence is not there."""
    import json

    from omegaconf import OmegaConf

    from kvbench.report.evidence import MANIFEST, evidence_root

    run = Path(run)
    summary = json.loads((run / f"{KIND}.json").read_text())
    results = run.parents[2]
    cfg = OmegaConf.create(summary.get("config") or {})
    studies = [str(OmegaConf.select(cfg, f"capacity.{k}")) for k in ("study", "latency_study")]
    missing = [s for s in studies if not (evidence_root(results) / s / MANIFEST).exists()]
    if missing:
        return [], [f"capacity rows not recomputed: no evidence of study {', '.join(missing)} beside them"]
    cfg.capacity.evidence = str(results)
    try:
        got = compute(cfg)
    except ValueError as e:
        return [f"its rows cannot be recomputed from the evidence they name: {e}"], []
    problems = [f"{k}: {got[k]!r} recomputed from the evidence, the run says {summary.get(k)!r}"
                for k in ("evidence", "left_out", "weights_gb", "kv_budget_gb") if not _agree(summary.get(k), got[k])]
    rows = summary.get("rows") or []
    if len(rows) != len(got["rows"]):
        return [*problems, f"rows: {len(got['rows'])} recomputed from the evidence, the run has {len(rows)}"], []
    for i, (was, now) in enumerate(zip(rows, got["rows"])):
        wrong = [k for k in now if not _agree(was.get(k), now[k])]
        if wrong:
            problems.append(f"row {i} ({now.get('label', now.get('setting'))}, context {now.get('context')}): "
                            + ", ".join(f"{k} {now[k]!r} recomputed, {was.get(k)!r} in the run" for k in wrong[:4]))
    return problems, []
