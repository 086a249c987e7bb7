"""The config a measuring command works from, read once before any work starts: the model fields it leaves to the
checkpoint or the device resolved (:func:`kvbench.core.config.resolve_model`), then every model, dataset and shared
run field checked. A bad value is a one-line ``ValueError`` naming the field, its value and what is allowed, which
the CLI prints as one line before anything is loaded, captured or written.

The checks are those the code reading each field makes when it gets there (the cache dtype, the split,
``metrics.resume``, ``metrics.fit_draws``, the model's source and path), called here first, and those for fields that
code took on trust: a window count or length that is not a positive whole number failed inside torch or after a
whole capture, and ``device=cuda`` on a machine where torch sees no GPU was timed on the CPU and filed as cuda.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from kvbench.core.checks import check_choice, check_count, check_flag
from kvbench.core.config import available, resolve_model
from kvbench.inputs.capture import cache_dtype, split_of
from kvbench.inputs.models import check_model_cfg
from kvbench.measure.fit_draws import fit_draws
from kvbench.store.results import resume_mode

#: the dataset that reads ``dataset.path``; the others are packaged text or the interpreter's own library
LOCAL_TEXT = "text"


def read_config(cfg: Any) -> Any:
    """``cfg`` with its model fields resolved (in place), once every field below is checked; a ValueError else."""
    resolve_model(cfg)
    check_model_cfg(cfg.model)
    check_dataset(cfg.dataset)
    check_run_fields(cfg)
    return cfg


def _set(node: Any, key: str) -> Any:
    """``node.key``; None where it is absent or left ``???``."""
    if OmegaConf.is_config(node) and (key not in node or OmegaConf.is_missing(node, key)):
        return None
    return node.get(key) if hasattr(node, "get") else None


def check_dataset(ds: Any) -> None:
    check_choice("dataset", "name", ds.name, available("dataset"))
    path = _set(ds, "path")
    if ds.name == LOCAL_TEXT and path in (None, ""):
        raise ValueError("dataset.path is not set; dataset=text reads a local file: dataset=text dataset.path=FILE "
                         "(.txt: one document; .jsonl: one document per line)")
    if ds.name != LOCAL_TEXT and path not in (None, ""):
        raise ValueError(f"dataset.path={path} is only read with dataset=text; dataset={ds.name} loads its own "
                         f"text: drop dataset.path, or use dataset=text dataset.path={path}")
    if not isinstance(ds.field, str) or not ds.field:
        raise ValueError(f"dataset.field={ds.field!r} is not allowed; name the .jsonl field holding each document's "
                         "text")
    check_count("dataset", "n_sequences", ds.n_sequences, 1, "evaluated windows")
    check_count("dataset", "n_calib", ds.n_calib, 0, "calibration windows")
    check_count("dataset", "seq_len", ds.seq_len, 2, "prefix tokens whose KV is compressed")
    check_count("dataset", "eval_len", ds.eval_len, 1, "held-out continuation tokens scored after the prefix")
    check_count("dataset", "seed", ds.seed, 0)
    split_of(ds)


def check_device(device: Any) -> None:
    """``device``: ``cpu``, or ``cuda`` / ``cuda:N`` where torch sees that GPU; anything else would be measured
    elsewhere than the summary says."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    allowed = ["cpu", *(["cuda", *(f"cuda:{i}" for i in range(n))] if n else [])]
    if str(device) not in allowed:
        why = ": torch sees no CUDA device on this machine" if str(device).startswith("cuda") and not n else ""
        raise ValueError(f"device={device!r} is not allowed{why}; choose one of {allowed}")


def check_run_fields(cfg: Any) -> None:
    """The fields every measuring command shares (configs/base.yaml) and, where the config has them, run's metrics
    and rate (configs/run.yaml)."""
    cache_dtype(cfg.dtype)
    check_device(cfg.device)
    check_count("", "seed", cfg.seed, 0)
    if _set(cfg, "trace") is not None and not isinstance(cfg.trace, str):
        raise ValueError(f"trace={cfg.trace!r} is not allowed; give the folder of a trace (or null to capture)")
    check_flag("capture", "pre_rope", cfg.capture.pre_rope)
    metrics = cfg.get("metrics") or {}
    resume_mode(metrics.get("resume", "code"))
    if "nll" in metrics:
        check_flag("metrics", "nll", metrics.nll)
    for name, least in (("ci_block", 1), ("recall_tokens", 0), ("ci_resamples", 1), ("ci_seed", 0)):
        if name in metrics:
            check_count("metrics", name, metrics[name], least)
    if "recall_from" in metrics:
        start = metrics.recall_from
        if isinstance(start, bool) or not isinstance(start, (int, float)) or not 0 <= start < 1:
            raise ValueError(f"metrics.recall_from={start!r} is out of range; allowed: 0 <= recall_from < 1 (where in "
                             "the prefix the repeated passage starts, as a fraction of its length)")
    fit_draws(metrics)
    if _set(cfg.get("rate") or {}, "amortize_tokens") is not None:
        check_count("rate", "amortize_tokens", cfg.rate.amortize_tokens, 1, "tokens one fitted codec serves")

