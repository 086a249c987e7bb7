"""Encode / decode throughput of every configured compressor on one real SmolLM2 trace, in MB/s of 16-bit KV.

    flock /tmp/kvbench-bench.lock .venv/bin/python scripts/bench_compressors.py [SPEC ...] [--json out.json]

SPEC is a config name from configs/compressor/ (default: all of them, found at run time) optionally with field
overrides, e.g. ``turboquant:variant=prod,bits=2.5``. Each compressor is fitted on the trace's calibration
sequences, warmed up once, then timed over ``--repeats`` passes of encode and decode (decode from the stored bytes
alone, as the harness does); the best pass is reported (the least disturbed by other load on the machine) next
to the median, and so is MB per CPU-second of the process (all its threads), which other load distorts less than
wall time. The load average before and after is printed too. Compressors that need the model get it (the model
load is not timed), compressors that declare ``needs_config`` get the model config in their context, as the harness
gives it; set compressors (cross-session dedup) are timed on single sequences, where they find nothing
to share. Any compressor that cannot run here is listed with the reason instead of a number. ``--extra SPEC``
adds variants after the default list. Wrap the command in ``flock`` so that timings never overlap; set
``OMP_NUM_THREADS`` to compare torch thread counts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from kvbench.coding.bitstream import Bitstream
from kvbench.core.compressor import SetCompressor
from kvbench.core.config import available, compose, make_compressor
from kvbench.core.kv import Context
from kvbench.core.timing import Stopwatch
from kvbench.inputs.capture import load_or_capture
from kvbench.inputs.models import ModelHandle


def parse_spec(spec: str) -> tuple[str, list[str]]:
    """``name:field=value,field=value`` -> (name, hydra overrides)."""
    name, _, rest = spec.partition(":")
    overrides = [f"compressor.{kv}" for kv in rest.split(",") if kv]
    return name, overrides


def time_compressor(comp, calib, seqs, model_ref, repeats: int, budget_s: float, config=None, device: str = "cpu",
                    fit: bool = True) -> dict:
    """Fit (unless ``fit`` is false: ``comp`` is fitted already), warm up, then time encode and decode over ``seqs``;
    returns MB/s (best and median) and bits. Each call is timed by :class:`~kvbench.core.timing.Stopwatch` on
    ``device`` (on a GPU: CUDA events after a synchronize, so queued kernels are counted; ``perf_counter`` on the
    CPU); ``decoded_on`` is where the decoder left the KV."""
    t0 = time.perf_counter()
    if fit:
        comp.fit(calib, config=config)  # as the harness fits: the free model config (RoPE undone from it)
    fit_s = time.perf_counter() - t0
    mb = sum(kv.n_elements for kv in seqs) * 2 / 1e6  # the 16-bit cache
    enc_t, dec_t, enc_cpu, dec_cpu, bits, n_el = [], [], [], [], 0, 0
    exact = True
    for rep in range(repeats + 1):  # pass 0 is the warm-up (allocator, plan and codebook set-up)
        te = td = ce = cd = 0.0
        bits = n_el = 0
        for kv in seqs:
            ctx = Context.for_kv(kv, model_ref, config)
            watch, c = Stopwatch(device), time.process_time()
            with watch():
                bs = comp.encode(kv, ctx)
            te, ce = te + watch.seconds, ce + time.process_time() - c
            stored = Bitstream.from_bytes(bs.data)
            watch, c = Stopwatch(device), time.process_time()
            with watch():
                out = comp.decode(stored, Context.for_kv(kv, model_ref, config))
            td, cd = td + watch.seconds, cd + time.process_time() - c
            if out.shape != kv.shape:
                raise RuntimeError(f"decoded shape {tuple(out.shape)} != {tuple(kv.shape)}")
            decoded_on = str(out.k.device)
            exact &= torch.equal(out.k.to(kv.k.device), kv.k) and torch.equal(out.v.to(kv.v.device), kv.v)
            bits += stored.num_bits
            n_el += kv.n_elements
        over = time.perf_counter() - t0 > budget_s
        cold = rep == 0 and over  # a warm-up slower than the whole budget is the only pass, and reported so
        if rep or cold:
            enc_t.append(te)
            dec_t.append(td)
            enc_cpu.append(ce)
            dec_cpu.append(cd)
        if over:
            break  # slow compressors: fewer passes rather than minutes each
    return {
        "encode_MBps": mb / min(enc_t),
        "decode_MBps": mb / min(dec_t),
        "encode_MBps_median": mb / statistics.median(enc_t),
        "decode_MBps_median": mb / statistics.median(dec_t),
        # per CPU-second of this process (all its threads): what other load on the machine cannot take away
        "encode_MB_per_cpu_s": mb / min(enc_cpu),
        "decode_MB_per_cpu_s": mb / min(dec_cpu),
        "passes": len(enc_t),
        "cold": cold,
        "MB": mb,
        "bits_per_element": bits / n_el,
        "lossless": bool(exact),
        "fit_s": fit_s,
        "decoded_on": decoded_on,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("specs", nargs="*", help="config names (default: every configs/compressor/*.yaml), NAME:field=value,...")
    p.add_argument("--extra", action="append", default=[], metavar="SPEC",
                   help="time this spec too, after the default list (repeatable), e.g. turboquant:variant=prod")
    p.add_argument("--sequences", type=int, default=1, help="eval sequences of the trace to time (each 2 x 30 x 3 x 1024 x 64 for SmolLM2)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes after one warm-up pass")
    p.add_argument("--budget-s", type=float, default=60.0, help="stop adding passes to one compressor after this long")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--override", action="append", default=[], help="run-config override for the trace, e.g. dataset.seq_len=2048")
    args = p.parse_args()

    specs = (args.specs or available("compressor")) + args.extra
    cfg = compose(args.override)
    handle = ModelHandle(cfg.model, cfg.device)
    trace = load_or_capture(cfg, handle)
    seqs = [s.kv for s in trace.eval[: args.sequences]]
    calib = [s.kv for s in trace.calib]
    load_before = os.getloadavg()
    print(f"trace {trace.path}: {len(seqs)} x {tuple(seqs[0].shape)} {seqs[0].k.dtype}; "
          f"torch threads {torch.get_num_threads()} on {os.cpu_count()} CPUs; best (median) of up to {args.repeats} passes; "
          f"load average {load_before[0]:.2f}")
    head = (f"{'compressor':<34} {'bits/el':>8} {'encode MB/s':>18} {'decode MB/s':>18} "
            f"{'MB/CPU-s enc/dec':>17}  note")
    print(head)
    print("-" * len(head))
    results = []
    for spec in specs:
        name, overrides = parse_spec(spec)
        row = {"spec": spec}
        try:
            comp = make_compressor(compose([*args.override, f"+compressor={name}", *overrides]).compressor)
            model_ref = handle if comp.needs_model else None
            if model_ref is not None:
                handle.model  # load outside the timed region  # noqa: B018
            config = handle.config if comp.needs_config else None  # free context, as the harness gives it
            row.update(time_compressor(comp, calib, seqs, model_ref, args.repeats, args.budget_s, config))
            notes = []
            if comp.needs_model:
                notes.append("decoder runs the model")
            if isinstance(comp, SetCompressor):
                notes.append("single sessions: no cross-session sharing")
            if row["lossless"]:
                notes.append("bit-exact")
            if row["cold"]:
                notes.append("one cold pass (slower than --budget-s)")
            row["note"] = "; ".join(notes)
            print(f"{spec:<34} {row['bits_per_element']:>8.4g} "
                  f"{row['encode_MBps']:>8.1f} ({row['encode_MBps_median']:>7.1f}) "
                  f"{row['decode_MBps']:>8.1f} ({row['decode_MBps_median']:>7.1f}) "
                  f"{row['encode_MB_per_cpu_s']:>8.1f}/{row['decode_MB_per_cpu_s']:<8.1f}  {row['note']}", flush=True)
        except Exception as e:  # noqa: BLE001 - one failing compressor must not hide the others' numbers
            row["skipped"] = f"{type(e).__name__}: {e}"
            print(f"{spec:<34} {'-':>8} {'-':>18} {'-':>18} {'-':>17}  skipped: {row['skipped']}", flush=True)
        results.append(row)
    load_after = os.getloadavg()
    print(f"load average at the end {load_after[0]:.2f} (1 min), {load_after[1]:.2f} (5 min)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"trace": str(trace.path), "sequences": len(seqs), "threads": torch.get_num_threads(),
                "cpus": os.cpu_count(), "load_average_start": load_before, "load_average_end": load_after,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2, default=_jsonable))
        print(f"-> {args.json}")
    return 0


def _jsonable(x):
    return None if isinstance(x, float) and math.isnan(x) else str(x)


if __name__ == "__main__":
    sys.exit(main())
