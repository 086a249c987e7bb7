"""Capturing real KV caches: prefill each window with the model and keep every layer's K and V.

Keys are post-RoPE, as the cache holds them (``capture.pre_rope=true`` also keeps the pre-RoPE keys: the key
projection's output after the layer's ``k_norm``, as :mod:`kvbench.inputs.attention_modules` reads them). The
prefill runs with a cache of full layers only, so sliding-window layers (Gemma 3) keep their whole K/V instead of
the last ``window`` tokens. Each token's log-probability under the model is recorded too: its mean is the
entropy bound's empirical side, H(token | history).

A trace is a directory: ``manifest.json`` and one ``seq_NNN.safetensors`` per window holding ``k`` and ``v``
``(L, H, T, D)`` in the cache dtype, ``tokens`` (prefix + continuation + 1) and ``logprobs`` (prefix tokens 1..T-1).
Every later measurement rests on these files, so the manifest records the SHA-256 of each window file (``files``),
the command that captures the trace again (``capture_command``) and the hash of its own body (``sha256``,
:func:`kvbench.store.integrity.seal`); :func:`load_trace` checks all of them before a tensor is used, and a damaged,
truncated or unhashed trace is one :class:`~kvbench.store.integrity.IntegrityError` line naming the file and that
command.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors import SafetensorError
from safetensors.torch import load, save_file

from kvbench import __version__
from kvbench.core.kv import KVSequence
from kvbench.inputs.assets import AssetError
from kvbench.inputs.attention_modules import attention_modules, heads, projection
from kvbench.inputs.data import draw_windows, load_documents
from kvbench.inputs.footprint import check_fits, estimate
from kvbench.inputs.forward import decoder_of, scored_forward
from kvbench.inputs.layout import ROLES, capture_windows, windows_drawn
from kvbench.inputs.models import (
    ModelHandle,
    attn_implementation,
    describe,
    in_file_name,
    model_dtype_name,
    model_fields,
    model_overrides,
)
from kvbench.inputs.positions import check_positions, window_positions
from kvbench.store.atomic import probe_write, staged_dir, why_unwritable
from kvbench.store.integrity import check_hash, damaged, read_sealed_json, seal, sha256_file
from kvbench.store.paths import home
from kvbench.store.results import git_sha

#: 2: the manifest records each window file's hash and its own (format 1 traces have none and are captured again)
TRACE_FORMAT = 2
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}

#: dataset.split: the windows every study scores, and further ones for choosing hyperparameters
SPLITS = ("test", "dev")


def cache_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not allowed; the cache baseline is 16-bit: {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass
class TraceSequence:
    kv: KVSequence  # prefix KV, tokens = prefix ids
    continuation: torch.Tensor  # (eval_len + 1,): the last prefix token's successor onwards
    logprobs: torch.Tensor  # (T - 1,) natural-log probability of prefix tokens 1..T-1
    role: str  # "eval" | "calib"


@dataclass
class Trace:
    path: Path
    manifest: dict[str, Any]
    sequences: list[TraceSequence]
    captured: bool = False  # True when this process captured it (rather than loading a cached capture)

    @property
    def eval(self) -> list[TraceSequence]:
        return [s for s in self.sequences if s.role == "eval"]

    @property
    def calib(self) -> list[TraceSequence]:
        return [s for s in self.sequences if s.role == "calib"]


@torch.no_grad()
def capture_window(model: Any, ids: torch.Tensor, seq_len: int, dtype: torch.dtype, pre_rope: bool = False) -> dict[str, torch.Tensor]:
    """Prefill ``ids[:seq_len]`` and return the KV, the token log-probs and (optionally) pre-RoPE keys.

    The prefix goes through the decoder stack in chunks and its log-probs through the LM head in blocks of rows
    (:func:`kvbench.inputs.forward.scored_forward`: no ``(T, vocab)`` logits), and the float32 cache is copied into
    the cache dtype one layer at a time, each layer freed once copied (:func:`_cache_kv`), so the peak stays near
    one float32 cache of the window plus a working set that does not grow with the vocabulary."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    prefix = ids[:seq_len].to(device)  # (T,)
    decoder = decoder_of(model)
    pre: list[list[torch.Tensor]] = [[] for _ in decoder.layers]  # per layer, one block per chunk fed

    def keep(i: int, attn: Any, columns: slice | None) -> Any:
        def hook(_m: Any, _i: Any, out: torch.Tensor) -> None:
            pre[i].append(heads(attn, "k", out.detach(), columns)[0].to("cpu", dtype))  # (H, c, D)
        return hook

    hooks = []
    if pre_rope:  # on the module that projects the keys (k_proj, or Phi-3's fused qkv_proj): its output, normed
        for i, attn in enumerate(attention_modules(decoder, "capture.pre_rope")):
            module, columns = projection(attn, "k")
            hooks.append(module.register_forward_hook(keep(i, attn, columns)))
    try:
        cache = DynamicCache()  # full layers only: sliding-window layers keep all T tokens
        logprobs = scored_forward(model, prefix, cache, prefix[1:])  # (T-1,)
    finally:
        for h in hooks:
            h.remove()
    k, v = _cache_kv(cache, dtype, seq_len)  # (L, H, T, D) each
    result = {"k": k, "v": v, "logprobs": logprobs.cpu()}
    if pre_rope:
        result["k_pre_rope"] = torch.stack([torch.cat(p, dim=1) for p in pre])  # (L, H, T, D)
    return result


def _cache_kv(cache: Any, dtype: torch.dtype, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's K and V of ``cache`` as ``(L, H, T, D)`` in ``dtype`` on the CPU. Each float32 layer is
    released from the cache as soon as it is copied, so the float32 cache and its copy never coexist in full."""
    layers = cache.layers
    _, H, T, D = layers[0].keys.shape
    k = torch.empty((len(layers), H, T, D), dtype=dtype)  # (L, H, T, D)
    v = torch.empty_like(k)  # (L, H, T, D)
    for i, layer in enumerate(layers):
        if layer.keys.shape[2] != seq_len:
            raise RuntimeError(f"captured {layer.keys.shape[2]} tokens of KV in layer {i} for a {seq_len}-token prefix "
                               "(truncating cache?)")
        k[i].copy_(layer.keys[0])
        v[i].copy_(layer.values[0])
        layer.keys = layer.values = None  # the float32 layer's only reference
    return k, v


#: the modules whose code decides what a captured trace holds (windows drawn from the text, the model as loaded, the
#: forward pass and what is kept of it): their source is part of every trace's cache key
CAPTURE_CODE = ("kvbench.inputs.capture", "kvbench.inputs.forward", "kvbench.inputs.data", "kvbench.inputs.layout",
                "kvbench.inputs.models", "kvbench.inputs.attention_modules", "kvbench.core.kv")


def capture_code_version() -> str:
    """16 hex digits naming the capture code: the source of :data:`CAPTURE_CODE`, the torch and transformers
    versions and the interpreter's (whose standard library is the ``stdlib_code`` text). A commit that changes none of them keeps every cached trace; one that does captures afresh."""
    import importlib

    import transformers

    h = hashlib.sha256(f"{torch.__version__} {transformers.__version__} {sys.version}".encode())
    for name in CAPTURE_CODE:
        h.update(Path(importlib.import_module(name).__file__).read_bytes())
    return h.hexdigest()[:16]


def trace_key(cfg: Any) -> str:
    ds = cfg.dataset
    key = {
        "format": TRACE_FORMAT,
        "code": capture_code_version(),
        "model": [cfg.model.name, cfg.model.source, str(cfg.model.path)],
        "dataset": [ds.name, str(ds.path), ds.field, ds.n_sequences, ds.n_calib, ds.seq_len, ds.eval_len, ds.seed],
        "dtype": cfg.dtype,
        "pre_rope": bool(cfg.capture.pre_rope),
    }
    if split_of(ds) != "test":  # the test split's traces keep the keys they had before splits existed
        key["split"] = split_of(ds)
    # the model's weight dtype and attention change every captured value; the float32, sdpa traces captured
    # before these fields existed keep their keys
    if (dtype := model_dtype_name(cfg.model, str(cfg.device))) != "float32":
        key["model_dtype"] = dtype
    if (attn := attn_implementation(cfg.model)) != "sdpa":
        key["attn_implementation"] = attn
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def default_trace_dir(cfg: Any) -> Path:
    return home() / "traces" / f"{in_file_name(cfg.model.name)}-{cfg.dataset.name}-{trace_key(cfg)}"


def split_of(ds: Any) -> str:
    """``dataset.split``: ``test`` (the default) or ``dev``; anything else is an error naming both."""
    split = str(ds.get("split", "test") if hasattr(ds, "get") else "test")
    if split not in SPLITS:
        raise ValueError(f"dataset.split={split!r} is not allowed; choose one of {list(SPLITS)}")
    return split


def eval_windows(ds: Any) -> list[int]:
    """The indices in the dataset's seeded window order of the windows ``dataset.split`` scores
    (:mod:`kvbench.inputs.layout`: disjoint from the other split's, the calibration windows and the fit draws)."""
    return capture_windows(ds, split_of(ds))[0]


def dataset_windows(ds: Any, tokenizer: Any, calib_windows: int = 0) -> tuple[torch.Tensor, list[int]]:
    """The dataset's seeded window order as far as a capture of ``ds`` (and ``calib_windows`` further calibration
    windows) reaches: ``(windows, documents)``, each window ``seq_len + eval_len + 1`` tokens."""
    n = windows_drawn(ds, calib_windows)
    try:
        return draw_windows(load_documents(ds), tokenizer, n, int(ds.seq_len) + int(ds.eval_len) + 1, int(ds.seed))
    except AssetError as e:
        raise AssetError(f"{e} ({n} windows: the {', '.join(ROLES)} roles take every {len(ROLES)}th window of the "
                         f"text, {len(ROLES)} x max(n_sequences={ds.n_sequences}, n_calib={ds.n_calib}"
                         f"{f', {calib_windows} calibration draws' if calib_windows else ''}))") from e


class TraceFolderNotWritable(ValueError):
    """A trace must be captured into a folder that cannot take it."""


def check_trace_folder(out: Path) -> None:
    """Raise :class:`TraceFolderNotWritable` unless the folder a trace is captured into takes a write, before the
    model is loaded or any window prefilled."""
    try:
        probe_write(Path(out).parent)
    except OSError as e:
        raise TraceFolderNotWritable(
            f"trace folder {Path(out).parent} cannot take a capture: {why_unwritable(e)} ({e.filename or out}); "
            "nothing was captured or measured. A trace this config has not captured yet must be written to a "
            "writable folder: set KVBENCH_HOME=DIR (traces go to DIR/traces) or pass trace=PATH of a captured trace"
        ) from e


def _setting(cfg: Any, key: str) -> Any:
    return OmegaConf.select(cfg, key, default=None, throw_on_missing=False) if OmegaConf.is_config(cfg) else None


def capture_command(cfg: Any, out: Path | None = None) -> str:
    """The ``python -m kvbench capture`` command that captures this config's trace (into ``out`` when it is not the
    default folder): every field :func:`trace_key` reads."""
    args = model_overrides(cfg.model)
    args.append(f"dataset={_setting(cfg, 'dataset.name')}")
    for name in ("path", "field", "n_sequences", "n_calib", "seq_len", "eval_len", "seed"):
        if (value := _setting(cfg, f"dataset.{name}")) is not None:
            args.append(f"dataset.{name}={value}")
    if _setting(cfg, "dataset.split") not in (None, "test"):
        args.append(f"dataset.split={_setting(cfg, 'dataset.split')}")
    if _setting(cfg, "dataset.allow_beyond_positions"):
        args.append("dataset.allow_beyond_positions=true")
    args.append(f"dtype={_setting(cfg, 'dtype')}")
    if _setting(cfg, "capture.pre_rope"):
        args.append("capture.pre_rope=true")
    if out is not None and Path(out) != default_trace_dir(cfg):
        args.append(f"trace={out}")
    return "python -m kvbench capture " + " ".join(shlex.quote(a) for a in args)


def check_window(cfg: Any, handle: ModelHandle, held_windows: int) -> None:
    """Refuse the config's window before the model is loaded or run: one beyond the model's positions
    (:mod:`kvbench.inputs.positions`, unless ``dataset.allow_beyond_positions``), or one whose estimated peak while
    ``held_windows`` windows are held exceeds the memory limit (:mod:`kvbench.inputs.footprint`)."""
    ds, metrics, config = cfg.dataset, _setting(cfg, "metrics"), handle.config
    if config is None:
        return  # no model to run
    check_positions(ds, metrics, config, cfg.model.name)
    scored = window_positions(ds, metrics) - int(ds.seq_len)
    fp = estimate(config, int(ds.seq_len), scored, held_windows, cache_dtype(cfg.dtype).itemsize, handle.loaded)
    check_fits(fp, _setting(cfg, "memory.limit_gb"), f"dataset.seq_len={ds.seq_len} (+ {scored} scored tokens) on "
               f"{cfg.model.name}, {held_windows} windows held")


def capture(cfg: Any, handle: ModelHandle, out: Path, progress: bool = True) -> Trace:
    """Capture the ``n_sequences`` evaluated windows of ``dataset.split`` and the ``n_calib`` calibration windows
    into ``out`` (written atomically, its manifest sealed with every file's hash), once :func:`check_window` lets
    the window through."""
    from tqdm import tqdm

    check_trace_folder(out)
    ds, dtype = cfg.dataset, cache_dtype(cfg.dtype)
    check_window(cfg, handle, int(ds.n_sequences) + int(ds.n_calib))
    every, docs = dataset_windows(ds, handle.tokenizer)
    evaluated, calibration = capture_windows(ds, split_of(ds))
    taken = evaluated + calibration
    windows = every[taken]
    info = describe(handle.model, cfg.model.name, cfg.model.source, getattr(handle, "_meta", {}))
    roles = ["eval"] * ds.n_sequences + ["calib"] * ds.n_calib
    t0 = time.perf_counter()
    files = {}
    with staged_dir(out) as tmp:
        for i, (ids, role) in enumerate(tqdm(list(zip(windows, roles)), desc="capture", disable=not progress, leave=False)):
            got = capture_window(handle.model, ids, ds.seq_len, dtype, bool(cfg.capture.pre_rope))
            name = seq_file(i)
            save_file({**got, "tokens": ids.clone()}, str(tmp / name), metadata={"role": role})
            files[name] = sha256_file(tmp / name)
        elapsed = time.perf_counter() - t0
        manifest = {
            "format_version": TRACE_FORMAT,
            "model": asdict(info),
            "dtype": cfg.dtype,
            "dataset": {**{k: ds[k] for k in ds}, "split": split_of(ds)},
            "roles": roles,
            # where each window is in the dataset's window order and which document (index among the text's
            # documents, as loaded) it is cut from: the interval resamples documents by these
            "window_order": taken,
            "documents": [docs[i] for i in taken],
            "pre_rope": bool(cfg.capture.pre_rope),
            **model_fields(handle, cfg),  # model_dtype, attn_implementation: what the KV was computed with
            "kvbench_version": __version__,
            "git_sha": git_sha(),
            "capture_code": capture_code_version(),
            "capture_s": elapsed,
            "prefill_tokens_per_s": len(taken) * ds.seq_len / elapsed,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "capture_command": capture_command(cfg, out),
            "files": files,
        }
        (tmp / "manifest.json").write_text(json.dumps(seal(manifest), indent=2))
    return load_trace(out)


def seq_file(i: int) -> str:
    return f"seq_{i:03d}.safetensors"


#: how to rebuild a trace whose capture command is not known (its manifest is damaged, and no config is at hand)
RECAPTURE = "capture it again with `python -m kvbench capture` and the model=/dataset=/dtype= overrides it was taken with"


def load_trace(path: Path, rebuild: str | None = None) -> Trace:
    """The trace in ``path``, every file checked against the hashes its sealed manifest records. ``rebuild``: the
    command that captures it again (default: the one the manifest records), named by any error."""
    path = Path(path)
    mf = path / "manifest.json"
    if not mf.exists():
        raise FileNotFoundError(f"trace={path} is not a kvbench trace (no manifest.json); write one with `python -m kvbench capture`")
    fix = f"`{rebuild}`" if rebuild else RECAPTURE
    try:
        version = json.loads(mf.read_bytes()).get("format_version")
    except (ValueError, AttributeError):
        version = None  # unreadable: read_sealed_json names what is wrong
    if isinstance(version, int) and version < TRACE_FORMAT:
        raise damaged(mf, f"is of trace format {version}, whose files carry no content hashes to check them by; this "
                          f"kvbench reads format {TRACE_FORMAT}", fix)
    manifest = read_sealed_json(mf, fix)
    if manifest.get("format_version") != TRACE_FORMAT:
        raise ValueError(f"trace {path} has format {manifest.get('format_version')}; this kvbench reads {TRACE_FORMAT}")
    if not rebuild and manifest.get("capture_command"):
        fix = f"`{manifest['capture_command']}`"
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    seqs = []
    T = manifest["dataset"]["seq_len"]
    for i, role in enumerate(manifest["roles"]):
        f = path / seq_file(i)
        if not f.exists():
            raise damaged(f, "is missing", fix)
        data = f.read_bytes()
        check_hash(f, files.get(f.name), fix, data)
        try:
            t = load(data)
            kv = KVSequence(t["k"], t["v"], t["tokens"][:T], t.get("k_pre_rope"))
        except (SafetensorError, KeyError, ValueError) as e:
            raise damaged(f, f"is not a readable trace window ({type(e).__name__}: {e})", fix) from e
        seqs.append(TraceSequence(kv, t["tokens"][T:], t["logprobs"], role))
    return Trace(path, manifest, seqs)


def trace_stored(cfg: Any) -> bool:
    """Whether the config's trace is on disk (``trace=PATH``, or the cached capture): a run need not capture it."""
    return bool(cfg.trace) or (default_trace_dir(cfg) / "manifest.json").exists()


def load_or_capture(cfg: Any, handle: ModelHandle) -> Trace:
    """``trace=PATH`` if given; else the cached capture for this (model, dataset, dtype); else capture now. A
    cached capture that fails its hashes is an error naming the file and the capture command, never measured on."""
    if cfg.trace:
        out = Path(str(cfg.trace)).expanduser()
        return load_trace(out)  # its own manifest knows how it was captured; this config may not
    out = default_trace_dir(cfg)
    if (out / "manifest.json").exists():
        return load_trace(out, capture_command(cfg))
    from filelock import FileLock

    # Parallel sweep cells (joblib, submitit) may need the same trace at once: one captures, the others wait
    # on the lock and then load its capture instead of racing to replace the directory.
    check_trace_folder(out)
    with FileLock(str(out.parent / f".{out.name}.lock")):
        if (out / "manifest.json").exists():
            return load_trace(out, capture_command(cfg))
        trace = capture(cfg, handle, out)
    trace.captured = True
    return trace


def calib_windows(cfg: Any, handle: ModelHandle) -> list[KVSequence]:
    """The run trace's calibration windows (disjoint from the evaluated ones), captured once, then reused."""
    return [s.kv for s in load_or_capture(cfg, handle).calib]
