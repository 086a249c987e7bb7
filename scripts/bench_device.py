"""The GPU path, checked: capture and two coders on the device against the same cells on the CPU, and the encode /
decode GB/s of every per-vector and transform coder on the device, in one JSON (scripts/device_check.sh runs it
after the contract suite).

    python scripts/bench_device.py --device cuda|cpu [--quick] --out results/device_check.json --work DIR
        [--contract JUNIT.xml --contract-rc N --contract-s S] [--started EPOCH_S]

Each step's figures and wall seconds go into the JSON:

1. **Capture.** The default model's (SmolLM2-135M) evaluated and calibration windows (``dataset.n_sequences=2``)
   captured on the device in its default weight dtype (``model.dtype``: bfloat16 on CUDA), and the same windows on
   the CPU in the CPU's default (float32): the token ids must be the same, the device's K and V within a relative
   MSE of the CPU's, and the entropy bound (bits/token, from each capture's own log-probabilities) within a stated
   difference; the two weight dtypes are named beside them.
2. **Cells.** ``python -m kvbench run`` cells (:func:`kvbench.sweep.cells.run_cell`, as the CLI runs them) of KIVI
   2-bit and KVTC 2-bit on the device's capture, once on the device and once on the CPU with the same weight dtype.
   The harness keeps the KV in host memory and both cells code the same KV, so their bits per element must be
   equal; each device's model scores the decoded cache, so their NLL changes must agree within a stated tolerance.
3. **Throughput.** Encode and decode GB/s of 16-bit KV of every per-vector (family ``quantizer``) and transform
   coder (``--quick``: :data:`QUICK_CODERS`, one window, one timed pass) on the device's first windows, by
   scripts/bench_compressors.py's timer (:class:`~kvbench.core.timing.Stopwatch`: CUDA events after a synchronize
   on a GPU, ``perf_counter`` on the CPU), the window resident on the device. A coder whose encoder refuses device
   tensors is timed with the window in host memory, and its row says so (``placement``, ``device_refused``).

The JSON (written atomically) names the device (``torch.cuda.get_device_name``, or the CPU), the machine, torch and
CUDA versions, the commit, the tolerances, every figure, which checks failed, and the wall seconds of each step and
of the whole check. The exit status is 1 when the contract suite failed or a check did not hold, after the JSON is
written. ``--device cpu`` is the dry run: every "device" figure is then the CPU's.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch
from bench_compressors import time_compressor

from kvbench.core.config import available, compressor_class, default_model_dtype, make_compressor
from kvbench.core.kv import Context, KVSequence
from kvbench.core.machine import load_average, machine
from kvbench.core.timing import Stopwatch
from kvbench.inputs.capture import capture
from kvbench.inputs.models import ModelHandle
from kvbench.measure.metrics.rate import bound_bits_per_token
from kvbench.store.atomic import write_json
from kvbench.store.results import git_sha
from kvbench.sweep.cells import compose_cell, run_cell
from kvbench.sweep.config_check import check_device, read_config

#: how far the device may be from the CPU and still pass, fixed before any GPU run (not fitted to one)
TOLERANCES = {
    # both cells code the same captured KV with the same code: the same stream, bit for bit
    "bits_per_element_abs": 0.0,
    # |delta_nll on the device - delta_nll on the CPU|, nats/token: the same decoded cache scored by each device's
    # model in the same weight dtype; a tenth of a percent of SmolLM2's base NLL on SOTU, far under the 1% verdict
    "delta_nll_abs_nats": 0.01,
    # sum (K_device - K_cpu)^2 / sum K_cpu^2 (and V's) over every captured window: bfloat16 weights against float32
    "capture_rel_mse": 1e-3,
    # |bound on the device - bound on the CPU|, bits/token, each from its own capture's log-probabilities
    "bound_bits_per_token_abs": 0.02,
}
#: the run cells compared, each as ``python -m kvbench run`` overrides
CELLS = {"kivi": ("+compressor=kivi", "compressor.bits=2"), "kvtc": ("+compressor=kvtc", "compressor.bits=2")}
#: the windows of every cell and capture: the packaged defaults, two evaluated windows
DATASET = ("dataset.n_sequences=2",)
#: coder families timed: per-vector quantizers and transform coders
FAMILIES = ("quantizer", "transform")
#: --quick's coders: a fixed-rate per-vector quantizer, a rotated one and a transform coder
QUICK_CODERS = ("kivi", "turboquant", "kvtc")
#: the summary fields each compared cell keeps in the JSON
CELL_FIELDS = ("bits_per_element", "stream_bits_per_element", "delta_nll", "delta_nll_ci", "nll_base",
               "nll_compressed", "rel_mse_k", "rel_mse_v", "encode_s", "decode_s", "fit_s", "fit_cached", "measure_s",
               "device", "model_dtype", "n_sequences", "n_tokens", "eval_tokens")


def throughput_coders(quick: bool) -> list[str]:
    """Every configured coder of :data:`FAMILIES` (found at run time, so a new one is timed too); ``quick``: those of
    :data:`QUICK_CODERS`."""
    names = [n for n in available("compressor") if compressor_class(n).family in FAMILIES]
    return [n for n in names if n in QUICK_CODERS] if quick else names


def device_name(device: str) -> str:
    """The GPU's name for ``cuda[:N]``, the CPU's model otherwise."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return machine().rsplit(", ", 3)[0]  # machine(): "CPU, N CPU cores, torch V, Python V"


def within(a: float, b: float, tol: float) -> bool:
    """``|a - b| <= tol`` for finite ``a`` and ``b`` (a NaN never agrees)."""
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= tol


def compare_captures(dev: list, cpu: list, tol: dict = TOLERANCES) -> dict:
    """The device's capture against the CPU's (``dev``, ``cpu``: a trace's sequences, in the same order): token ids,
    the relative MSE and largest difference of K and of V over every window, and each capture's entropy bound over
    its evaluated windows; ``failed`` lists what is out of tolerance."""
    out: dict[str, Any] = {"windows": len(dev), "tokens_equal": len(dev) == len(cpu) and all(
        torch.equal(a.kv.tokens, b.kv.tokens) and torch.equal(a.continuation, b.continuation) for a, b in zip(dev, cpu))}
    failed = [] if out["tokens_equal"] else ["capture: the device's windows are not the CPU's token ids"]
    for kind in ("k", "v"):
        err = ref = 0.0
        worst = 0.0
        for a, b in zip(dev, cpu):
            x, y = getattr(a.kv, kind).double(), getattr(b.kv, kind).double()
            err += float((x - y).pow(2).sum())
            ref += float(y.pow(2).sum())
            worst = max(worst, float((x - y).abs().max()))
        out[f"rel_mse_{kind}"] = err / ref if ref > 0 else math.nan
        out[f"max_abs_diff_{kind}"] = worst
        if not out[f"rel_mse_{kind}"] <= tol["capture_rel_mse"]:
            failed.append(f"capture: relative MSE of {kind.upper()} {out[f'rel_mse_{kind}']:.3g} is over "
                          f"{tol['capture_rel_mse']}")
    for side, seqs in (("device", dev), ("cpu", cpu)):
        lp = torch.cat([s.logprobs for s in seqs if s.role == "eval"])
        out[f"bound_bits_per_token_{side}"] = bound_bits_per_token(lp.tolist(), lp.numel())
    out["bound_diff"] = out["bound_bits_per_token_device"] - out["bound_bits_per_token_cpu"]
    if not within(out["bound_bits_per_token_device"], out["bound_bits_per_token_cpu"], tol["bound_bits_per_token_abs"]):
        failed.append(f"capture: the bound differs by {out['bound_diff']:+.4f} bits/token, over "
                      f"{tol['bound_bits_per_token_abs']}")
    out["failed"] = failed
    return out


def compare_cell(name: str, dev: dict, cpu: dict, tol: dict = TOLERANCES) -> dict:
    """One coder's cell on the device against the same cell on the CPU (their run summaries): the fields kept, the
    differences, and ``failed``: the bits per element not equal, or the NLL changes further apart than the
    tolerance."""
    bits = dev["bits_per_element"] - cpu["bits_per_element"]
    dnll = dev["delta_nll"] - cpu["delta_nll"]
    failed = []
    if not within(dev["bits_per_element"], cpu["bits_per_element"], tol["bits_per_element_abs"]):
        failed.append(f"{name}: {dev['bits_per_element']!r} bits/element on the device, {cpu['bits_per_element']!r} "
                      "on the CPU")
    if not within(dev["delta_nll"], cpu["delta_nll"], tol["delta_nll_abs_nats"]):
        failed.append(f"{name}: delta_nll {dev['delta_nll']:+.5f} on the device, {cpu['delta_nll']:+.5f} on the CPU, "
                      f"{abs(dnll):.5f} apart (tolerance {tol['delta_nll_abs_nats']})")
    keep = lambda s: {k: s[k] for k in CELL_FIELDS if k in s}  # noqa: E731
    return {"coder": name, "overrides": list(CELLS.get(name, ())), "device": keep(dev), "cpu": keep(cpu),
            "bits_per_element_diff": bits, "delta_nll_diff": dnll,
            "nll_base_diff": dev.get("nll_base", math.nan) - cpu.get("nll_base", math.nan), "failed": failed}


def contract_figures(xml: Path | None, rc: int | None, seconds: float | None) -> dict:
    """The contract suite's outcome from its JUnit report: counts, the failed tests' names, exit status and wall
    seconds; ``failed`` holds one line when it did not pass (or left no report)."""
    out: dict[str, Any] = {"exit_status": rc, "wall_s": seconds}
    if xml is None or not Path(xml).exists():
        out["failed"] = [] if rc is None else [f"contract suite: no report (exit status {rc})"]
        return out
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    for key in ("tests", "failures", "errors", "skipped"):
        out[key] = int(suite.get(key, 0))
    out["failed_tests"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                           if c.find("failure") is not None or c.find("error") is not None]
    bad = rc not in (0, None) or out["failures"] or out["errors"]
    out["failed"] = [f"contract suite: {out['failures']} failed, {out['errors']} errors of {out['tests']} "
                     f"(exit status {rc})"] if bad else []
    return out


def on_device(kv: KVSequence, device: str) -> KVSequence:
    """``kv`` with every tensor moved to ``device``."""
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return dataclasses.replace(kv, k=move(kv.k), v=move(kv.v), tokens=move(kv.tokens), k_pre_rope=move(kv.k_pre_rope),
                               kept=move(kv.kept))


def time_coder(name: str, handle: ModelHandle, calib: list[KVSequence], seqs: list[KVSequence], device: str,
               repeats: int, budget_s: float) -> dict:
    """Fit ``name``'s default configuration on ``calib`` (host memory), then time it on ``seqs`` moved to ``device``,
    or left in host memory where its encoder refuses device tensors; GB/s of 16-bit KV, best and median pass."""
    comp = make_compressor(compose_cell("run", [f"+compressor={name}"]).compressor)
    model_ref = handle if comp.needs_model else None
    config = handle.config if comp.needs_config else None
    row: dict[str, Any] = {"coder": name, "family": comp.family, "params": comp.describe()}
    t0 = time.perf_counter()
    comp.fit(calib, config=config)
    fit_s = time.perf_counter() - t0
    placed, row["placement"] = [on_device(kv, device) for kv in seqs], device
    if device != "cpu":
        try:
            comp.encode(placed[0], Context.for_kv(placed[0], model_ref, config))
        except Exception as e:  # noqa: BLE001 - what the coder does with device tensors is the finding
            row["device_refused"] = f"{type(e).__name__}: {e}"[:300]
            placed, row["placement"] = seqs, "cpu"
    row.update(time_compressor(comp, calib, placed, model_ref, repeats, budget_s, config, device=device, fit=False))
    row["fit_s"] = fit_s
    for k in ("encode", "decode"):
        row[f"{k}_GBps"], row[f"{k}_GBps_median"] = row[f"{k}_MBps"] / 1e3, row[f"{k}_MBps_median"] / 1e3
    return row


class Handles:
    """One model handle per (device, weight dtype), kept across the steps."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, str], ModelHandle] = {}
        self.load_s: dict[str, float] = {}

    def __call__(self, cfg: Any) -> ModelHandle:
        key = (str(cfg.device), str(cfg.model.dtype))
        if key not in self.held:
            handle = ModelHandle(cfg.model, key[0])
            watch = Stopwatch(key[0])
            with watch():
                handle.model  # noqa: B018 - loaded here, outside every timed step
            self.held[key], self.load_s["/".join(key)] = handle, watch.seconds
        return self.held[key]


def run_config(device: str, dtype: str, work: Path, *extra: str) -> Any:
    return read_config(compose_cell("run", [*DATASET, f"device={device}", f"model.dtype={dtype}",
                                            f"paths.results={work / 'runs'}", "metrics.resume=false", *extra]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (the dry run)")
    p.add_argument("--quick", action="store_true", help=f"time {', '.join(QUICK_CODERS)} only, one window, one pass")
    p.add_argument("--out", type=Path, required=True, help="the JSON written")
    p.add_argument("--work", type=Path, required=True, help="a fresh folder for the captures and the cells' runs")
    p.add_argument("--contract", type=Path, help="the contract suite's JUnit XML report")
    p.add_argument("--contract-rc", type=int, help="the contract suite's exit status")
    p.add_argument("--contract-s", type=float, help="the contract suite's wall seconds")
    p.add_argument("--started", type=float, help="when the whole check started (seconds since the epoch)")
    args = p.parse_args(argv)
    check_device(args.device)
    started = args.started or time.time()
    device, quick, work = args.device, args.quick, args.work
    dev_dtype, cpu_dtype = default_model_dtype(device), default_model_dtype("cpu")
    report: dict[str, Any] = {
        "check": "scripts/device_check.sh: the contract suite, capture and two coders on the device against the CPU, "
                 "encode/decode GB/s of every per-vector and transform coder on the device",
        "dry_run": device == "cpu",
        "note": ("CPU dry run: every 'device' figure is the CPU's; the GPU figures wait for a GPU" if device == "cpu"
                 else "measured on the GPU named in device_name"),
        "device": device, "device_name": device_name(device), "machine": machine(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "torch_threads": torch.get_num_threads(),
        "git_sha": git_sha(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": quick,
        "model_dtype": {"device_capture": dev_dtype, "cpu_capture": cpu_dtype, "cells": dev_dtype},
        "tolerances": TOLERANCES, "load_average_start": load_average(), "steps_s": {},
        "contract": contract_figures(args.contract, args.contract_rc, args.contract_s),
    }
    handles = Handles()

    def step(name: str, fn, default: Any) -> Any:
        """``fn()``, timed; an error is reported (``errors``) and ``default`` stands in, so the JSON is written."""
        t0 = time.perf_counter()
        print(f"[{time.time() - started:6.1f} s] {name} ...", flush=True)
        try:
            got = fn()
        except Exception as e:  # noqa: BLE001 - a first run on a new device: keep what the other steps measured
            traceback.print_exc()
            report.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:500]
            got = default
        report["steps_s"][name] = time.perf_counter() - t0
        print(f"  {name}: {report['steps_s'][name]:.1f} s", flush=True)
        return got

    def captures():
        out = {}
        for side, dev, dtype in (("device", device, dev_dtype), ("cpu", "cpu", cpu_dtype)):
            cfg = run_config(dev, dtype, work)
            handle = handles(cfg)
            watch = Stopwatch(dev)
            with watch():
                out[side] = capture(cfg, handle, work / f"trace-{side}", progress=False)
            report.setdefault("capture_s", {})[side] = watch.seconds
        return out

    traces = step("capture", captures, None)
    if traces is None:
        report["capture"] = {"failed": []}  # the error is the step's
        report["cells"], report["throughput"] = [], []
        return conclude(report, args.out, started)
    report["capture"] = compare_captures(traces["device"].sequences, traces["cpu"].sequences)
    report["capture"].update(trace_tokens=traces["device"].manifest["dataset"]["seq_len"])

    def cells():
        rows = []
        for name, overrides in CELLS.items():
            got = {}
            try:
                for side, dev in (("device", device), ("cpu", "cpu")):
                    cfg = run_config(dev, dev_dtype, work, f"trace={traces['device'].path}", *overrides)
                    got[side] = run_cell("run", cfg, handles(cfg)).summary
            except Exception as e:  # noqa: BLE001 - the other coder's cells still run
                traceback.print_exc()
                rows.append({"coder": name, "failed": [f"{name}: the {side} cell failed: {type(e).__name__}: {e}"[:500]]})
                continue
            rows.append(compare_cell(name, got["device"], got["cpu"]))
            print(f"  {name}: bits/element {got['device']['bits_per_element']:.4f} / {got['cpu']['bits_per_element']:.4f}"
                  f", delta_nll {got['device']['delta_nll']:+.5f} / {got['cpu']['delta_nll']:+.5f} (device / cpu)",
                  flush=True)
        return rows

    report["cells"] = step("cells", cells, [])

    def throughput():
        cfg = run_config(device, dev_dtype, work)
        handle = handles(cfg)
        trace = traces["device"]
        seqs = [s.kv for s in trace.eval[: 1 if quick else 2]]
        calib = [s.kv for s in trace.calib]
        rows = []
        for name in throughput_coders(quick):
            try:
                row = time_coder(name, handle, calib, seqs, device, 1 if quick else 3, 5.0 if quick else 12.0)
                print(f"  {name:<12} encode {row['encode_GBps']:.4f} GB/s, decode {row['decode_GBps']:.4f} GB/s "
                      f"({row['placement']}, {row['passes']} passes)", flush=True)
            except Exception as e:  # noqa: BLE001 - one coder's failure must not hide the others' figures
                row = {"coder": name, "skipped": f"{type(e).__name__}: {e}"[:300]}
                print(f"  {name:<12} skipped: {row['skipped']}", flush=True)
            rows.append(row)
        return rows

    report["throughput"] = step("throughput", throughput, [])
    report["throughput_of"] = (f"GB/s of 16-bit KV: the device capture's first {1 if quick else 2} evaluated "
                               f"window(s), best and median of up to {1 if quick else 3} timed pass(es) after a warm-up")
    report["model_load_s"] = handles.load_s
    return conclude(report, args.out, started)


def conclude(report: dict, out: Path, started: float) -> int:
    """Gather every step's failures into ``report`` (``failed``, ``ok``), add the end's load and the whole check's
    wall seconds since ``started``, write it to ``out`` atomically; the exit status: 0 when every check held."""
    failed = [f"{name}: {err}" for name, err in report.get("errors", {}).items()]
    failed += list(report["contract"].get("failed", [])) + report["capture"]["failed"]
    failed += [f for c in report["cells"] for f in c["failed"]]
    failed += [f"throughput: {r['coder']} was not timed: {r['skipped']}" for r in report["throughput"] if "skipped" in r]
    report.update(failed=failed, ok=not failed, load_average_end=load_average(), wall_s=time.time() - started)
    write_json(out, report)
    print(f"-> {out}: {'ok' if not failed else 'FAILED'} in {report['wall_s']:.0f} s")
    for f in failed:
        print(f"  failed: {f}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
