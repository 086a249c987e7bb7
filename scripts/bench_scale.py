"""Wall time and peak resident memory of each step of a cell against the context length: capture, encode, decode and
scoring, per model and compressor.

    python scripts/bench_scale.py [--lengths 1024 2048 ...] [--models smollm2_135m ...]
                                  [--compressors kivi:bits=2 kvtc:bits=2 snapkv:keep=0.5] [--n-sequences 1]
                                  [--n-calib 1] [--eval-len 512] [--out results/scale.json]

Every step runs in a process of its own (this script with ``--step``), so each peak is that step's, not an earlier
one's: ``capture`` prefills the windows into a trace (:func:`kvbench.inputs.capture.capture`), ``encode`` fits the
compressor on the trace's calibration windows (``fit_s``, apart) and encodes the evaluated windows, ``decode``
decodes the stored bytes with a decoder rebuilt from the fitted state alone, ``score`` scores each window's held-out
continuation on the decoded cache (:func:`kvbench.measure.metrics.task_loss.continuation_nlls`). The steps hand
each other files in a scratch folder. Each row has the step's wall time, the process's resident memory when the
step began (``rss_before_gb``: interpreter, weights where the step loads the model, its inputs), the step's peak
(``step_peak_rss_gb``, from the kernel's high-water mark reset as the step begins; None where it cannot be reset)
and the process's (``peak_rss_gb``); capture and score rows carry the peak :mod:`kvbench.inputs.footprint`
estimates before the model runs (``estimate_gb``). Lengths past a model's positions (continuation included) are
skipped and listed. ``--file OUT...`` files outputs as runs of kind ``scale`` (one per model and length, a row per
step), which ``python -m kvbench report --export-evidence scale`` publishes as the evidence of results/scale.md.
The whole run holds the benchmark lock (:mod:`kvbench.store.locking`). The output is rewritten
as each (model, length) ends; run again with the same arguments at the same clean commit, the lengths it holds are
kept and the rest measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
#: one per-vector quantizer, one transform coder, one eviction method
DEFAULT_COMPRESSORS = ("kivi:bits=2", "kvtc:bits=2", "snapkv:keep=0.5")
STEPS = ("capture", "encode", "decode", "score")
RESULT = "bench_scale result: "  # the line a step's process reports on


def overrides(job: dict) -> list[str]:
    """The run-config overrides of a job's cell (the trace in the job's scratch folder)."""
    return [f"model={job['model']}", f"dataset={job['dataset']}", f"dataset.seq_len={job['context']}",
            f"dataset.eval_len={job['eval_len']}", f"dataset.n_sequences={job['n_sequences']}",
            f"dataset.n_calib={job['n_calib']}", f"trace={job['work']}/trace", "metrics.recall_tokens=0"]


def compressor_of(job: dict):
    from kvbench.core.config import compose, make_compressor

    name, _, fields = (job["compressor"] or "").partition(":")
    return make_compressor(compose([*overrides(job), f"+compressor={name}",
                                    *[f"compressor.{f}" for f in fields.split(",") if f]]).compressor)


def run_step(job: dict) -> dict:
    """One step of ``job`` in this process: its figures, the memory measured around it."""
    import torch
    from safetensors.torch import load_file, save_file

    from kvbench.core.codec import decoder_for, prepare
    from kvbench.core.config import compose
    from kvbench.core.kv import Context, KVSequence
    from kvbench.core.rss import GB, cell_peak_gb, process_peak_gb, resident_bytes, start_cell
    from kvbench.inputs.capture import capture, load_trace
    from kvbench.inputs.footprint import estimate
    from kvbench.inputs.models import ModelHandle
    from kvbench.measure.metrics.task_loss import continuation_nlls

    cfg = compose(overrides(job))
    handle = ModelHandle(cfg.model, cfg.device)
    work, step = Path(job["work"]), job["step"]
    comp = compressor_of(job) if step in ("encode", "decode") else None
    needs_model = step in ("capture", "score") or (comp is not None and comp.needs_model)
    if needs_model:
        handle.model  # noqa: B018 - loaded before the step: its load is not the step's
    model_ref = handle if comp is not None and comp.needs_model else None
    config = handle.config if comp is not None and comp.needs_config else None
    trace = load_trace(work / "trace") if step != "capture" else None
    out: dict = {}
    if step in ("capture", "score"):
        held = 1 if step == "score" else int(job["n_sequences"]) + int(job["n_calib"])
        out["estimate_gb"] = estimate(handle.config, int(job["context"]), int(job["eval_len"]), held, 2, True).total / GB
    stored = work / f"{job['compressor_id']}.safetensors" if comp is not None or step == "score" else None
    rss_before = resident_bytes() / GB
    start_cell()
    t0 = time.perf_counter()
    if step == "capture":
        capture(cfg, handle, work / "trace", progress=False)
    elif step == "encode":
        codec = prepare(comp, lambda: [s.kv for s in trace.calib], cfg.device, None, config)
        out["fit_s"] = codec.fit_s
        t1 = time.perf_counter()
        streams = [comp.encode(s.kv, Context.for_kv(s.kv, model_ref, config)).data for s in trace.eval]
        out["encode_s"] = time.perf_counter() - t1  # the step less the fit
        out["bits_per_element"] = 8 * sum(map(len, streams)) / sum(s.kv.n_elements for s in trace.eval)
        (work / f"{job['compressor_id']}.state").write_bytes(codec.state)
        for i, data in enumerate(streams):
            (work / f"{job['compressor_id']}-{i}.bin").write_bytes(data)
    elif step == "decode":
        from kvbench.coding.bitstream import Bitstream

        decoder = decoder_for(comp, (work / f"{job['compressor_id']}.state").read_bytes())
        streams = [Bitstream.from_bytes((work / f"{job['compressor_id']}-{i}.bin").read_bytes())
                   for i in range(len(trace.eval))]
        t1 = time.perf_counter()
        kvs = [decoder.decode(bs, Context.for_kv(s.kv, model_ref, config)) for bs, s in zip(streams, trace.eval)]
        out["decode_s"] = time.perf_counter() - t1  # the step less writing the decoded cache
        save_file({name: t for i, kv in enumerate(kvs) for name, t in
                   ((f"k{i}", kv.k), (f"v{i}", kv.v), (f"kept{i}", kv.kept)) if t is not None}, str(stored))
    elif step == "score":
        got = load_file(str(stored))
        nll = [continuation_nlls(handle.model, KVSequence(got[f"k{i}"], got[f"v{i}"], kept=got.get(f"kept{i}")),
                                 s.continuation) for i, s in enumerate(trace.eval)]
        out["nll"] = float(torch.cat([torch.from_numpy(x) for x in nll]).mean())
    wall = time.perf_counter() - t0
    return {**out, "wall_s": wall, "rss_before_gb": rss_before, "step_peak_rss_gb": cell_peak_gb(),
            "peak_rss_gb": process_peak_gb(), "torch_threads": torch.get_num_threads()}


def in_child(job: dict) -> dict:
    """Run one step in a fresh process of this script and return what it reports."""
    r = subprocess.run([sys.executable, __file__, "--step", json.dumps(job)], stdout=subprocess.PIPE, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(RESULT)]
    if r.returncode or not lines:
        return {"error": f"exit {r.returncode}; see the step's stderr above"}
    return json.loads(lines[-1][len(RESULT):])


def own_output(path: Path) -> dict:
    """One of this script's own outputs (an ``--out`` file, results/scale.json by default), never a run's files:
    runs are read through :mod:`kvbench.store.results`."""
    with open(path) as f:
        return json.load(f)


#: the arguments that make two runs of this script measure the same thing
SETTING = ("lengths", "models", "compressors", "dataset", "n_sequences", "n_calib", "eval_len")


def resumed(out: Path, sha: str, setting: dict) -> list[dict]:
    """The rows an earlier, interrupted run of the same setting at the same clean commit left in ``out``: whole
    lengths only (every step of a (model, length) or none of it), none with an error."""
    if not out.exists() or sha.endswith("-dirty") or sha == "unknown":
        return []
    try:
        old = own_output(out)
    except (OSError, json.JSONDecodeError):
        return []
    meta = old.get("meta", {})
    if meta.get("git_sha") != sha or any(meta.get(k) != setting[k] for k in SETTING):
        return []
    want = 1 + (len(STEPS) - 1) * len(setting["compressors"])
    cells = by_cell(old.get("rows", [])).values()
    return [r for cell in cells if len(cell) == want and not any("error" in r for r in cell) for r in cell]


def by_cell(rows: list[dict]) -> dict[tuple, list[dict]]:
    """An output's rows per (model, length), in order."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["model"], r["context"]), []).append(r)
    return cells


def memory_gb() -> float | None:
    """This machine's memory (MemTotal), in GB of 2**30 bytes; None where /proc/meminfo does not say."""
    try:
        line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024 / 2**30


def file_runs(outputs: list[Path], root: Path) -> list[Path]:
    """File what this script measured (its ``--out`` files) as runs of kind ``scale`` under ``root``/runs, one per
    model and length with a row per step, each recorded at the code version that measured it, and return their
    directories. The machine's memory is recorded where the filing machine is the measuring one (the same
    description), else left out."""
    from kvbench.core.config import compose
    from kvbench.core.machine import machine
    from kvbench.inputs.models import ModelHandle
    from kvbench.inputs.positions import position_limit
    from kvbench.store.results import cell_key, run_dir, write

    dirs = []
    for out in outputs:
        got = own_output(out)
        meta = got["meta"]
        memory = memory_gb() if meta.get("machine") == machine() else None
        limits: dict[str, tuple] = {}
        for (model, T), rows in by_cell(got["rows"]).items():
            if any("error" in r for r in rows):
                raise SystemExit(f"error: {out}: {model} at {T} tokens has a failed step; measure it again first")
            if model not in limits:  # one config read per model, not per length
                limits[model] = position_limit(ModelHandle(compose([f"model={model}"]).model).config)
            limit, source = limits[model]
            config = {"model": model, "dataset": {"name": meta["dataset"], "seq_len": T, "eval_len": meta["eval_len"],
                                                  "n_sequences": meta["n_sequences"], "n_calib": meta["n_calib"]},
                      "compressors": meta["compressors"]}
            key = cell_key(config)
            summary = {"kind": "scale", "model": model, "dataset": meta["dataset"], "context": T,
                       "compressor": ",".join(meta["compressors"]), "eval_len": meta["eval_len"],
                       "n_sequences": meta["n_sequences"], "n_calib": meta["n_calib"], "position_limit": limit,
                       "position_limit_source": source, "machine_memory_gb": memory,
                       **{k: meta[k] for k in ("machine", "cpus", "load_average_start", "load_average_end")},
                       "cell_key": key, "git_sha": meta["git_sha"], "created": meta["created"], "config": config,
                       "rows": [{k: v for k, v in r.items() if k not in ("model", "context")} for r in rows]}
            path = run_dir(root, "scale", model, key, meta["git_sha"])
            write(path, "scale", summary, summary["rows"], config)
            dirs.append(path)
    return dirs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), help="prefix tokens")
    p.add_argument("--models", nargs="+", default=["smollm2_135m"])
    p.add_argument("--compressors", nargs="+", default=list(DEFAULT_COMPRESSORS), metavar="NAME:FIELD=V,...")
    p.add_argument("--dataset", default="sotu")
    p.add_argument("--n-sequences", type=int, default=1, help="evaluated windows per length")
    p.add_argument("--n-calib", type=int, default=1, help="calibration windows (the fitted coders fit on them)")
    p.add_argument("--eval-len", type=int, default=512, help="continuation tokens scored")
    p.add_argument("--out", type=Path, default=Path("results/scale.json"))
    p.add_argument("--file", type=Path, nargs="+", metavar="OUT",
                   help="file these outputs of earlier runs as runs of kind scale (under --results) and stop")
    p.add_argument("--results", type=Path, default=Path("results/sweeps/scale"),
                   help="where --file writes its runs (under RESULTS/runs)")
    p.add_argument("--step", help=argparse.SUPPRESS)  # internal: one step's job, as JSON
    args = p.parse_args()
    if args.step:
        print(RESULT + json.dumps(run_step(json.loads(args.step))), flush=True)
        return 0
    if args.file:
        dirs = file_runs(args.file, args.results)
        print(f"{len(dirs)} scale runs -> {args.results / 'runs'}; publish them with python -m kvbench report "
              f"--export-evidence scale {args.results / 'runs'} and python -m kvbench report --pages scale.md")
        return 0

    from kvbench.core.config import compose
    from kvbench.core.machine import load_average, machine
    from kvbench.inputs.models import ModelHandle
    from kvbench.inputs.positions import position_limit
    from kvbench.store.atomic import write_json
    from kvbench.store.locking import bench_lock
    from kvbench.store.results import git_sha

    rows, skipped = [], []
    started, load_start = time.strftime("%Y-%m-%dT%H:%M:%S%z"), load_average()
    sha = git_sha()
    done = resumed(args.out, sha, vars(args))
    rows += done

    def meta() -> dict:
        return {"machine": machine(), "cpus": os.cpu_count(), "git_sha": sha, "created": started,
                "load_average_start": load_start, "load_average_end": load_average(), "command": sys.argv,
                **{k: getattr(args, k) for k in SETTING}}

    with bench_lock(), tempfile.TemporaryDirectory(prefix="kvbench-scale-") as scratch:
        for model in args.models:
            limit, source = position_limit(ModelHandle(compose([f"model={model}"]).model).config)
            for T in args.lengths:
                if limit is not None and T + args.eval_len > limit:
                    skipped.append({"model": model, "context": T, "why": f"{T} + {args.eval_len} tokens past the "
                                                                          f"model's {limit} positions ({source})"})
                    continue
                if any(r["model"] == model and r["context"] == T for r in done):
                    print(f"{model:>14} {T:>6} measured at {sha} in {args.out}: kept", flush=True)
                    continue
                work = Path(scratch) / f"{model}-{T}"
                work.mkdir()
                job = {"model": model, "dataset": args.dataset, "context": T, "eval_len": args.eval_len,
                       "n_sequences": args.n_sequences, "n_calib": args.n_calib, "work": str(work),
                       "compressor": None, "compressor_id": None}
                todo = [("capture", None)] + [(s, c) for c in args.compressors for s in STEPS[1:]]
                for step, spec in todo:
                    cid = None if spec is None else f"c{args.compressors.index(spec)}"
                    got = in_child({**job, "step": step, "compressor": spec, "compressor_id": cid})
                    rows.append({"model": model, "context": T, "step": step, "compressor": spec, **got})
                    print(f"{model:>14} {T:>6} {step:>8} {spec or '':<18} " + (
                          got["error"] if "error" in got else
                          f"{got['wall_s']:8.2f} s  peak {got['peak_rss_gb']:.2f} GB (step "
                          f"{got['step_peak_rss_gb'] or float('nan'):.2f}, from {got['rss_before_gb']:.2f})"
                          + (f"  estimate {got['estimate_gb']:.2f} GB" if "estimate_gb" in got else "")), flush=True)
                # each length is written as it ends: an interrupted run keeps what it measured and resumes there
                write_json(args.out, {"meta": meta(), "rows": rows, "skipped": skipped})
    write_json(args.out, {"meta": meta(), "rows": rows, "skipped": skipped})
    print(f"-> {args.out}")
    return 0 if not any("error" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
